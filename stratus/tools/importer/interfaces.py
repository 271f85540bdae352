"""Reading a model file: its format, and its inputs and outputs as a family config writes
them, refused (naming the file) where Stratus could not serve them."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from stratus import datatypes
from stratus.errors import ConfigError, StratusError
from stratus.families.spec import FamilySpec, TensorSpec

EXTENSIONS: Final = {".onnx": "onnx", ".tflite": "tflite", ".xml": "openvino"}


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
    if datatype not in datatypes.DATATYPES or datatype == "BYTES":
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
    external_data_files(source, model)  # refused here when missing or past one file's 2 GiB
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


# protobuf's limit on one message: an ONNX model folded into one file must stay under it.
ONE_FILE_BYTES: Final = 2**31 - 2**20


def external_data_files(source: Path, model: Any | None = None) -> list[Path]:
    """The files an ONNX model keeps its weights in beside it (``torch.onnx.export`` writes
    ``model.onnx.data`` past a size), each checked to exist inside the model's folder; none
    for a model in one file. Refused when they could not be folded into one file (2 GiB)."""
    if model is None:
        model = importlib.import_module("onnx").load(str(source), load_external_data=False)
    onnx = importlib.import_module("onnx")
    folder = source.resolve().parent
    named = {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    files = []
    for location in sorted(named):
        path = (folder / location).resolve()
        if not path.is_relative_to(folder):
            raise ConfigError(f"{source}: its external data '{location}' lies outside the model's folder")
        if not path.is_file():
            raise ConfigError(
                f"{source}: keeps its weights in '{location}', which is not beside it: copy the .onnx "
                "file with its data file(s), as the export wrote them"
            )
        files.append(path)
    total = source.stat().st_size + sum(p.stat().st_size for p in files)
    if files and total > ONE_FILE_BYTES:
        raise ConfigError(
            f"{source}: its weights ({total / 2**30:.1f} GiB with external data) do not fit one ONNX "
            "file (2 GiB, protobuf's limit), which Stratus serves; import a smaller model"
        )
    return files


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
        return datatypes.datatype_of(np.empty(0, dtype=onnx.helper.tensor_dtype_to_np_dtype(elem)))
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
                datatypes.datatype_of(np.empty(0, dtype=d["dtype"])),
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
