"""Rebuild every committed model file of the ``digits`` family, reproducibly.

Trains three multi-layer perceptrons on the fit split of scikit-learn's bundled digits
(fixed seeds, no download), writes each in the formats its tier runs, derives the
lower-precision variants from them, and ends by verifying every variant and writing
``verified.toml`` (see ``stratus.precision``):

* ``digits-small``  (device): 64-128-10 on one-pixel shifts, strongly regularised:
  9,610 parameters (38 KB as FP32, 10 KB as INT8), fits a microcontroller;
  ``.tflite``, ``.onnx`` and OpenVINO IR. ``digits-small-int8``: the same in INT8.
* ``digits-medium`` (edge): 64-256-10 on shifts; ``.onnx`` and IR; ``-int8`` and ``-fp16``.
* ``digits-large``  (cloud): 64-512-256-10 on shifts; ``.onnx``; ``-fp16``.

Lower precisions keep the family's FP32 input and output tensors:

* INT8 ONNX: ONNX Runtime static quantization in the QDQ format (QuantizeLinear /
  DequantizeLinear pairs around each MatMul), which both ONNX Runtime and OpenVINO turn
  into integer kernels; calibrated on the calibration split, never the held-out one.
  Its OpenVINO IR is the same graph saved by OpenVINO (FakeQuantize nodes).
* INT8 ``.tflite``: full-integer, written here: QUANTIZE, int8 FULLY_CONNECTED (int32
  bias), int8 SOFTMAX (scale 1/256, zero point -128), DEQUANTIZE.
* FP16: an ONNX copy with FP16 weights and compute, Cast nodes at the edges; and an
  OpenVINO IR compressed to FP16.

Each variant's ``temperature`` is fitted on the calibration split (see
``stratus.confidence.tempered``). The ``.tflite`` files are written directly with the
TFLite flatbuffer schema (no TensorFlow), with a dynamic batch dimension declared in
``shape_signature``. Run with ``make models``.
"""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from stratus.datasets import DigitsSplits, Split, digits_splits  # noqa: E402

FAMILY_DIR = HERE / "digits"
INPUT, OUTPUT = "input", "probabilities"
OPSET = 17


@dataclass(frozen=True)
class Recipe:
    name: str
    tier: str
    hidden: tuple[int, ...]
    alpha: float
    shifted: bool
    formats: tuple[str, ...]
    lower: tuple[str, ...]  # the lower precisions derived from this FP32 variant


RECIPES = (
    Recipe("digits-small", "device", (128,), 1e-1, True, ("tflite", "onnx", "openvino"), ("INT8",)),
    Recipe("digits-medium", "edge", (256,), 1e-2, True, ("onnx", "openvino"), ("INT8", "FP16")),
    Recipe("digits-large", "cloud", (512, 256), 1e-2, True, ("onnx",), ("FP16",)),
)


@dataclass(frozen=True)
class Layer:
    weights: np.ndarray  # [in, out]
    bias: np.ndarray  # [out]


@dataclass
class Built:
    """One variant as written: what goes into its ``[[variants]]`` table."""

    name: str
    tier: str
    precision: str
    parent: str | None
    files: dict[str, str] = field(default_factory=dict)
    temperature: float = 1.0


def shift(images: np.ndarray, dx: int, dy: int) -> np.ndarray:
    """Move each 8x8 image by (dx, dy) pixels, filling with zeros."""
    grid = images.reshape(-1, 8, 8)
    moved = np.zeros_like(grid)
    moved[:, max(0, dy) : 8 + min(0, dy), max(0, dx) : 8 + min(0, dx)] = grid[
        :, max(0, -dy) : 8 + min(0, -dy), max(0, -dx) : 8 + min(0, -dx)
    ]
    return moved.reshape(-1, 64)


def augmented(split: Split) -> tuple[np.ndarray, np.ndarray]:
    offsets = [(0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)]
    return np.concatenate([shift(split.x, dx, dy) for dx, dy in offsets]), np.tile(split.y, len(offsets))


def train(recipe: Recipe, fit: Split) -> list[Layer]:
    from sklearn.neural_network import MLPClassifier

    x, y = augmented(fit) if recipe.shifted else (fit.x, fit.y)
    model = MLPClassifier(hidden_layer_sizes=recipe.hidden, alpha=recipe.alpha, max_iter=600, random_state=0)
    model.fit(x, y)
    return [
        Layer(np.asarray(w, dtype=np.float32), np.asarray(b, dtype=np.float32))
        for w, b in zip(model.coefs_, model.intercepts_, strict=True)
    ]


def hidden_activations(layers: Sequence[Layer], x: np.ndarray) -> list[np.ndarray]:
    """Every layer's output before softmax: the ranges INT8 quantization must cover."""
    outputs = []
    for index, layer in enumerate(layers):
        x = x @ layer.weights + layer.bias
        if index < len(layers) - 1:
            x = np.maximum(x, 0.0)
        outputs.append(x)
    return outputs


def forward(layers: Sequence[Layer], x: np.ndarray) -> np.ndarray:
    """The reference forward pass every exported FP32 file must reproduce."""
    logits = hidden_activations(layers, x)[-1]
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------------------------------------
# FP32 files
# ---------------------------------------------------------------------------------------------


def write_onnx(layers: Sequence[Layer], path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes, initializers, current = [], [], INPUT
    for index, layer in enumerate(layers):
        w, b = f"w{index}", f"b{index}"
        initializers += [numpy_helper.from_array(layer.weights, w), numpy_helper.from_array(layer.bias, b)]
        nodes.append(helper.make_node("MatMul", [current, w], [f"mm{index}"]))
        nodes.append(helper.make_node("Add", [f"mm{index}", b], [f"z{index}"]))
        current = f"z{index}"
        if index < len(layers) - 1:
            nodes.append(helper.make_node("Relu", [current], [f"h{index}"]))
            current = f"h{index}"
    nodes.append(helper.make_node("Softmax", [current], [OUTPUT], axis=-1))
    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", 10])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="stratus")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())


def write_openvino(onnx_path: Path, xml_path: Path, *, fp16: bool = False) -> None:
    """An IR of an ONNX file: FP32 weights kept as they are, or compressed to FP16."""
    import openvino as ov

    # Core.read_model, not ov.convert_model: the latter leaves OpenBLAS's threads spinning,
    # and every later numpy matmul in this process hangs.
    model = ov.Core().read_model(str(onnx_path))
    ov.save_model(model, str(xml_path), compress_to_fp16=fp16)
    _strip_conversion_paths(xml_path)


def _strip_conversion_paths(xml_path: Path) -> None:
    """Drop the rt_info block that records this machine's paths, so rebuilds are identical."""
    text = xml_path.read_text()
    xml_path.write_text(re.sub(r"\s*<rt_info>.*?</rt_info>", "", text, flags=re.DOTALL))


# ---------------------------------------------------------------------------------------------
# TFLite flatbuffers (FP32 and full-integer INT8)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: list[int]
    buffer: int
    kind: str = "float32"  # float32, int8 or int32
    scale: float | None = None  # quantized tensors only
    zero_point: int = 0


_NUMPY_KINDS = {"float32": np.float32, "int8": np.int8, "int32": np.int32}


class _TfliteWriter:
    """Writes a QUANTIZE/FULLY_CONNECTED/SOFTMAX/DEQUANTIZE network as a TFLite flatbuffer."""

    def __init__(self) -> None:
        import flatbuffers

        self.fb = flatbuffers.Builder(1 << 16)
        self.buffers: list[bytes] = [b""]  # buffer 0 is the empty sentinel
        self.tensors: list[_Tensor] = []

    def constant(
        self, name: str, array: np.ndarray, kind: str = "float32", scale: float | None = None
    ) -> int:
        self.buffers.append(np.ascontiguousarray(array, dtype=_NUMPY_KINDS[kind]).tobytes())
        return self._tensor(_Tensor(name, list(array.shape), len(self.buffers) - 1, kind, scale))

    def activation(
        self, name: str, width: int, kind: str = "float32", scale: float | None = None, zero_point: int = 0
    ) -> int:
        return self._tensor(_Tensor(name, [-1, width], 0, kind, scale, zero_point))

    def _tensor(self, tensor: _Tensor) -> int:
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def _vector(self, start: Any, items: Sequence[Any], prepend: Any) -> int:
        start(self.fb, len(items))
        for item in reversed(items):
            prepend(item)
        return int(self.fb.EndVector())

    def _ints(self, start: Any, items: Sequence[int]) -> int:
        return self._vector(start, items, self.fb.PrependInt32)

    def _offsets(self, start: Any, items: Sequence[int]) -> int:
        return self._vector(start, items, self.fb.PrependUOffsetTRelative)

    def _aligned_bytes(self, data: bytes) -> int:
        """Weights aligned to 16 bytes so the interpreter can read them in place."""
        self.fb.StartVector(1, len(data), 16)
        self.fb.head = self.fb.head - len(data)
        self.fb.Bytes[self.fb.head : self.fb.head + len(data)] = data
        return int(self.fb.EndVector())

    def finish(
        self,
        operators: list[tuple[int, list[int], list[int], str]],
        inputs: list[int],
        outputs: list[int],
        codes: Sequence[int],
    ) -> bytes:
        """The model; each operator's first item indexes ``codes`` (builtin operator codes)."""
        import tflite

        fb = self.fb
        buffer_offsets = [self._buffer(data) for data in self.buffers]
        tensor_offsets = [self._tensor_table(t) for t in self.tensors]
        operator_offsets = [self._operator(*op) for op in operators]
        subgraph = self._subgraph(tensor_offsets, operator_offsets, inputs, outputs)
        code_offsets = [self._operator_code(code) for code in codes]
        codes_vector = self._offsets(tflite.ModelStartOperatorCodesVector, code_offsets)
        subgraphs_vector = self._offsets(tflite.ModelStartSubgraphsVector, [subgraph])
        buffers_vector = self._offsets(tflite.ModelStartBuffersVector, buffer_offsets)
        description = fb.CreateString("stratus digits")
        tflite.ModelStart(fb)
        tflite.ModelAddVersion(fb, 3)
        tflite.ModelAddOperatorCodes(fb, codes_vector)
        tflite.ModelAddSubgraphs(fb, subgraphs_vector)
        tflite.ModelAddDescription(fb, description)
        tflite.ModelAddBuffers(fb, buffers_vector)
        fb.Finish(tflite.ModelEnd(fb), file_identifier=b"TFL3")
        return bytes(fb.Output())

    def _buffer(self, data: bytes) -> int:
        import tflite

        data_offset = self._aligned_bytes(data) if data else None
        tflite.BufferStart(self.fb)
        if data_offset is not None:
            tflite.BufferAddData(self.fb, data_offset)
        return int(tflite.BufferEnd(self.fb))

    def _quantization(self, tensor: _Tensor) -> int:
        import tflite

        fb = self.fb
        scale = self._vector(tflite.QuantizationParametersStartScaleVector, [tensor.scale], fb.PrependFloat32)
        zero = self._vector(
            tflite.QuantizationParametersStartZeroPointVector, [tensor.zero_point], fb.PrependInt64
        )
        tflite.QuantizationParametersStart(fb)
        tflite.QuantizationParametersAddScale(fb, scale)
        tflite.QuantizationParametersAddZeroPoint(fb, zero)
        return int(tflite.QuantizationParametersEnd(fb))

    def _tensor_table(self, tensor: _Tensor) -> int:
        import tflite

        fb = self.fb
        name_offset = fb.CreateString(tensor.name)
        quantization = self._quantization(tensor) if tensor.scale is not None else None
        concrete = self._ints(tflite.TensorStartShapeVector, [1 if d == -1 else d for d in tensor.shape])
        signature = self._ints(tflite.TensorStartShapeSignatureVector, tensor.shape)
        tflite.TensorStart(fb)
        tflite.TensorAddShape(fb, concrete)
        tflite.TensorAddShapeSignature(fb, signature)
        tflite.TensorAddType(fb, getattr(tflite.TensorType, tensor.kind.upper()))
        tflite.TensorAddBuffer(fb, tensor.buffer)
        tflite.TensorAddName(fb, name_offset)
        if quantization is not None:
            tflite.TensorAddQuantization(fb, quantization)
        return int(tflite.TensorEnd(fb))

    def _options(self, kind: str) -> tuple[int, int] | None:
        """Builtin options of an operator; QUANTIZE and DEQUANTIZE need none."""
        import tflite

        fb = self.fb
        if kind == "softmax":
            tflite.SoftmaxOptionsStart(fb)
            tflite.SoftmaxOptionsAddBeta(fb, 1.0)
            return tflite.SoftmaxOptionsEnd(fb), tflite.BuiltinOptions.SoftmaxOptions
        if kind in ("relu", "none"):
            tflite.FullyConnectedOptionsStart(fb)
            activation = (
                tflite.ActivationFunctionType.RELU if kind == "relu" else tflite.ActivationFunctionType.NONE
            )
            tflite.FullyConnectedOptionsAddFusedActivationFunction(fb, activation)
            return tflite.FullyConnectedOptionsEnd(fb), tflite.BuiltinOptions.FullyConnectedOptions
        return None

    def _operator(self, opcode: int, inputs: list[int], outputs: list[int], kind: str) -> int:
        import tflite

        fb = self.fb
        inputs_vector = self._ints(tflite.OperatorStartInputsVector, inputs)
        outputs_vector = self._ints(tflite.OperatorStartOutputsVector, outputs)
        options = self._options(kind)
        tflite.OperatorStart(fb)
        tflite.OperatorAddOpcodeIndex(fb, opcode)
        tflite.OperatorAddInputs(fb, inputs_vector)
        tflite.OperatorAddOutputs(fb, outputs_vector)
        if options is not None:
            tflite.OperatorAddBuiltinOptionsType(fb, options[1])
            tflite.OperatorAddBuiltinOptions(fb, options[0])
        return int(tflite.OperatorEnd(fb))

    def _subgraph(
        self, tensors: list[int], operators: list[int], inputs: list[int], outputs: list[int]
    ) -> int:
        import tflite

        fb = self.fb
        tensors_vector = self._offsets(tflite.SubGraphStartTensorsVector, tensors)
        inputs_vector = self._ints(tflite.SubGraphStartInputsVector, inputs)
        outputs_vector = self._ints(tflite.SubGraphStartOutputsVector, outputs)
        operators_vector = self._offsets(tflite.SubGraphStartOperatorsVector, operators)
        name = fb.CreateString("main")
        tflite.SubGraphStart(fb)
        tflite.SubGraphAddTensors(fb, tensors_vector)
        tflite.SubGraphAddInputs(fb, inputs_vector)
        tflite.SubGraphAddOutputs(fb, outputs_vector)
        tflite.SubGraphAddOperators(fb, operators_vector)
        tflite.SubGraphAddName(fb, name)
        return int(tflite.SubGraphEnd(fb))

    def _operator_code(self, code: int) -> int:
        import tflite

        tflite.OperatorCodeStart(self.fb)
        tflite.OperatorCodeAddDeprecatedBuiltinCode(self.fb, code)
        tflite.OperatorCodeAddBuiltinCode(self.fb, code)
        tflite.OperatorCodeAddVersion(self.fb, 1)
        return int(tflite.OperatorCodeEnd(self.fb))


def _builtin_codes(*names: str) -> list[int]:
    import tflite

    return [getattr(tflite.BuiltinOperator, name) for name in names]


def write_tflite(layers: Sequence[Layer], path: Path) -> None:
    """FP32: FULLY_CONNECTED layers with fused ReLU, then SOFTMAX."""
    writer = _TfliteWriter()
    fully_connected, softmax = 0, 1
    current = writer.activation(INPUT, 64)
    first_input = current
    operators = []
    for index, layer in enumerate(layers):
        weights = writer.constant(f"w{index}", layer.weights.T)  # FULLY_CONNECTED wants [out, in]
        bias = writer.constant(f"b{index}", layer.bias)
        last = index == len(layers) - 1
        out = writer.activation("logits" if last else f"h{index}", layer.weights.shape[1])
        operators.append((fully_connected, [current, weights, bias], [out], "none" if last else "relu"))
        current = out
    probabilities = writer.activation(OUTPUT, 10)
    operators.append((softmax, [current], [probabilities], "softmax"))
    codes = _builtin_codes("FULLY_CONNECTED", "SOFTMAX")
    path.write_bytes(writer.finish(operators, [first_input], [probabilities], codes))


@dataclass(frozen=True)
class _Affine:
    """An int8 tensor's scale and zero point, from the float range it must cover."""

    scale: float
    zero_point: int

    @classmethod
    def covering(cls, low: float, high: float) -> _Affine:
        low, high = min(low, 0.0), max(high, 0.0)  # zero must be exact (ReLU, padding)
        scale = max(high - low, 1e-8) / 255.0
        return cls(scale, int(np.clip(round(-128 - low / scale), -128, 127)))


def _int8_weights(weights: np.ndarray) -> tuple[np.ndarray, float]:
    """Symmetric per-tensor INT8 weights (zero point 0), as TFLite's int8 kernels expect."""
    scale = float(np.abs(weights).max()) / 127.0
    return np.clip(np.round(weights / scale), -127, 127).astype(np.int8), scale


def write_tflite_int8(layers: Sequence[Layer], calibration: np.ndarray, path: Path) -> None:
    """Full-integer: QUANTIZE, int8 FULLY_CONNECTED, int8 SOFTMAX, DEQUANTIZE; FP32 at both ends.

    Activation ranges come from the calibration split; inputs lie in [0, 1].
    """
    writer = _TfliteWriter()
    quantize, fully_connected, softmax, dequantize = 0, 1, 2, 3
    ranges = [(float(a.min()), float(a.max())) for a in hidden_activations(layers, calibration)]
    first_input = writer.activation(INPUT, 64)
    incoming = _Affine.covering(0.0, 1.0)
    current = writer.activation("input_int8", 64, "int8", incoming.scale, incoming.zero_point)
    operators = [(quantize, [first_input], [current], "quantize")]
    for index, (layer, (low, high)) in enumerate(zip(layers, ranges, strict=True)):
        quantized, w_scale = _int8_weights(layer.weights.T)  # FULLY_CONNECTED wants [out, in]
        weights = writer.constant(f"w{index}", quantized, "int8", w_scale)
        bias_scale = incoming.scale * w_scale
        bias = writer.constant(f"b{index}", np.round(layer.bias / bias_scale), "int32", bias_scale)
        last = index == len(layers) - 1
        outgoing = _Affine.covering(low, high)
        out = writer.activation(
            "logits" if last else f"h{index}",
            layer.weights.shape[1],
            "int8",
            outgoing.scale,
            outgoing.zero_point,
        )
        operators.append((fully_connected, [current, weights, bias], [out], "none" if last else "relu"))
        current, incoming = out, outgoing
    quantized_probabilities = writer.activation(f"{OUTPUT}_int8", 10, "int8", 1.0 / 256.0, -128)
    operators.append((softmax, [current], [quantized_probabilities], "softmax"))
    probabilities = writer.activation(OUTPUT, 10)
    operators.append((dequantize, [quantized_probabilities], [probabilities], "dequantize"))
    codes = _builtin_codes("QUANTIZE", "FULLY_CONNECTED", "SOFTMAX", "DEQUANTIZE")
    path.write_bytes(writer.finish(operators, [first_input], [probabilities], codes))


# ---------------------------------------------------------------------------------------------
# Lower-precision ONNX
# ---------------------------------------------------------------------------------------------


class _CalibrationReader:
    """Feeds the calibration split to ONNX Runtime's quantizer, in batches of 64."""

    def __init__(self, x: np.ndarray) -> None:
        self._batches = iter([{INPUT: x[i : i + 64]} for i in range(0, len(x), 64)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


def write_onnx_int8(fp32_path: Path, calibration: np.ndarray, path: Path) -> None:
    """QDQ static quantization of every MatMul: int8 weights (symmetric), uint8 activations.

    QDQ, not QOperator: OpenVINO reads QuantizeLinear/DequantizeLinear pairs as its own
    FakeQuantize, and ONNX Runtime fuses them into integer MatMuls, so one file serves both.
    """
    import logging

    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    # Its advice to pre-process (shape inference, fusions) is for convolutional graphs.
    logging.getLogger().setLevel(logging.ERROR)
    quantize_static(
        str(fp32_path),
        str(path),
        _CalibrationReader(calibration),  # type: ignore[arg-type]
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=["MatMul"],
        per_channel=False,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
    )


def write_onnx_fp16(fp32_path: Path, path: Path) -> None:
    """FP16 weights and arithmetic; Cast nodes keep the family's FP32 input and output."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(fp32_path)), keep_io_types=True)
    model.graph.name = path.stem
    _rename_casts(model.graph)
    _sort_topologically(model.graph)
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())


def _rename_casts(graph: Any) -> None:
    """Name the converter's FP16 tensors after the FP32 ones they carry (``input_fp16``).

    OpenVINO folds an FP16->FP32 Cast at the output into one tensor holding both names and
    reports the first in sort order; ``probabilities_fp16`` sorts after ``probabilities``
    where the converter's ``graph_output_cast_0`` sorted before it.
    """
    renames = {"graph_input_cast_0": f"{INPUT}_fp16", "graph_output_cast_0": f"{OUTPUT}_fp16"}
    for node in graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
        node.output[:] = [renames.get(name, name) for name in node.output]


def _sort_topologically(graph: Any) -> None:
    """The converter appends its input Casts last; the ONNX checker wants producers first."""
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    pending, ordered = list(graph.node), []
    while pending:
        ready = next(n for n in pending if all(not name or name in available for name in n.input))
        pending.remove(ready)
        ordered.append(ready)
        available.update(ready.output)
    del graph.node[:]
    graph.node.extend(ordered)


# ---------------------------------------------------------------------------------------------
# Variants, temperatures and the family config
# ---------------------------------------------------------------------------------------------


def onnx_probabilities(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run([OUTPUT], {INPUT: x})[0], dtype=np.float64)


def fit_temperature(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """The temperature with the lowest negative log-likelihood on the calibration split.

    A grid over log T rather than an optimiser: deterministic, and a few hundred examples
    cannot tell neighbouring temperatures apart anyway.
    """
    logits = np.log(np.clip(probabilities, 1e-30, None))
    best_nll, best_t = np.inf, 1.0
    for temperature in np.round(np.exp(np.linspace(np.log(0.25), np.log(4.0), 97)), 3):
        scaled = logits / temperature
        scaled -= scaled.max(axis=1, keepdims=True)
        log_p = scaled - np.log(np.exp(scaled).sum(axis=1, keepdims=True))
        nll = float(-log_p[np.arange(len(labels)), labels].mean())
        if nll < best_nll - 1e-12:
            best_nll, best_t = nll, float(temperature)
    return best_t


def build_fp32(recipe: Recipe, layers: Sequence[Layer]) -> Built:
    built = Built(recipe.name, recipe.tier, "FP32", None)
    onnx_path = FAMILY_DIR / f"{recipe.name}.onnx"
    write_onnx(layers, onnx_path)
    if "tflite" in recipe.formats:
        write_tflite(layers, FAMILY_DIR / f"{recipe.name}.tflite")
        built.files["tflite"] = f"{recipe.name}.tflite"
    built.files["onnx"] = onnx_path.name
    if "openvino" in recipe.formats:
        write_openvino(onnx_path, FAMILY_DIR / f"{recipe.name}.xml")
        built.files["openvino"] = f"{recipe.name}.xml"
    return built


def build_int8(recipe: Recipe, layers: Sequence[Layer], calibration: np.ndarray) -> Built:
    name = f"{recipe.name}-int8"
    built = Built(name, recipe.tier, "INT8", recipe.name)
    if "tflite" in recipe.formats:
        write_tflite_int8(layers, calibration, FAMILY_DIR / f"{name}.tflite")
        built.files["tflite"] = f"{name}.tflite"
    write_onnx_int8(FAMILY_DIR / f"{recipe.name}.onnx", calibration, FAMILY_DIR / f"{name}.onnx")
    built.files["onnx"] = f"{name}.onnx"
    if "openvino" in recipe.formats:
        write_openvino(FAMILY_DIR / f"{name}.onnx", FAMILY_DIR / f"{name}.xml")
        built.files["openvino"] = f"{name}.xml"
    return built


def build_fp16(recipe: Recipe) -> Built:
    name = f"{recipe.name}-fp16"
    built = Built(name, recipe.tier, "FP16", recipe.name)
    write_onnx_fp16(FAMILY_DIR / f"{recipe.name}.onnx", FAMILY_DIR / f"{name}.onnx")
    built.files["onnx"] = f"{name}.onnx"
    if "openvino" in recipe.formats:
        write_openvino(FAMILY_DIR / f"{recipe.name}.onnx", FAMILY_DIR / f"{name}.xml", fp16=True)
        built.files["openvino"] = f"{name}.xml"
    return built


def variants_toml(built: Sequence[Built]) -> str:
    """The ``[[variants]]`` tables, written by the build so they always match the files."""
    blocks = []
    for variant in built:
        files = ", ".join(f'{fmt} = "{name}"' for fmt, name in variant.files.items())
        lines = [
            "[[variants]]",
            f'name = "{variant.name}"',
            f'tier = "{variant.tier}"',
            f'precision = "{variant.precision}"',
            *([f'parent = "{variant.parent}"'] if variant.parent else []),
            f"temperature = {variant.temperature:.3f}",
            f"files = {{ {files} }}",
        ]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def write_family(built: Sequence[Built]) -> None:
    """Replace everything from the first ``[[variants]]`` on; the rest of the file is kept."""
    path = FAMILY_DIR / "family.toml"
    text = path.read_text(encoding="utf-8")
    first = re.search(r"^\[\[variants\]\]", text, flags=re.MULTILINE)
    head = text[: first.start()] if first else text.rstrip("\n") + "\n\n"
    path.write_text(head + variants_toml(built), encoding="utf-8")


def report(variant: Built, splits: DigitsSplits, parameters: int) -> None:
    """Fit the variant's temperature on the calibration split; print its held-out accuracy."""
    onnx_path = FAMILY_DIR / variant.files["onnx"]
    variant.temperature = fit_temperature(
        onnx_probabilities(onnx_path, splits.calibration.x), splits.calibration.y
    )
    accuracy = float(
        (onnx_probabilities(onnx_path, splits.held_out.x).argmax(axis=1) == splits.held_out.y).mean()
    )
    size = sum((FAMILY_DIR / f).stat().st_size for f in variant.files.values())
    print(
        f"{variant.name:<19} {variant.precision:<5} {parameters:>7} parameters  held-out accuracy {accuracy:.4f}"
        f"  T {variant.temperature:.3f}  {size / 1024:6.1f} KiB  {', '.join(variant.files)}"
    )


def build(recipe: Recipe, splits: DigitsSplits) -> list[Built]:
    layers = train(recipe, splits.fit)
    parameters = sum(layer.weights.size + layer.bias.size for layer in layers)
    built = [build_fp32(recipe, layers)]
    if "INT8" in recipe.lower:
        built.append(build_int8(recipe, layers, splits.calibration.x))
    if "FP16" in recipe.lower:
        built.append(build_fp16(recipe))
    for variant in built:
        report(variant, splits, parameters)
    return built


def main() -> None:
    FAMILY_DIR.mkdir(exist_ok=True)
    splits = digits_splits()
    built = [variant for recipe in RECIPES for variant in build(recipe, splits)]
    write_family(built)
    from stratus.repository import load_family
    from stratus.verify import format_report, record_family

    with tempfile.TemporaryDirectory(prefix="stratus-build-") as cache:
        print(format_report(record_family(load_family(FAMILY_DIR / "family.toml"), cache_dir=Path(cache))))


if __name__ == "__main__":
    main()
