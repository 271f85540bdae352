"""An imported FP32 variant's lower-precision children: an INT8 one (ONNX Runtime's static
quantization, calibrated on labelled examples) and an FP16 one (ONNX Runtime's float16
converter), each with its OpenVINO IR where the parent has one, made as ``models/build/``
makes the shipped families' (:mod:`stratus.tools.lower_precision`).

An agent serves a child only where its CPU runs the child's arithmetic natively and its
``verified.toml`` says the child loses no more held-out accuracy than the family allows
(:mod:`stratus.families.precision`); without children an imported model is served in FP32
on every CPU, however fast the CPU's INT8 or FP16 is.

A child is made only where it can be made honestly: from an ONNX file (nothing here converts
``.tflite`` or IR to ONNX), and with labelled examples at hand, since INT8's activation ranges
must come from real inputs (ranges measured on synthetic noise clip or waste the 256 steps
where real inputs lie) and a child is kept only when its accuracy drop is measured.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from stratus.families.cpu import CPU_FLAGS_VARIABLE, Hardware, native_on
from stratus.families.precision import (
    VerificationRecord,
    choose_variant,
    format_record,
    load_verification,
    record_path,
)
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.tools.calibrate import labelled_data
from stratus.tools.datasets import Split
from stratus.tools.importer.interfaces import _first_reason, _nodes
from stratus.tools.importer.staging import _Staged
from stratus.tools.importer.trial import _bundled_calibration, _fit_temperature
from stratus.tools.lower_precision import QUANTIZED_OPS, fp16_model, save_ir, write_onnx_int8
from stratus.tools.verify.classifier import build_record
from stratus.tools.verify.report import VerifyRow

SUFFIXES: Final = {"INT8": "int8", "FP16": "fp16"}
WHY_DATA: Final = (
    "INT8's static quantization takes its activation ranges from real examples (ranges measured "
    "on synthetic noise would be wrong), and a child is kept only when its accuracy drop against "
    "its parent is measured on labelled ones; pass --data FILE.npz to build them"
)


@dataclass(frozen=True, kw_only=True)
class Source:
    """What the children are made from: the placed FP32 variant, its family as it will read,
    the examples that calibrate them, and the names they must not take."""

    parent: VariantSpec
    family: FamilySpec
    labelled: labelled_data.LabelledData | None
    calibration: Split
    calibration_name: str
    taken: Mapping[str, str]  # variant or family name -> the family using it


@dataclass(frozen=True, kw_only=True)
class Made:
    """The children made (files placed, temperatures fitted), with how each was made."""

    children: tuple[VariantSpec, ...] = ()
    how: Mapping[str, str] = dataclasses.field(default_factory=dict)  # child -> its config comment
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def calibration_of(
    family: FamilySpec, labelled: labelled_data.LabelledData | None
) -> tuple[Split, str] | None:
    """The calibration part of --data, else a shipped family's bundled calibration split."""
    if labelled is not None:
        return labelled.calibration, "the calibration part of --data"
    bundled = _bundled_calibration(family)
    return (bundled, f"the bundled calibration split of '{family.name}'") if bundled is not None else None


def why_none(fmt: str, wanted: bool, calibration: tuple[Split, str] | None) -> str | None:
    """Why this import makes no children, or None when it makes them."""
    if not wanted:
        return "no INT8/FP16 children (--no-children): served in FP32 on every CPU"
    if fmt != "onnx":
        kind = {"tflite": "a .tflite file", "openvino": "an OpenVINO IR"}[fmt]
        return (
            f"no INT8/FP16 children: they are made from ONNX, and nothing here converts {kind} to "
            "ONNX; import the model's ONNX export to have them"
        )
    if calibration is None:
        return f"no INT8/FP16 children: no labelled data: {WHY_DATA}"
    return None


def make_children(source: Source, staged: _Staged, cache: Path) -> Made:
    """Each child that can be made; one that cannot is a note saying why, never a refusal
    (the FP32 variant is imported whatever its children do)."""
    model = importlib.import_module("onnx").load(str(source.parent.files["onnx"]))
    children, how, notes, warnings = [], {}, [], []
    for precision, make in (("INT8", _int8), ("FP16", _fp16)):
        made = _made(source, staged, precision, functools.partial(make, source, model))
        if isinstance(made, str):
            notes.append(made)
            continue
        child, comment = made
        child = _with_ir(source, staged, child, notes)
        child, fitted, warned = _fit_temperature(source.family, child, source.labelled, cache)
        children.append(child)
        how[child.name] = comment
        notes += [f"{child.name}: {comment}", *([f"{child.name}: {fitted}"] if fitted else [])]
        warnings += warned
    return Made(children=tuple(children), how=how, notes=tuple(notes), warnings=tuple(warnings))


class _NoChild(Exception):
    """Why a child cannot be made of this model (a note, not an error)."""


def _made(
    source: Source, staged: _Staged, precision: str, make: Callable[[Path], str]
) -> str | tuple[VariantSpec, str]:
    """The child whose ONNX file ``make`` writes, with how it was made; or why there is none
    (its file removed again)."""
    name = f"{source.parent.name}-{SUFFIXES[precision]}"
    if name in source.taken or name == source.family.name:
        return f"no {precision} child: the name '{name}' is already used; --variant names the import"
    target = staged.claim(staged.folder / f"{name}.onnx")
    try:
        how = make(target)
    except _NoChild as reason:
        staged.discard([target])
        return f"no {precision} child: {reason}"
    except Exception as exc:  # onnx and onnxruntime raise their own types for a graph they refuse
        staged.discard([target])
        return f"no {precision} child: {type(exc).__name__}: {_first_reason(str(exc))}"
    child = dataclasses.replace(
        source.parent, name=name, precision=precision, parent=source.parent.name, files={"onnx": target}
    )
    return child, how


def _int8(source: Source, model: Any, target: Path) -> str:
    present = {node.op_type for node in _nodes(model.graph)}
    ops = sorted(present & set(QUANTIZED_OPS))
    if not ops:
        raise _NoChild(
            f"it has no {', '.join(QUANTIZED_OPS[:-1])} or {QUANTIZED_OPS[-1]} for ONNX Runtime to quantize "
            f"(its operators: {', '.join(sorted(present))})"
        )
    write_onnx_int8(
        source.parent.files["onnx"],
        target,
        input_name=source.family.inputs[0].name,
        calibration=source.calibration.x,
        op_types=ops,
    )
    return (
        f"INT8 child of {source.parent.name}: ONNX Runtime static quantization (QDQ) of its "
        f"{', '.join(ops)}, int8 symmetric weights, uint8 activations calibrated (MinMax) on "
        f"{source.calibration_name}"
    )


def _fp16(source: Source, model: Any, target: Path) -> str:
    del model  # the converter reads the file itself
    converted = fp16_model(source.parent.files["onnx"], target.stem)
    if not _has_fp16(converted):
        kept = ", ".join(sorted({node.op_type for node in _nodes(converted.graph)} - {"Cast"}))
        raise _NoChild(f"ONNX Runtime's float16 converter keeps all of its operators ({kept}) in FP32")
    target.write_bytes(converted.SerializeToString())
    return (
        f"FP16 child of {source.parent.name}: ONNX Runtime's float16 converter (FP16 weights and "
        "arithmetic, FP32 inputs and outputs)"
    )


def _has_fp16(model: Any) -> bool:
    """Whether the converter turned anything to FP16: for a model whose every operator it
    keeps in FP32 (a tree ensemble, a linear classifier) a child would be its parent's copy."""
    float16 = importlib.import_module("onnx").TensorProto.FLOAT16
    constants = [a.t for n in _nodes(model.graph) if n.op_type == "Constant" for a in n.attribute]
    return any(t.data_type == float16 for t in [*model.graph.initializer, *constants])


def _with_ir(source: Source, staged: _Staged, child: VariantSpec, notes: list[str]) -> VariantSpec:
    """The child with its OpenVINO IR, where its parent has one: the INT8 one read from the
    INT8 ONNX (weights kept as they are), the FP16 one compressed from the FP32 ONNX, as
    ``models/build/`` makes them."""
    if "openvino" not in source.parent.files:  # --no-convert, or OpenVINO cannot run the parent
        return child
    xml = staged.claim(staged.folder / f"{child.name}.xml")
    staged.claim(xml.with_suffix(".bin"))
    fp16 = child.precision == "FP16"
    try:
        save_ir(source.parent.files["onnx"] if fp16 else child.files["onnx"], xml, fp16=fp16)
    except Exception as exc:  # OpenVINO raises its own types; the child still serves from ONNX
        staged.discard([xml, xml.with_suffix(".bin")])
        notes.append(f"{child.name}: no OpenVINO IR: OpenVINO cannot convert it ({_first_reason(str(exc))})")
        return child
    return dataclasses.replace(child, files={**child.files, "openvino": xml})


# ---------------------------------------------------------------------------------------------
# After verify: what is kept, the record, and what each CPU would serve
# ---------------------------------------------------------------------------------------------


def judged(
    family: FamilySpec, children: Sequence[VariantSpec], rows: Sequence[VerifyRow]
) -> tuple[list[VariantSpec], list[str]]:
    """The children verified within the family's ``max_accuracy_drop`` with every runtime
    agreeing, and a note for each of the others (measured drop against the limit)."""
    kept, notes = [], []
    for child in children:
        problem = _problem(family, child, [r for r in rows if r.name == child.name])
        if problem is None:
            kept.append(child)
        else:
            notes.append(f"{child.name} not kept (its files removed): {problem}")
    return kept, notes


def _problem(family: FamilySpec, child: VariantSpec, rows: Sequence[VerifyRow]) -> str | None:
    if not rows:
        return "no runtime here ran it"
    failed = next((r for r in rows if r.failed), None)
    if failed is not None:
        return f"{failed.runtime} ({failed.format}): {failed.status}"
    drop = max(r.accuracy_drop or 0.0 for r in rows)
    if all(r.within_tolerance for r in rows):
        return None
    agreement = min(r.agreement if r.agreement is not None else 1.0 for r in rows)
    return (
        f"held-out accuracy drop {drop:.4f} against {child.parent} is above the family's "
        f"max_accuracy_drop {family.max_accuracy_drop:.4f} (top-1 agreement {agreement:.4f})"
    )


def record_text(family: FamilySpec, line: Sequence[str], rows: Sequence[VerifyRow]) -> str | None:
    """The family's ``verified.toml`` with the imported line's entries (the FP32 variant and
    its children, hashes of every file) added to or replacing its own; None where there are
    no children and no record yet (an FP32 variant needs none)."""
    existing = load_verification(family)
    if existing is None and len(line) == 1:
        return None
    measured = build_record(
        dataclasses.replace(family, variants=tuple(family.variant(n) for n in line)), rows
    )
    others = {k: v for k, v in (existing.variants if existing else {}).items() if k not in measured.variants}
    merged = VerificationRecord(
        family=family.name,
        max_accuracy_drop=family.max_accuracy_drop,
        variants={**others, **measured.variants},
        source=record_path(family),
    )
    return format_record(merged)


def serving(family: FamilySpec, parent: VariantSpec, hardware: Hardware) -> list[str]:
    """Which variant of the imported line an agent (or the cloud gateway) on this CPU would
    serve and why: the agents' own choice (:func:`choose_variant`, on the record just written,
    so ``STRATUS_CPU_FLAGS`` moves it as it moves theirs); and the CPUs that would choose each child."""
    choice = choose_variant(
        family, parent.tier, hardware=hardware, record=load_verification(family), line=parent
    )
    where = f" (flags from {CPU_FLAGS_VARIABLE})" if hardware.flags_from == CPU_FLAGS_VARIABLE else ""
    kept = [child for child in family.line_of(parent) if child.parent is not None]
    alone = "" if kept else " (it has no children)"
    lines = [f"this CPU{where} would serve {choice.variant.name} for {parent.name}{alone}: {choice.reason}"]
    return lines + [f"{c.name} ({c.precision}) is chosen on {native_on(c.precision)}" for c in kept]
