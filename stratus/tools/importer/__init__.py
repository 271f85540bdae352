"""``stratus models import``: bring your own model file into the repository.

One ONNX, ``.tflite`` or OpenVINO IR (``.xml`` with its ``.bin``) file becomes an FP32
variant of a family, for one tier:

1. its inputs and outputs are read from the file and refused, naming the file, where
   Stratus could not serve them: an operator the runtimes here cannot run, a dynamic
   dimension other than the batch (dimension 0), more than one input, no output
   ``[batch, classes]`` (the first such is the confidence's; a ZipMap's probability maps
   count as one), tensors that differ from the family's other variants, or a file that
   no runtime here opens and runs; a runtime that refuses it is skipped with its reason,
   and the variant records the runtimes that ran it (``runtimes``, or ``--runtimes``);
2. the file is copied into ``DIR/FAMILY/`` as ``VARIANT.EXT``, and converted to the
   formats the tier's runtimes prefer where a converter exists here: ONNX and ``.tflite``
   to OpenVINO IR (where OpenVINO runs the file) with FP32 weights (``Core.read_model`` + ``save_model``; not
   ``convert_model``, which leaves OpenBLAS threads spinning in this process, see
   ``models/build/onnx_files.py``). Nothing converts IR or ``.tflite`` to ONNX here;
3. ``family.toml`` is created (``[family]``, ``[[inputs]]``, ``[[outputs]]``,
   ``[confidence]``, ``[thresholds]`` (empty), ``[current]``, ``[[variants]]``) or extended
   (a ``[[variants]]`` block appended; the tier's ``[current]`` entry written where the file
   names none);
4. from an ONNX file with labelled data at hand (the calibration part of ``--data``, else a
   shipped family's bundled calibration split), its INT8 and FP16 children are made
   (:mod:`.children`: ``VARIANT-int8``, ``VARIANT-fp16``, each with its OpenVINO IR where the
   variant has one and its own temperature), unless ``--no-children``; never from synthetic
   inputs, nor from ``.tflite`` or IR (nothing here converts those to ONNX): a note says why;
5. the new variant and its children are verified (``stratus.tools.verify``) in every runtime
   here, on the report part of ``--data FILE.npz``, else a shipped family's bundled held-out
   split, else on synthetic inputs (accuracy then not measured); a child that loses more than
   the family's ``max_accuracy_drop`` against the variant (or whose runtimes disagree) is
   dropped, its files removed, with a note giving its drop; ``verified.toml`` gets the kept
   line's entries (what agents trust to serve a child where the CPU runs it natively).

The new text is parsed as a family config and the variant verified *before* the file is
replaced (a temporary file, then a rename; ``verified.toml`` likewise): a refused import leaves
``family.toml``, ``verified.toml`` and the folder as they were.

The default variant name is ``FAMILY-TIER`` (``defects-edge``). The first variant of a tier
becomes its current variant; a later one is added beside it, served only when a request
pins it by name (or a rollout sends it traffic), until ``[current]`` names it.

For a new family, the confidence is taken from the first output (``--method``, default
``max_softmax``); whether that output is already probabilities (``apply_softmax = false``)
or logits (``true``) is ``--probabilities`` / ``--logits``, or else detected: the model runs
on 16 inputs (the first examples of ``--data``, or synthetic ones drawn from the input
spec, seed 0) and its output counts as probabilities when every row lies in [0, 1] and sums
to 1 (within 1e-3). A variant for an existing family must give the same kind of output.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from stratus.errors import ConfigError, StratusError
from stratus.tools.importer.interfaces import _first_reason, check_fits, format_of, read_interface
from stratus.tools.importer.options import ImportOptions, ImportResult, _check_names, _Names, _tier
from stratus.tools.importer.stage import _import, _Plan
from stratus.tools.importer.staging import _Staged
from stratus.tools.importer.trial import probe_runtimes
from stratus.tools.verify.report import format_report

__all__ = ["ImportOptions", "ImportResult", "describe", "import_model"]


def import_model(source: Path, options: ImportOptions) -> ImportResult:
    """Add ``source`` to a family as a new FP32 variant (with its INT8 and FP16 children where
    they can be made and verified); refuse with a reason naming the file.

    Every refusal is a ConfigError with one line of reason (then the verify table, where
    verify refused it): a model file is the user's input, and an odd one that trips
    something unforeseen here must not end in a traceback either."""
    try:
        return _import_checked(source, options)
    except StratusError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{source}: cannot import it: {type(exc).__name__}: {_first_reason(str(exc))} "
            "(nothing was imported; an unexpected error, please report it with the file)"
        ) from exc


def _import_checked(source: Path, options: ImportOptions) -> ImportResult:
    fmt = format_of(source)
    tier = _tier(options.tier, source)
    names = _Names.scan(options.root)
    existing = names.families.get(options.family)
    name = options.variant or f"{options.family}-{tier.label}"
    _check_names(source, options, name, existing, names)
    interface = read_interface(source, fmt)
    if existing is not None:
        check_fits(existing, interface, source)
    folder = existing.folder if existing is not None else options.root / options.family
    with _cache(options.cache_dir) as cache:
        runtimes = probe_runtimes(
            source,
            fmt=fmt,
            interface=interface,
            options=options,
            folder=folder,
            existing=existing,
            cache=cache,
        )
        plan = _Plan(
            source=source,
            fmt=fmt,
            tier=tier,
            name=name,
            interface=interface,
            existing=existing,
            runtimes=runtimes,
            taken=names.used,
        )
        staged = _Staged(folder)
        try:
            return _import(plan, staged, options, cache)
        except BaseException:
            staged.undo()
            raise


@contextlib.contextmanager
def _cache(given: Path | None) -> Iterator[Path]:
    """The runtimes' cache: the one given, or a scratch folder removed afterwards."""
    if given is not None:
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="stratus-import-") as scratch:
        yield Path(scratch)


def describe(result: ImportResult) -> str:
    family, variant = result.family, result.variant
    created = f"new family, {family.source}" if result.new_family else f"extended {family.source}"
    spec = family.confidence
    tensors = "; ".join(
        f"{kind} {t.name} {t.datatype} {list(t.shape)}"
        for kind, items in (("input", family.inputs), ("output", family.outputs))
        for t in items
    )
    role = "current" if result.current else "not current"
    kept = "".join(f", {c.name} ({c.precision})" for c in result.children)
    lines = [
        f"imported {variant.name} ({variant.tier.label} tier, FP32, {role}){kept} into family '{family.name}' ({created})",
        *(f"  {note}" for note in result.notes),
        f"  {tensors}",
        f"  confidence: {spec.method.value} of '{spec.output}', apply_softmax = {str(spec.apply_softmax).lower()}",
        "",
        format_report(result.report),
        "",
        f"accuracy above: on {result.labelled}"
        if result.labelled
        else "accuracy: n/a (no labelled data; verified on synthetic inputs; pass --data FILE.npz to measure it)",
        *result.serving,
        *(f"warning: {warning}" for warning in result.warnings),
    ]
    return "\n".join(lines)
