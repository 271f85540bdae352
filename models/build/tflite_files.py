"""TFLite flatbuffers written with the TFLite schema (no TensorFlow): the writer, and the
FP32 MLP and CNN; the full-integer INT8 ones are in :mod:`models.build.quantize`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models import cnn
from models.build.family import OUTPUT, Family, Layer


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: list[int]
    buffer: int
    kind: str = "float32"  # float32, int8 or int32
    scale: float | tuple[float, ...] | None = None  # quantized tensors only; a tuple per channel
    zero_point: int = 0


_NUMPY_KINDS = {"float32": np.float32, "int8": np.int8, "int32": np.int32}


@dataclass(frozen=True)
class _Op:
    """One operator: its index in the model's operator codes, tensors, and options.

    ``kind`` names the options: ``relu`` / ``none`` (FULLY_CONNECTED), ``conv_relu``
    (CONV_2D, 3x3 same padding, stride 1), ``pool{k}`` (MAX_POOL_2D, k x k, stride k),
    ``softmax``; anything else has none (QUANTIZE, DEQUANTIZE).
    """

    opcode: int
    inputs: list[int]
    outputs: list[int]
    kind: str


class _TfliteWriter:
    """Writes a network of QUANTIZE, FULLY_CONNECTED, CONV_2D, MAX_POOL_2D, SOFTMAX and
    DEQUANTIZE operators as a TFLite flatbuffer."""

    def __init__(self) -> None:
        import flatbuffers

        self.fb = flatbuffers.Builder(1 << 16)
        self.buffers: list[bytes] = [b""]  # buffer 0 is the empty sentinel
        self.tensors: list[_Tensor] = []

    def constant(
        self,
        name: str,
        array: np.ndarray,
        kind: str = "float32",
        scale: float | tuple[float, ...] | None = None,
    ) -> int:
        self.buffers.append(np.ascontiguousarray(array, dtype=_NUMPY_KINDS[kind]).tobytes())
        return self._tensor(_Tensor(name, list(array.shape), len(self.buffers) - 1, kind, scale))

    def activation(
        self,
        name: str,
        shape: Sequence[int],
        kind: str = "float32",
        scale: float | None = None,
        zero_point: int = 0,
    ) -> int:
        return self._tensor(_Tensor(name, list(shape), 0, kind, scale, zero_point))

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
        self, operators: list[_Op], inputs: list[int], outputs: list[int], codes: Sequence[int], family: str
    ) -> bytes:
        """The model; each operator's ``opcode`` indexes ``codes`` (builtin operator codes)."""
        import tflite

        fb = self.fb
        buffer_offsets = [self._buffer(data) for data in self.buffers]
        tensor_offsets = [self._tensor_table(t) for t in self.tensors]
        operator_offsets = [self._operator(op) for op in operators]
        subgraph = self._subgraph(tensor_offsets, operator_offsets, inputs, outputs)
        code_offsets = [self._operator_code(code) for code in codes]
        codes_vector = self._offsets(tflite.ModelStartOperatorCodesVector, code_offsets)
        subgraphs_vector = self._offsets(tflite.ModelStartSubgraphsVector, [subgraph])
        buffers_vector = self._offsets(tflite.ModelStartBuffersVector, buffer_offsets)
        description = fb.CreateString(f"stratus {family}")
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
        """Per tensor (one scale), or per output channel (dimension 0, zero points 0)."""
        import tflite

        fb = self.fb
        scales = list(tensor.scale) if isinstance(tensor.scale, tuple) else [tensor.scale]
        zeros = [tensor.zero_point] * len(scales)
        scale = self._vector(tflite.QuantizationParametersStartScaleVector, scales, fb.PrependFloat32)
        zero = self._vector(tflite.QuantizationParametersStartZeroPointVector, zeros, fb.PrependInt64)
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
        if kind == "conv_relu":
            tflite.Conv2DOptionsStart(fb)
            tflite.Conv2DOptionsAddPadding(fb, tflite.Padding.SAME)
            tflite.Conv2DOptionsAddStrideW(fb, 1)
            tflite.Conv2DOptionsAddStrideH(fb, 1)
            tflite.Conv2DOptionsAddDilationWFactor(fb, 1)
            tflite.Conv2DOptionsAddDilationHFactor(fb, 1)
            tflite.Conv2DOptionsAddFusedActivationFunction(fb, tflite.ActivationFunctionType.RELU)
            return tflite.Conv2DOptionsEnd(fb), tflite.BuiltinOptions.Conv2DOptions
        if kind.startswith("pool"):
            size = int(kind.removeprefix("pool"))
            tflite.Pool2DOptionsStart(fb)
            tflite.Pool2DOptionsAddPadding(fb, tflite.Padding.VALID)
            tflite.Pool2DOptionsAddStrideW(fb, size)
            tflite.Pool2DOptionsAddStrideH(fb, size)
            tflite.Pool2DOptionsAddFilterWidth(fb, size)
            tflite.Pool2DOptionsAddFilterHeight(fb, size)
            tflite.Pool2DOptionsAddFusedActivationFunction(fb, tflite.ActivationFunctionType.NONE)
            return tflite.Pool2DOptionsEnd(fb), tflite.BuiltinOptions.Pool2DOptions
        return None

    def _operator(self, op: _Op) -> int:
        import tflite

        fb = self.fb
        inputs_vector = self._ints(tflite.OperatorStartInputsVector, op.inputs)
        outputs_vector = self._ints(tflite.OperatorStartOutputsVector, op.outputs)
        options = self._options(op.kind)
        tflite.OperatorStart(fb)
        tflite.OperatorAddOpcodeIndex(fb, op.opcode)
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


class _Codes:
    """The model's operator codes, in order of first use; ``index`` adds one when new."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def index(self, name: str) -> int:
        if name not in self.names:
            self.names.append(name)
        return self.names.index(name)

    def builtin(self) -> list[int]:
        import tflite

        return [getattr(tflite.BuiltinOperator, name) for name in self.names]


def write_tflite(layers: Sequence[Layer], family: Family, path: Path) -> None:
    """FP32: FULLY_CONNECTED layers with fused ReLU, then SOFTMAX."""
    writer, codes = _TfliteWriter(), _Codes()
    current = writer.activation(family.input, family.input_shape())
    first_input = current
    operators = []
    for index, layer in enumerate(layers):
        weights = writer.constant(f"w{index}", layer.weights.T)  # FULLY_CONNECTED wants [out, in]
        bias = writer.constant(f"b{index}", layer.bias)
        last = index == len(layers) - 1
        out = writer.activation("logits" if last else f"h{index}", [-1, layer.weights.shape[1]])
        kind = "none" if last else "relu"
        operators.append(_Op(codes.index("FULLY_CONNECTED"), [current, weights, bias], [out], kind))
        current = out
    probabilities = writer.activation(OUTPUT, [-1, family.classes])
    operators.append(_Op(codes.index("SOFTMAX"), [current], [probabilities], "softmax"))
    path.write_bytes(writer.finish(operators, [first_input], [probabilities], codes.builtin(), family.name))


def _cnn_shapes(network: cnn.Network, family: Family) -> list[list[int]]:
    """The NHWC shape of every convolution's and pool's output, as ``cnn.activations`` lists them."""
    side, shapes = family.features[0], []
    for stage in network.stages:
        for conv in stage:
            shapes.append([-1, side, side, conv.weights.shape[-1]])
        side //= 2
        shapes.append([-1, side, side, stage[-1].weights.shape[-1]])
    return shapes


def write_tflite_cnn(network: cnn.Network, family: Family, path: Path) -> None:
    """FP32: CONV_2D with fused ReLU, MAX_POOL_2D per stage and one over the whole last map
    (the global max pool), FULLY_CONNECTED (it flattens [N, 1, 1, C]), SOFTMAX."""
    writer, codes = _TfliteWriter(), _Codes()
    first_input = writer.activation(family.input, family.input_shape())
    current, operators = first_input, []
    shapes = iter(_cnn_shapes(network, family))
    for number, stage in enumerate(network.stages):
        for conv in stage:
            index = len(operators)
            weights = writer.constant(f"conv{index}_w", conv.weights.transpose(3, 0, 1, 2))  # [out, h, w, in]
            bias = writer.constant(f"conv{index}_b", conv.bias)
            out = writer.activation(f"relu{index}", next(shapes))
            operators.append(_Op(codes.index("CONV_2D"), [current, weights, bias], [out], "conv_relu"))
            current = out
        out = writer.activation(f"pool{number}", next(shapes))
        operators.append(_Op(codes.index("MAX_POOL_2D"), [current], [out], "pool2"))
        current = out
    side = family.features[0] // 2 ** len(network.stages)
    pooled = writer.activation("global", [-1, 1, 1, network.architecture.features])
    operators.append(_Op(codes.index("MAX_POOL_2D"), [current], [pooled], f"pool{side}"))
    weights = writer.constant("dense_w", network.dense.weights.T)  # FULLY_CONNECTED wants [out, in]
    bias = writer.constant("dense_b", network.dense.bias)
    logits = writer.activation("logits", [-1, family.classes])
    operators.append(_Op(codes.index("FULLY_CONNECTED"), [pooled, weights, bias], [logits], "none"))
    probabilities = writer.activation(OUTPUT, [-1, family.classes])
    operators.append(_Op(codes.index("SOFTMAX"), [logits], [probabilities], "softmax"))
    path.write_bytes(writer.finish(operators, [first_input], [probabilities], codes.builtin(), family.name))
