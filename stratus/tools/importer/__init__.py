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
4. the new variant is verified (``stratus.tools.verify``) in every runtime here, on the report
   part of ``--data FILE.npz``, else a shipped family's bundled held-out split, else on
   synthetic inputs (accuracy then not measured).

The new text is parsed as a family config and the variant verified *before* the file is
replaced (a temporary file, then a rename): a refused import leaves ``family.toml`` and the
folder as they were.

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
import dataclasses
import importlib
import json
import os
import re
import shutil
import tempfile
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from stratus import codec
from stratus.codec import Array
from stratus.confidence import TEMPERATURE_GRID, ConfidenceMethod, fit_temperature
from stratus.errors import ConfigError, InvalidInput, StratusError
from stratus.repository import (
    CONFIG_NAME,
    ConfidenceSpec,
    FamilySpec,
    TensorSpec,
    VariantSpec,
    load_family,
)
from stratus.runtimes import (
    RUNNERS,
    Choice,
    LoadOptions,
    availability_of,
    available_runtimes,
    load_runner,
    open_runner,
)
from stratus.runtimes.base import warmed_up
from stratus.tiers import Tier
from stratus.tools.calibrate import labelled_data
from stratus.tools.datasets import Split, dataset_for
from stratus.tools.verify.classifier import (
    bundled_held_out,
    excluded_runtimes,
    synthetic_inputs,
    verify_family,
)
from stratus.tools.verify.report import VerifyReport, format_report

EXTENSIONS: Final = {".onnx": "onnx", ".tflite": "tflite", ".xml": "openvino"}
SUFFIXES: Final = {"onnx": ".onnx", "tflite": ".tflite", "openvino": ".xml"}
NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
PROBE_ITEMS: Final = 16
# Operator domains ONNX Runtime or OpenVINO implement; anything else is a custom operator.
KNOWN_DOMAINS: Final = ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")
_SCHEMA_DOMAINS: Final = ("", "ai.onnx", "ai.onnx.ml")
_OV_TYPES: Final = {
    "f16": "FP16",
    "f32": "FP32",
    "f64": "FP64",
    "i8": "INT8",
    "i16": "INT16",
    "i32": "INT32",
    "i64": "INT64",
    "u8": "UINT8",
    "u16": "UINT16",
    "u32": "UINT32",
    "u64": "UINT64",
    "boolean": "BOOL",
}


@dataclass(frozen=True, kw_only=True)
class Interface:
    """A model file's inputs and outputs, as a family config writes them (-1: the batch)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def scores(self) -> TensorSpec | None:
        """The output a confidence is taken from: the first floating point [batch, classes
        >= 2] one (skl2onnx puts the label first, then the probabilities)."""
        return next((t for t in self.outputs if _is_scores(t)), None)


def _is_scores(spec: TensorSpec) -> bool:
    return len(spec.shape) == 2 and spec.shape[1] >= 2 and spec.datatype in ("FP16", "FP32", "FP64")


@dataclass(frozen=True, kw_only=True)
class Runtimes:
    """Which runtimes here ran the file (opened and warmed up, as an agent would), which
    refused it and why, and whether ``--runtimes`` chose them."""

    accepted: tuple[str, ...]
    refused: Mapping[str, str]
    unchecked: Mapping[str, str]  # named with --runtimes but not available here
    chosen: bool

    @property
    def recorded(self) -> tuple[str, ...]:
        """The variant's ``runtimes`` in family.toml: what --runtimes said, else (when a
        runtime refused the file) the ones that ran it; empty: any runtime."""
        if self.chosen:
            return (*self.accepted, *self.unchecked)
        return self.accepted if self.refused else ()


@dataclass(frozen=True, kw_only=True)
class ImportOptions:
    family: str
    tier: str
    variant: str | None = None
    root: Path = Path("models")
    # New family only: the confidence method (default max_softmax).
    method: ConfidenceMethod | None = None
    # True: the output is logits; False: probabilities; None: detect.
    logits: bool | None = None
    data: Path | None = None
    convert: bool = True
    cache_dir: Path | None = None
    # Only these runtimes may serve the variant (recorded in family.toml); None: every
    # runtime here that runs the file.
    runtimes: tuple[str, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    family: FamilySpec
    variant: VariantSpec
    new_family: bool
    current: bool
    notes: tuple[str, ...]
    report: VerifyReport
    labelled: str | None  # what verify measured accuracy on; None: synthetic inputs
    # What the user should act on (also printed to stderr): a temperature fitted at the edge
    # of its search grid, for one.
    warnings: tuple[str, ...] = ()


def import_model(source: Path, options: ImportOptions) -> ImportResult:
    """Add ``source`` to a family as a new FP32 variant; refuse with a reason naming the file.

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
        )
        staged = _Staged(folder)
        try:
            return _import(plan, staged, options, cache)
        except BaseException:
            staged.undo()
            raise


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """What is imported, checked: the file, its format and tensors, where it goes."""

    source: Path
    fmt: str
    tier: Tier
    name: str
    interface: Interface
    existing: FamilySpec | None
    runtimes: Runtimes


def format_of(source: Path) -> str:
    """The repository format of a model file, from its extension; refuses missing files."""
    fmt = EXTENSIONS.get(source.suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"{source}: unknown model format '{source.suffix}'; import takes .onnx, .tflite "
            "or OpenVINO IR (.xml with its .bin)"
        )
    if not source.is_file():
        raise ConfigError(f"{source}: no such file")
    if fmt == "openvino" and not source.with_suffix(".bin").is_file():
        raise ConfigError(f"{source}: its weights {source.with_suffix('.bin')} are missing")
    return fmt


def _tier(text: str, source: Path) -> Tier:
    try:
        return Tier.parse(text)
    except InvalidInput:
        raise ConfigError(f"{source}: bad tier '{text}': expected one of device, edge, cloud") from None


@dataclass(frozen=True)
class _Names:
    """The families of a repository folder, and every name a new variant must not take."""

    families: Mapping[str, FamilySpec]
    used: Mapping[str, str]  # variant or family name -> the family that uses it

    @classmethod
    def scan(cls, root: Path) -> _Names:
        families = {}
        for path in sorted(root.glob(f"*/{CONFIG_NAME}")) if root.is_dir() else []:
            family = load_family(path)
            families[family.name] = family
        used = {v.name: f.name for f in families.values() for v in f.variants}
        return cls(families, {**used, **{name: name for name in families}})


def _check_names(
    source: Path, options: ImportOptions, variant: str, existing: FamilySpec | None, names: _Names
) -> None:
    for what, name in (("family", options.family), ("variant", variant)):
        if not NAME_PATTERN.fullmatch(name):
            raise ConfigError(f"{source}: bad {what} name '{name}': use letters, digits, '.', '_' and '-'")
    owner = names.used.get(variant)
    if owner is not None:
        whose = "a family's name" if owner == variant else f"a variant of family '{owner}'"
        raise ConfigError(
            f"{source}: variant name '{variant}' is already used ({whose}); choose another with --variant"
        )
    if existing is None and options.family in names.used:
        raise ConfigError(
            f"{source}: '{options.family}' is a variant of family '{names.used[options.family]}'; "
            "a new family needs a name of its own"
        )
    if existing is None and (options.root / options.family / CONFIG_NAME).exists():
        raise ConfigError(
            f"{source}: {options.root / options.family / CONFIG_NAME} already exists for another family"
        )
    if existing is not None and options.method is not None and options.method != existing.confidence.method:
        raise ConfigError(
            f"{source}: --method {options.method.value}: family '{existing.name}' already uses "
            f"{existing.confidence.method.value} ([confidence] in {existing.source})"
        )


# ---------------------------------------------------------------------------------------------
# Reading a model file
# ---------------------------------------------------------------------------------------------


def read_interface(source: Path, fmt: str) -> Interface:
    """The file's inputs and outputs, once every runtime that reads its format here has
    loaded it; refused where Stratus could not serve it."""
    reader = {"onnx": _onnx_interface, "tflite": _tflite_interface, "openvino": _openvino_interface}[fmt]
    interface = reader(source)
    _check_interface(source, interface)
    return interface


def _check_interface(source: Path, interface: Interface) -> None:
    if len(interface.inputs) != 1:
        raise ConfigError(
            f"{source}: has {len(interface.inputs)} inputs "
            f"({', '.join(t.name for t in interface.inputs)}); import takes single-input models"
        )
    first = interface.outputs[0]
    if interface.scores is None:
        raise ConfigError(
            f"{source}: output '{first.name}' is {first.datatype} {list(first.shape)}; the confidence is "
            "taken over classes, so one output must be floating point [batch, classes >= 2]"
        )


def _spec(source: Path, kind: str, name: str, datatype: str, dims: Sequence[int | str | None]) -> TensorSpec:
    """A TensorSpec from a file's dims (an int is fixed, anything else dynamic)."""
    if not name:
        raise ConfigError(f"{source}: an {kind} has no name")
    if datatype not in codec.DATATYPES or datatype == "BYTES":
        raise ConfigError(f"{source}: {kind} '{name}' has type {datatype}, which Stratus cannot carry")
    if not dims:
        raise ConfigError(f"{source}: {kind} '{name}' is a scalar; Stratus batches along dimension 0")
    for axis, dim in enumerate(dims[1:], start=1):
        if not isinstance(dim, int) or dim <= 0:
            raise ConfigError(
                f"{source}: {kind} '{name}' has a dynamic dimension {axis} ({dim or '?'}); "
                "Stratus needs fixed sizes except the batch (dimension 0)"
            )
    if isinstance(dims[0], int) and dims[0] > 0:
        raise ConfigError(
            f"{source}: {kind} '{name}' has a fixed batch dimension ({dims[0]}); export it with a dynamic "
            "dimension 0 (for example torch.onnx.export(..., dynamic_axes={'" + name + "': {0: 'batch'}}))"
        )
    return TensorSpec(
        name=name, datatype=datatype, shape=(-1, *(int(d) for d in dims[1:] if isinstance(d, int)))
    )


def _onnx_interface(source: Path) -> Interface:
    onnx = importlib.import_module("onnx")
    try:
        model = onnx.load(str(source), load_external_data=False)
    except Exception as exc:  # a protobuf that is not a model: onnx raises several types
        raise ConfigError(f"{source}: not a readable ONNX model ({exc})") from None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        raise ConfigError(f"{source}: keeps weights in external data files; save the model as one file")
    _check_operators(source, model, onnx)
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception as exc:  # onnx raises its own types for an inconsistent graph
        raise ConfigError(f"{source}: its shapes do not check out ({_first_reason(str(exc))})") from None
    initializers = {t.name for t in model.graph.initializer}

    def spec(kind: str, t: Any) -> TensorSpec:
        if kind == "output" and t.type.HasField("sequence_type"):
            return _zipmap_spec(source, model.graph, t.name)
        return _spec(source, kind, t.name, _onnx_datatype(t, onnx), _onnx_dims(t))

    return Interface(
        inputs=tuple(spec("input", t) for t in model.graph.input if t.name not in initializers),
        outputs=tuple(spec("output", t) for t in model.graph.output),
    )


ZIPMAP_HINT: Final = "export with options={id(model): {'zipmap': False}} for a probabilities tensor"


def _zipmap_spec(source: Path, graph: Any, name: str) -> TensorSpec:
    """A ZipMap's output (one {class: probability} map per item, skl2onnx's default
    ``output_probability``) as Stratus carries it: FP32 [batch, classes], the columns in class
    order (ONNX Runtime reads it so, :func:`stratus.runtimes.ort.dense_probabilities`)."""
    node = next((n for n in graph.node if name in n.output), None)
    if node is None or node.op_type != "ZipMap":
        raise ConfigError(
            f"{source}: output '{name}' is a sequence; Stratus carries tensors (and reads a ZipMap's "
            "probability maps as a [batch, classes] tensor)"
        )
    attributes = {a.name: a for a in node.attribute}
    labels: list[Any] = list(
        attributes["classlabels_int64s"].ints
        if "classlabels_int64s" in attributes
        else attributes["classlabels_strings"].strings
        if "classlabels_strings" in attributes
        else []
    )
    if len(labels) < 2:
        raise ConfigError(f"{source}: output '{name}' (ZipMap) has {len(labels)} class labels; it needs >= 2")
    if labels != sorted(labels):
        raise ConfigError(
            f"{source}: output '{name}' (ZipMap) lists its classes out of order, so its maps cannot be "
            f"read as [batch, classes] in class order; {ZIPMAP_HINT}"
        )
    return TensorSpec(name=name, datatype="FP32", shape=(-1, len(labels)))


def _onnx_datatype(value: Any, onnx: Any) -> str:
    elem = value.type.tensor_type.elem_type
    try:
        return codec.datatype_of(np.empty(0, dtype=onnx.helper.tensor_dtype_to_np_dtype(elem)))
    except (KeyError, ValueError, TypeError, StratusError):
        return str(onnx.TensorProto.DataType.Name(elem))


def _onnx_dims(value: Any) -> list[int | str | None]:
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return [None, None]  # unknown rank: reported as dynamic
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]


def _nodes(graph: Any) -> Iterator[Any]:
    """Every node, including those of subgraphs (If, Loop, Scan)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _nodes(attribute.g)
            for sub in attribute.graphs:
                yield from _nodes(sub)


def _check_operators(source: Path, model: Any, onnx: Any) -> None:
    """Refuse custom and unknown operators by name, before a runtime says it less plainly."""
    local = {(f.domain, f.name) for f in model.functions}
    for node in _nodes(model.graph):
        domain = node.domain or ""
        if (domain, node.op_type) in local:
            continue
        where = f"node '{node.name}'" if node.name else "a node"
        if domain not in KNOWN_DOMAINS:
            raise ConfigError(
                f"{source}: unsupported operator '{node.op_type}' (custom domain '{domain}', {where}); "
                "ONNX Runtime and OpenVINO cannot run it here"
            )
        if domain in _SCHEMA_DOMAINS and not onnx.defs.has(node.op_type, domain):
            raise ConfigError(
                f"{source}: unsupported operator '{node.op_type}' ({where}): not an ONNX operator"
            )


def _runtime_loads(source: Path, runtime: str, load: Callable[[], Any]) -> Any:
    try:
        return load()
    except Exception as exc:  # each runtime raises its own types for a model it cannot run
        raise ConfigError(f"{source}: {runtime} cannot load it: {_first_reason(str(exc))}") from None


def _first_reason(message: str) -> str:
    """The useful part of a runtime's message: OpenVINO's list of unconverted operators."""
    found = re.search(r"No conversion rule found for operations: ([^\n]+)", message)
    if found:
        return f"unsupported operator(s) {found.group(1).strip()}"
    found = re.search(r"Unsupported value_info type: (\S+)", message)
    if found:
        return f"output '{found.group(1)}' is not a tensor (a ZipMap's probability maps, skl2onnx's default)"
    return " ".join(message.split())[:400]


def _openvino() -> Any:
    return importlib.import_module("openvino")


def _tflite_interface(source: Path) -> Interface:
    from stratus.runtimes.litert import interpreter_class

    def load() -> Any:
        interpreter = interpreter_class()(model_path=str(source))
        interpreter.allocate_tensors()
        return interpreter

    interpreter = _runtime_loads(source, "LiteRT", load)

    def specs(kind: str, details: Sequence[Mapping[str, Any]]) -> tuple[TensorSpec, ...]:
        return tuple(
            _spec(
                source,
                kind,
                d["name"],
                codec.datatype_of(np.empty(0, dtype=d["dtype"])),
                [int(x) if x > 0 else None for x in d.get("shape_signature", d["shape"])],
            )
            for d in details
        )

    return Interface(
        inputs=specs("input", interpreter.get_input_details()),
        outputs=specs("output", interpreter.get_output_details()),
    )


def _openvino_interface(source: Path) -> Interface:
    model = _runtime_loads(source, "OpenVINO", lambda: _openvino().Core().read_model(str(source)))

    def specs(kind: str, ports: Sequence[Any]) -> tuple[TensorSpec, ...]:
        result = []
        for port in ports:
            names = port.get_names()
            name = port.get_any_name() if names else ""
            type_name = port.get_element_type().get_type_name()
            shape = port.get_partial_shape()
            dims = (
                [None, None]
                if shape.rank.is_dynamic
                else [d.get_length() if d.is_static else None for d in shape]
            )
            result.append(_spec(source, kind, name, _OV_TYPES.get(type_name, type_name), dims))
        return tuple(result)

    return Interface(inputs=specs("input", model.inputs), outputs=specs("output", model.outputs))


def probe_runtimes(
    source: Path,
    *,
    fmt: str,
    interface: Interface,
    options: ImportOptions,
    folder: Path,
    existing: FamilySpec | None,
    cache: Path,
) -> Runtimes:
    """Open and warm the file in every runtime here that reads its format (or those of
    ``--runtimes``), as an agent would load it.

    A runtime that refuses it is skipped with its reason (OpenVINO has no ``ai.onnx.ml``
    operators, nor ZipMap's sequence outputs); the file is refused only when none runs it,
    or when one that ``--runtimes`` names refuses it."""
    readers = [name for name, runner in RUNNERS.items() if fmt in runner.formats]
    wanted = _wanted_runtimes(source, fmt, readers, options.runtimes)
    variant = VariantSpec(
        name="probe",
        family=options.family,
        tier=_tier(options.tier, source),
        precision="FP32",
        files={fmt: source},
    )
    family = _probe_family(options, interface, variant, existing, folder)
    accepted, refused, unchecked = [], {}, {}
    for runtime in wanted:
        status = availability_of(runtime)
        if not status.available:
            unchecked[runtime] = status.reason
            continue
        choice = Choice(runtime=runtime, format=fmt, path=source)
        try:
            opened = open_runner(family, variant, choice, LoadOptions(tier=variant.tier, cache_dir=cache))
            warmed_up(opened, runtime, source).close()
        except Exception as exc:  # each runtime raises its own types for a file it cannot run
            refused[runtime] = _first_reason(str(exc))
            continue
        accepted.append(runtime)
    chosen = options.runtimes is not None
    if refused and chosen:
        runtime, reason = next(iter(refused.items()))
        raise ConfigError(f"{source}: {runtime} (named by --runtimes) cannot run it: {reason}")
    if not accepted:
        why = "; ".join(f"{r}: {reason}" for r, reason in {**refused, **unchecked}.items())
        raise ConfigError(f"{source}: no runtime here can run it ({why or 'none reads ' + fmt})")
    return Runtimes(accepted=tuple(accepted), refused=refused, unchecked=unchecked, chosen=chosen)


def _wanted_runtimes(
    source: Path, fmt: str, readers: Sequence[str], given: Sequence[str] | None
) -> Sequence[str]:
    if given is None:
        return readers
    for runtime in given:
        if runtime not in RUNNERS:
            raise ConfigError(f"--runtimes: unknown runtime '{runtime}'; known: {', '.join(sorted(RUNNERS))}")
        if runtime not in readers:
            raise ConfigError(
                f"{source}: --runtimes {runtime}: it does not read {fmt} files (those do: {', '.join(readers)})"
            )
    if len(set(given)) != len(given):
        raise ConfigError(f"--runtimes {','.join(given)}: names a runtime twice")
    return given


def check_fits(family: FamilySpec, interface: Interface, source: Path) -> None:
    """Refuse a model whose tensors differ from the family's: names, datatypes, per-item shapes."""
    for kind, ours, theirs in (
        ("inputs", interface.inputs, family.inputs),
        ("outputs", interface.outputs, family.outputs),
    ):
        mine = {t.name: t for t in ours}
        wanted = {t.name: t for t in theirs}
        if set(mine) != set(wanted):
            raise ConfigError(
                f"{source}: does not fit family '{family.name}': its {kind} are {sorted(mine)}, "
                f"the family's are {sorted(wanted)}"
            )
        for name, spec in mine.items():
            other = wanted[name]
            if spec.datatype != other.datatype or spec.shape[1:] != other.shape[1:]:
                raise ConfigError(
                    f"{source}: does not fit family '{family.name}': {kind[:-1]} '{name}' is "
                    f"{spec.datatype} {list(spec.shape)}, the family's is {other.datatype} {list(other.shape)}"
                )


# ---------------------------------------------------------------------------------------------
# Placing the files, writing the config, verifying
# ---------------------------------------------------------------------------------------------


@dataclass
class _Staged:
    """What an import has created so far, removed again if it is refused."""

    folder: Path
    created: Path | None = None  # the topmost folder this import made
    paths: list[Path] = dataclasses.field(default_factory=list)

    def mkdir(self) -> None:
        missing = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
        if missing:
            self.folder.mkdir(parents=True)
            self.created = missing[-1]

    def claim(self, path: Path) -> Path:
        if path.exists():
            raise ConfigError(f"{path} already exists; choose another variant name with --variant")
        self.paths.append(path)
        return path

    def scratch(self) -> Path:
        """Where the new config is checked; one a killed import left behind is replaced."""
        path = self.folder / f".{CONFIG_NAME}.import"
        path.unlink(missing_ok=True)
        return self.claim(path)

    def keep(self) -> None:
        """The import is committed: what it created now belongs to the family."""
        self.paths.clear()
        self.created = None

    def undo(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)


def _import(plan: _Plan, staged: _Staged, options: ImportOptions, cache: Path) -> ImportResult:
    staged.mkdir()
    convert = options.convert and "openvino" in plan.runtimes.accepted
    files, notes = _place_files(plan, staged, convert=convert)
    notes += _runtime_notes(plan.runtimes, convert=options.convert)
    variant = VariantSpec(
        name=plan.name,
        family=options.family,
        tier=plan.tier,
        precision="FP32",
        files=files,
        runtimes=plan.runtimes.recorded,
    )
    probe = _probe_family(options, plan.interface, variant, plan.existing, staged.folder)
    labelled = labelled_data.load_npz(probe, options.data) if options.data is not None else None
    existing = plan.existing
    original = existing.source.read_text(encoding="utf-8") if existing is not None else None
    logits, why = _output_kind(probe, variant, options.logits, labelled, cache)
    _check_output_kind(plan, logits, why)
    probe = dataclasses.replace(probe, confidence=dataclasses.replace(probe.confidence, apply_softmax=logits))
    variant, fitted, warnings = _fit_temperature(probe, variant, labelled, cache)
    if fitted:
        notes.append(fitted)
    probe = dataclasses.replace(probe, variants=(variant,))
    refusals = plan.runtimes.refused
    if existing is not None and original is not None:
        text = _extended_text(original, existing, variant, plan.source, refusals)
    else:
        text = _new_family_text(probe, variant, plan.source, why, refusals)
    scratch = staged.scratch()
    scratch.write_text(text, encoding="utf-8")
    split, measured_on = _held_out(probe, labelled)
    report = _verify(load_family(scratch), plan.name, split, cache, refusals)
    if not report.ok:
        hint = " (--no-convert keeps only the file's own format)" if len(files) > 1 else ""
        raise ConfigError(
            f"{plan.source}: verify failed, nothing was imported{hint}:\n{format_report(report)}"
        )
    _commit(scratch, staged.folder / CONFIG_NAME, original)
    staged.keep()
    current = existing is None or plan.tier not in existing.current
    if existing is not None and not current:
        notes.append(
            f"the {plan.tier.label} tier's current variant stays {existing.current[plan.tier]}; {plan.name} is "
            "served only when pinned by name (or as a rollout candidate) until [current] names it"
        )
    family = load_family(staged.folder / CONFIG_NAME)
    return ImportResult(
        family=family,
        variant=family.variant(plan.name),
        new_family=existing is None,
        current=current,
        notes=tuple(notes),
        report=report,
        labelled=measured_on,
        warnings=tuple(warnings),
    )


def _runtime_notes(runtimes: Runtimes, *, convert: bool) -> list[str]:
    """What the command says about runtimes: those skipped and why, what family.toml records."""
    notes = [
        f"skipped {runtime}: it cannot run the file: {reason}" for runtime, reason in runtimes.refused.items()
    ]
    if "openvino" in runtimes.refused and convert:
        notes.append("no OpenVINO IR: OpenVINO cannot run the file")
    if runtimes.chosen:
        notes += [f"not checked here: {runtime} ({reason})" for runtime, reason in runtimes.unchecked.items()]
    if runtimes.recorded:
        notes.append(f"served by {', '.join(runtimes.recorded)} only (runtimes in family.toml)")
    return notes


def _check_output_kind(plan: _Plan, logits: bool, why: str) -> None:
    """A family's variants all give logits, or all probabilities: one config reads them."""
    family = plan.existing
    if family is None or logits == family.confidence.apply_softmax:
        return
    kind = {True: "logits", False: "probabilities"}
    raise ConfigError(
        f"{plan.source}: gives {kind[logits]} ({why}), but family '{family.name}' takes "
        f"{kind[family.confidence.apply_softmax]} (confidence.apply_softmax in {family.source})"
    )


def _place_files(plan: _Plan, staged: _Staged, *, convert: bool) -> tuple[dict[str, Path], list[str]]:
    """Copy the file (an IR with its .bin) and convert it to OpenVINO IR where possible."""
    source, fmt = plan.source, plan.fmt
    target = staged.claim(staged.folder / f"{plan.name}{SUFFIXES[fmt]}")
    files = {fmt: target}
    if fmt == "openvino":
        shutil.copyfile(source.with_suffix(".bin"), staged.claim(target.with_suffix(".bin")))
    shutil.copyfile(source, target)
    notes = [f"copied {source} to {target}"]
    if fmt == "openvino" or not convert:
        return files, notes
    xml = staged.claim(staged.folder / f"{plan.name}.xml")
    staged.claim(xml.with_suffix(".bin"))
    try:
        model = _openvino().Core().read_model(str(target))
        _openvino().save_model(model, str(xml), compress_to_fp16=False)
    except Exception as exc:  # a model OpenVINO cannot convert still serves in its own runtime
        if fmt == "onnx":
            raise ConfigError(f"{source}: OpenVINO cannot convert it: {_first_reason(str(exc))}") from None
        return files, [*notes, f"no OpenVINO IR: OpenVINO cannot convert it ({_first_reason(str(exc))})"]
    converted = _openvino_interface(xml)
    if converted != plan.interface:
        raise ConfigError(f"{source}: its OpenVINO IR has other tensors ({converted}) than the file")
    files["openvino"] = xml
    return files, [*notes, f"converted to OpenVINO IR: {xml} (+ .bin, FP32 weights)"]


def _probe_family(
    options: ImportOptions,
    interface: Interface,
    variant: VariantSpec,
    existing: FamilySpec | None,
    folder: Path,
) -> FamilySpec:
    """The family as it will read, in memory, with only the new variant: for checking the
    labelled data and running the model before any config is written."""
    if existing is not None:
        return dataclasses.replace(existing, variants=(variant,), current={variant.tier: variant.name})
    scores = interface.scores
    assert scores is not None  # read_interface refuses a file without one
    confidence = ConfidenceSpec(
        output=scores.name,
        method=options.method or ConfidenceMethod.MAX_SOFTMAX,
        apply_softmax=bool(options.logits),
    )
    return FamilySpec(
        name=options.family,
        description="",
        inputs=interface.inputs,
        outputs=interface.outputs,
        confidence=confidence,
        thresholds={},
        variants=(variant,),
        source=folder / CONFIG_NAME,
        current={variant.tier: variant.name},
    )


@contextlib.contextmanager
def _cache(given: Path | None) -> Iterator[Path]:
    """The runtimes' cache: the one given, or a scratch folder removed afterwards."""
    if given is not None:
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="stratus-import-") as scratch:
        yield Path(scratch)


def _output_kind(
    family: FamilySpec,
    variant: VariantSpec,
    flag: bool | None,
    labelled: labelled_data.LabelledData | None,
    cache: Path,
) -> tuple[bool, str]:
    """(whether the output is logits, why we think so)."""
    if flag is not None:
        return flag, "--logits" if flag else "--probabilities"
    x = labelled.calibration.x[:PROBE_ITEMS] if labelled else synthetic_inputs(family, PROBE_ITEMS).x
    what = f"the first {len(x)} examples of --data" if labelled else f"{len(x)} synthetic inputs"
    runner = load_runner(family, variant, LoadOptions(tier=variant.tier, cache_dir=cache))
    try:
        output = runner.infer({family.inputs[0].name: x})[family.confidence.output].astype(np.float64)
    finally:
        runner.close()
    if looks_like_probabilities(output):
        return False, f"detected: its rows lie in [0, 1] and sum to 1 on {what}"
    return True, f"detected: its rows are not probabilities on {what}"


def _fit_temperature(
    family: FamilySpec, variant: VariantSpec, labelled: labelled_data.LabelledData | None, cache: Path
) -> tuple[VariantSpec, str, list[str]]:
    """The variant with its temperature fitted on a calibration split: the calibration part
    of --data, else a shipped family's bundled one; unchanged (1.0) without labels.

    Without it an imported variant would claim a confidence its siblings mean differently,
    and the tier's one threshold would escalate it more, or less, than it should."""
    split, what = (labelled.calibration, "the calibration part of --data") if labelled else (None, "")
    if split is None:
        split = _bundled_calibration(family)
        what = f"the bundled calibration split of '{family.name}'"
    if split is None:
        return variant, "", []
    runner = load_runner(family, variant, LoadOptions(tier=variant.tier, cache_dir=cache))
    try:
        scores = runner.infer({family.inputs[0].name: split.x})[family.confidence.output]
    finally:
        runner.close()
    temperature = fit_temperature(scores, split.y, apply_softmax=family.confidence.apply_softmax)
    warning = temperature_warning(variant.name, temperature, family.confidence.apply_softmax)
    fitted = dataclasses.replace(variant, temperature=temperature)
    return fitted, f"temperature {temperature:g}, fitted on {what}", [warning] if warning else []


def temperature_warning(variant: str, temperature: float, logits: bool) -> str:
    """A warning when a fitted temperature sits at the edge of the search grid: the best one
    may lie beyond it, and the variant's confidence does not mean what it says."""
    low, high = TEMPERATURE_GRID
    if low < temperature < high:
        return ""
    given, other = ("logits", "--probabilities") if logits else ("probabilities", "--logits")
    if temperature <= low:
        why = f"the model is under-confident (a random forest's vote shares are); the best fit may lie below {low:g}"
    else:
        why = f"the model is over-confident; the best fit may lie above {high:g}"
    return (
        f"{variant}: fitted temperature {temperature:g} is at the edge of its range [{low:g}, {high:g}]: {why}, "
        f"so its confidence is not a calibrated probability. Check that its output really is {given} "
        f"(else import it again with {other}); either way choose thresholds with "
        "`stratus models calibrate --data FILE.npz`, not by hand"
    )


def _bundled_calibration(family: FamilySpec) -> Split | None:
    try:
        split = dataset_for(family.name).calibration
        family.inputs[0].check(split.x)
    except (ConfigError, InvalidInput):
        return None
    return split


def looks_like_probabilities(output: Array) -> bool:
    """Every row in [0, 1] and summing to 1 (within 1e-3): a softmax is already applied."""
    return bool(
        np.all(output >= -1e-6)
        and np.all(output <= 1.0 + 1e-6)
        and np.allclose(output.sum(axis=-1), 1.0, atol=1e-3)
    )


def _held_out(family: FamilySpec, labelled: labelled_data.LabelledData | None) -> tuple[Split | None, str | None]:
    """What verify measures accuracy on: the report part of --data, else a shipped family's
    bundled held-out split (when it fits the input), else nothing (synthetic inputs)."""
    if labelled is not None:
        return labelled.report, f"{labelled.report_name} (the report part of --data)"
    bundled = bundled_held_out(family)
    try:
        if bundled is not None:
            family.inputs[0].check(bundled.x)
            return bundled, f"the bundled held-out split of '{family.name}' ({len(bundled)} examples)"
    except InvalidInput:
        pass
    return None, None


def _verify(
    family: FamilySpec, name: str, data: Split | None, cache: Path, refused: Mapping[str, str]
) -> VerifyReport:
    """The new variant in every runtime here that may serve it (labelled data, or synthetic
    inputs); those it skips say why."""
    availability = available_runtimes()
    usable = {n for n, status in availability.items() if status.available}
    only = dataclasses.replace(family, variants=(family.variant(name),))
    rows = verify_family(only, data if data is not None else synthetic_inputs(family), usable, cache)
    skipped = {n: status.reason for n, status in availability.items() if not status.available}
    skipped.update(excluded_runtimes(only, usable))
    skipped.update(
        {f"{runtime} for {name}": f"it cannot run the file: {why}" for runtime, why in refused.items()}
    )
    return VerifyReport(rows=tuple(rows), skipped=skipped)


def _commit(scratch: Path, config: Path, original: str | None) -> None:
    """Replace ``config`` by the checked text, unless someone changed it meanwhile."""
    now = config.read_text(encoding="utf-8") if config.exists() else None
    if now != original:
        raise ConfigError(f"{config} changed while importing; nothing was imported, try again")
    os.replace(scratch, config)


# ---------------------------------------------------------------------------------------------
# The config text
# ---------------------------------------------------------------------------------------------


def _quoted(text: str) -> str:
    """A TOML basic string (JSON's escapes are valid TOML)."""
    return json.dumps(text)


def _tensor_tables(kind: str, specs: Sequence[TensorSpec]) -> list[str]:
    lines = []
    for spec in specs:
        shape = ", ".join(str(d) for d in spec.shape)
        lines += [
            f"[[{kind}]]",
            f"name = {_quoted(spec.name)}",
            f'datatype = "{spec.datatype}"',
            f"shape = [{shape}]",
            "",
        ]
    return lines


def variant_block(variant: VariantSpec, source: Path, refused: Mapping[str, str] | None = None) -> str:
    files = ", ".join(f"{fmt} = {_quoted(path.name)}" for fmt, path in variant.files.items())
    runtimes = ", ".join(_quoted(r) for r in variant.runtimes)
    return "\n".join(
        [
            f"# Imported from {source.name} by `stratus models import`.",
            *(f"# {runtime} cannot run it: {why}" for runtime, why in (refused or {}).items()),
            "[[variants]]",
            f"name = {_quoted(variant.name)}",
            f'tier = "{variant.tier.label}"',
            'precision = "FP32"',
            *([f"temperature = {variant.temperature:g}"] if variant.temperature != 1.0 else []),
            f"files = {{ {files} }}",
            *([f"runtimes = [{runtimes}]"] if variant.runtimes else []),
            "",
        ]
    )


def _new_family_text(
    family: FamilySpec, variant: VariantSpec, source: Path, why: str, refused: Mapping[str, str]
) -> str:
    spec = family.confidence
    lines = [
        f"# The {family.name} family, created by `stratus models import` from {source.name}.",
        f"# Thresholds: `stratus models calibrate {family.name} --data FILE.npz --target-accuracy A`;",
        "# a tier without one answers whatever reaches it.",
        "",
        "[family]",
        f"name = {_quoted(family.name)}",
        f"description = {_quoted(f'Imported from {source.name}.')}",
        "",
        *_tensor_tables("inputs", family.inputs),
        *_tensor_tables("outputs", family.outputs),
        "[confidence]",
        "# output: the model's first [batch, classes] output. apply_softmax: true when it holds logits,",
        f"# false when it holds probabilities ({why}).",
        f"output = {_quoted(spec.output)}",
        f'method = "{spec.method.value}"',
        f"apply_softmax = {'true' if spec.apply_softmax else 'false'}",
        "",
        "# Each tier's escalation threshold, written by `stratus models calibrate`.",
        "[thresholds]",
        "",
        "[current]",
        "# Each tier's current variant: served unless a request pins another variant by name or a",
        "# rollout sends part of the tier's traffic to a candidate.",
        f"{variant.tier.label} = {_quoted(variant.name)}",
        "",
        variant_block(variant, source, refused),
    ]
    return "\n".join(lines)


def _extended_text(
    text: str, family: FamilySpec, variant: VariantSpec, source: Path, refused: Mapping[str, str]
) -> str:
    """The family's config with the variant appended, and its tier's ``[current]`` entry
    written where the file does not name one (a tier's only variant is current implicitly;
    a second one needs the choice written down)."""
    explicit = tomllib.loads(text).get("current", {})
    if variant.tier.label not in explicit:
        chosen = family.current.get(variant.tier, variant.name)
        text = with_current_entry(text, variant.tier, chosen)
    return text.rstrip("\n") + "\n\n" + variant_block(variant, source, refused)


def with_current_entry(text: str, tier: Tier, name: str) -> str:
    """``text`` with ``tier = "name"`` in its ``[current]`` table (created before the first
    ``[thresholds]`` or ``[[variants]]`` header when missing); the rest kept as it is."""
    lines = text.splitlines(keepends=True)
    entry = f"{tier.label} = {_quoted(name)}\n"
    headers = [i for i, line in enumerate(lines) if line.lstrip().startswith("[")]
    table = next((i for i in headers if _header(lines[i]) == "[current]"), None)
    if table is None:
        at = next((i for i in headers if _header(lines[i]) in ("[thresholds]", "[[variants]]")), len(lines))
        block = [
            "# Each tier's current variant (written by `stratus models import`).\n",
            "[current]\n",
            entry,
            "\n",
        ]
        return "".join(lines[:at] + block + lines[at:])
    last = table
    for index in range(table + 1, len(lines)):
        if index in headers:
            break
        if "=" in lines[index] and not lines[index].lstrip().startswith("#"):
            last = index
    return "".join([*lines[: last + 1], entry, *lines[last + 1 :]])


def _header(line: str) -> str:
    return line.split("#", 1)[0].strip().replace(" ", "")


# ---------------------------------------------------------------------------------------------
# What the command prints
# ---------------------------------------------------------------------------------------------


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
    lines = [
        f"imported {variant.name} ({variant.tier.label} tier, FP32, {role}) into family '{family.name}' ({created})",
        *(f"  {note}" for note in result.notes),
        f"  {tensors}",
        f"  confidence: {spec.method.value} of '{spec.output}', apply_softmax = {str(spec.apply_softmax).lower()}",
        "",
        format_report(result.report),
        "",
        f"accuracy above: on {result.labelled}"
        if result.labelled
        else "accuracy: n/a (no labelled data; verified on synthetic inputs; pass --data FILE.npz to measure it)",
        *(f"warning: {warning}" for warning in result.warnings),
    ]
    return "\n".join(lines)
