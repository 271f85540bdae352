"""INT8: full-integer TFLite (the MLP, the CNN), the CNN's QDQ ONNX from the very same
parameters, and the MLP's QDQ ONNX from ONNX Runtime's static quantization."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models import cnn
from models.build.family import OUTPUT, Family, Layer, _chunks, hidden_activations
from models.build.onnx_files import save_onnx
from models.build.tflite_files import _Codes, _Op, _TfliteWriter
from stratus.tools import lower_precision


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


def _int8_channels(weights: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel integer weights (dimension 0) within +-``limit``."""
    scale = np.maximum(np.abs(weights).reshape(len(weights), -1).max(axis=1), 1e-12) / limit
    shaped = scale.reshape(-1, *([1] * (weights.ndim - 1)))
    return np.clip(np.round(weights / shaped), -limit, limit).astype(np.int8), scale.astype(np.float32)


def write_tflite_int8(layers: Sequence[Layer], family: Family, calibration: np.ndarray, path: Path) -> None:
    """Full-integer: QUANTIZE, int8 FULLY_CONNECTED, int8 SOFTMAX, DEQUANTIZE; FP32 at both ends.

    Activation ranges come from the calibration split; inputs lie in [0, 1].
    """
    writer, codes = _TfliteWriter(), _Codes()
    ranges = [(float(a.min()), float(a.max())) for a in hidden_activations(layers, calibration)]
    first_input = writer.activation(family.input, family.input_shape())
    incoming = _Affine.covering(0.0, 1.0)
    current = writer.activation(
        f"{family.input}_int8", family.input_shape(), "int8", incoming.scale, incoming.zero_point
    )
    operators = [_Op(codes.index("QUANTIZE"), [first_input], [current], "quantize")]
    for index, (layer, (low, high)) in enumerate(zip(layers, ranges, strict=True)):
        quantized, w_scale = _int8_weights(layer.weights.T)  # FULLY_CONNECTED wants [out, in]
        weights = writer.constant(f"w{index}", quantized, "int8", w_scale)
        bias_scale = incoming.scale * w_scale
        bias = writer.constant(f"b{index}", np.round(layer.bias / bias_scale), "int32", bias_scale)
        last = index == len(layers) - 1
        outgoing = _Affine.covering(low, high)
        out = writer.activation(
            "logits" if last else f"h{index}",
            [-1, layer.weights.shape[1]],
            "int8",
            outgoing.scale,
            outgoing.zero_point,
        )
        kind = "none" if last else "relu"
        operators.append(_Op(codes.index("FULLY_CONNECTED"), [current, weights, bias], [out], kind))
        current, incoming = out, outgoing
    probabilities = _int8_softmax(writer, codes, operators, current, family)
    path.write_bytes(writer.finish(operators, [first_input], [probabilities], codes.builtin(), family.name))


def _int8_softmax(
    writer: _TfliteWriter, codes: _Codes, operators: list[_Op], logits: int, family: Family
) -> int:
    """int8 SOFTMAX (scale 1/256, zero point -128, as TFLite requires), DEQUANTIZE to FP32."""
    quantized = writer.activation(f"{OUTPUT}_int8", [-1, family.classes], "int8", 1.0 / 256.0, -128)
    operators.append(_Op(codes.index("SOFTMAX"), [logits], [quantized], "softmax"))
    probabilities = writer.activation(OUTPUT, [-1, family.classes])
    operators.append(_Op(codes.index("DEQUANTIZE"), [quantized], [probabilities], "dequantize"))
    return probabilities


# 7-bit weights: ONNX Runtime's integer kernels on x86 without VNNI add pairs of uint8 x int8
# products into int16 (VPMADDUBSW), which saturates beyond 255 * 63 * 2; LiteRT gets the same
# weights, so that both runtimes compute the same integers.
WEIGHT_LIMIT = 63


@dataclass(frozen=True)
class _QConv:
    weights: np.ndarray  # int8 [out, 3, 3, in] (TFLite's layout), within +-WEIGHT_LIMIT
    scales: np.ndarray  # float32 [out]
    bias: np.ndarray  # int32 [out]; its scale is the input's scale x the weight scale
    output: _Affine  # after ReLU


@dataclass(frozen=True)
class _QuantizedCnn:
    """One set of INT8 parameters for a CNN, written both as TFLite and as ONNX QDQ, so
    that LiteRT, ONNX Runtime and OpenVINO round to the same grids."""

    input: _Affine
    stages: list[list[_QConv]]
    dense_weights: np.ndarray  # int8 [classes, features]
    dense_scale: np.ndarray  # float32 [1]
    dense_bias: np.ndarray  # int32 [classes]
    logits: _Affine

    def pooled(self) -> _Affine:
        """The last convolution's output: the pools keep their input's scale and zero point."""
        return self.stages[-1][-1].output


def quantize_cnn(network: cnn.Network, calibration: np.ndarray) -> _QuantizedCnn:
    """Activation ranges: the largest each convolution's output (after ReLU, so from 0) and
    the logits reach on the calibration split; inputs lie in [0, 1]. Weights: symmetric,
    per output channel for convolutions, per tensor for the dense layer."""
    per_chunk = [
        [(float(a.min()), float(a.max())) for a in cnn.activations(network, chunk)]
        for chunk in _chunks(calibration)
    ]
    ranges = [(min(low for low, _ in r), max(high for _, high in r)) for r in zip(*per_chunk, strict=True)]
    incoming = _Affine.covering(0.0, 1.0)
    stages, position = [], 0
    for stage in network.stages:
        convs = []
        for conv in stage:
            weights, scales = _int8_channels(conv.weights.transpose(3, 0, 1, 2), WEIGHT_LIMIT)
            bias = np.round(conv.bias / (np.float32(incoming.scale) * scales)).astype(np.int32)
            convs.append(_QConv(weights, scales, bias, _Affine.covering(*ranges[position])))
            incoming, position = convs[-1].output, position + 1
        stages.append(convs)
        position += 1  # the pool's range is within its input's
    dense, dense_scale = _int8_channels(network.dense.weights.T.reshape(1, -1), WEIGHT_LIMIT)
    bias = np.round(network.dense.bias / (np.float32(incoming.scale) * dense_scale)).astype(np.int32)
    return _QuantizedCnn(
        _Affine.covering(0.0, 1.0),
        stages,
        dense.reshape(network.dense.weights.T.shape),
        dense_scale,
        bias,
        _Affine.covering(*ranges[-1]),
    )


def write_tflite_cnn_int8(quantized: _QuantizedCnn, family: Family, path: Path) -> None:
    """Full-integer: QUANTIZE; int8 CONV_2D (per-channel weights, int32 bias) with fused
    ReLU; int8 MAX_POOL_2D, which keeps its input's scale and zero point; int8
    FULLY_CONNECTED; int8 SOFTMAX; DEQUANTIZE. FP32 at both ends."""
    writer, codes = _TfliteWriter(), _Codes()
    first_input = writer.activation(family.input, family.input_shape())
    incoming = quantized.input
    current = writer.activation(
        f"{family.input}_int8", family.input_shape(), "int8", incoming.scale, incoming.zero_point
    )
    operators = [_Op(codes.index("QUANTIZE"), [first_input], [current], "quantize")]
    side = family.features[0]
    for number, stage in enumerate(quantized.stages):
        for conv in stage:
            index = len(operators)
            bias_scales = tuple(float(np.float32(incoming.scale) * s) for s in conv.scales)
            weights = writer.constant(f"conv{index}_w", conv.weights, "int8", tuple(map(float, conv.scales)))
            bias = writer.constant(f"conv{index}_b", conv.bias, "int32", bias_scales)
            incoming = conv.output
            shape = [-1, side, side, len(conv.bias)]
            out = writer.activation(f"relu{index}", shape, "int8", incoming.scale, incoming.zero_point)
            operators.append(_Op(codes.index("CONV_2D"), [current, weights, bias], [out], "conv_relu"))
            current = out
        side //= 2
        shape = [-1, side, side, len(stage[-1].bias)]
        out = writer.activation(f"pool{number}", shape, "int8", incoming.scale, incoming.zero_point)
        operators.append(_Op(codes.index("MAX_POOL_2D"), [current], [out], "pool2"))
        current = out
    features = quantized.dense_weights.shape[1]
    pooled = writer.activation("global", [-1, 1, 1, features], "int8", incoming.scale, incoming.zero_point)
    operators.append(_Op(codes.index("MAX_POOL_2D"), [current], [pooled], f"pool{side}"))
    weight_scale = float(quantized.dense_scale[0])
    weights = writer.constant("dense_w", quantized.dense_weights, "int8", weight_scale)
    bias_scale = float(np.float32(incoming.scale) * quantized.dense_scale[0])
    bias = writer.constant("dense_b", quantized.dense_bias, "int32", bias_scale)
    out_affine = quantized.logits
    logits = writer.activation(
        "logits", [-1, family.classes], "int8", out_affine.scale, out_affine.zero_point
    )
    operators.append(_Op(codes.index("FULLY_CONNECTED"), [pooled, weights, bias], [logits], "none"))
    probabilities = _int8_softmax(writer, codes, operators, logits, family)
    path.write_bytes(writer.finish(operators, [first_input], [probabilities], codes.builtin(), family.name))


def write_onnx_cnn_int8(quantized: _QuantizedCnn, family: Family, path: Path) -> None:
    """The same INT8 network in ONNX's QDQ format, as ONNX Runtime's static quantization
    writes it: uint8 activations (TFLite's int8 zero point + 128, same scale) through
    QuantizeLinear/DequantizeLinear pairs, int8 weights and int32 biases through
    DequantizeLinear, so ONNX Runtime fuses each Conv and the Gemm into an integer kernel
    and OpenVINO reads FakeQuantize nodes."""
    from onnx import helper

    graph = _QdqGraph()
    graph.nodes.append(helper.make_node("Transpose", [family.input], ["nchw"], perm=[0, 3, 1, 2]))
    current = graph.activation("nchw", quantized.input)
    index = 0
    for number, stage in enumerate(quantized.stages):
        for conv in stage:
            incoming = graph.scale_of(current)
            weights = graph.constant(
                f"conv{index}_w", conv.weights.transpose(0, 3, 1, 2), conv.scales, axis=0
            )
            bias = graph.constant(f"conv{index}_b", conv.bias, np.float32(incoming) * conv.scales, axis=0)
            graph.nodes.append(
                helper.make_node(
                    "Conv", [current, weights, bias], [f"conv{index}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
                )
            )
            graph.nodes.append(helper.make_node("Relu", [f"conv{index}"], [f"relu{index}"]))
            current = graph.activation(f"relu{index}", conv.output)
            index += 1
        graph.nodes.append(
            helper.make_node("MaxPool", [current], [f"pool{number}"], kernel_shape=[2, 2], strides=[2, 2])
        )
        current = graph.activation(f"pool{number}", stage[-1].output)
    graph.nodes += [
        helper.make_node("GlobalMaxPool", [current], ["global"]),
        helper.make_node("Flatten", ["global"], ["features"], axis=1),
    ]
    current = graph.activation("features", quantized.pooled())
    incoming = graph.scale_of(current)
    weights = graph.constant("dense_w", quantized.dense_weights.T.copy(), quantized.dense_scale)
    bias = graph.constant("dense_b", quantized.dense_bias, np.float32(incoming) * quantized.dense_scale)
    graph.nodes.append(helper.make_node("Gemm", [current, weights, bias], ["logits"]))
    current = graph.activation("logits", quantized.logits)
    graph.nodes.append(helper.make_node("Softmax", [current], [OUTPUT], axis=-1))
    save_onnx(graph.nodes, graph.initializers, family, path)


class _QdqGraph:
    """Nodes and initializers of a QDQ graph under construction."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.scales: dict[str, float] = {}

    def _initializer(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def activation(self, name: str, affine: _Affine) -> str:
        """QuantizeLinear then DequantizeLinear of ``name`` to uint8; the dequantized name."""
        from onnx import helper

        scale = self._initializer(f"{name}_scale", np.array(affine.scale, dtype=np.float32))
        zero = self._initializer(f"{name}_zero_point", np.array(affine.zero_point + 128, dtype=np.uint8))
        self.nodes.append(helper.make_node("QuantizeLinear", [name, scale, zero], [f"{name}_quantized"]))
        self.nodes.append(
            helper.make_node("DequantizeLinear", [f"{name}_quantized", scale, zero], [f"{name}_dequantized"])
        )
        self.scales[f"{name}_dequantized"] = affine.scale
        return f"{name}_dequantized"

    def scale_of(self, name: str) -> float:
        return self.scales[name]

    def constant(self, name: str, values: np.ndarray, scale: np.ndarray, axis: int | None = None) -> str:
        """DequantizeLinear of integer weights (int8) or biases (int32), zero points 0."""
        from onnx import helper

        scales = np.asarray(scale, dtype=np.float32).reshape(-1)
        per_channel = axis is not None
        quantized = self._initializer(f"{name}_quantized", values)
        scale_name = self._initializer(f"{name}_scale", scales if per_channel else scales.reshape(()))
        zeros = np.zeros(scales.shape if per_channel else (), dtype=values.dtype)
        zero_name = self._initializer(f"{name}_zero_point", zeros)
        attributes = {"axis": axis} if per_channel else {}
        self.nodes.append(
            helper.make_node("DequantizeLinear", [quantized, scale_name, zero_name], [name], **attributes)
        )
        return name


# ---------------------------------------------------------------------------------------------
# INT8 ONNX of an MLP (ONNX Runtime's static quantization)
# ---------------------------------------------------------------------------------------------


def write_onnx_int8(fp32_path: Path, family: Family, calibration: np.ndarray, path: Path) -> None:
    """QDQ static quantization of every MatMul (an MLP's only heavy operator), made as
    ``stratus models import`` makes a user's INT8 child (:mod:`stratus.tools.lower_precision`)."""
    lower_precision.write_onnx_int8(
        fp32_path, path, input_name=family.input, calibration=calibration, op_types=("MatMul",)
    )
