"""Rebuild every committed model file of the ``digits`` family, reproducibly.

Trains three multi-layer perceptrons on the fit split of scikit-learn's bundled digits
(fixed seeds, no download) and writes each in the formats its tier runs:

* ``digits-small``  (device): 64-32-10, about 2.4k parameters (10 KB of FP32 weights),
  fits a microcontroller; ``.tflite``, ``.onnx`` and OpenVINO IR.
* ``digits-medium`` (edge):   64-256-10 trained on one-pixel shifts; ``.onnx`` and IR.
* ``digits-large``  (cloud):  64-512-256-10 trained on shifts; ``.onnx``.

The ``.tflite`` file is written directly with the TFLite flatbuffer schema (no
TensorFlow): FULLY_CONNECTED layers with fused ReLU, then SOFTMAX, with a dynamic batch
dimension declared in ``shape_signature``. Run with ``make models``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from stratus.datasets import Split, digits_splits  # noqa: E402

FAMILY_DIR = HERE / "digits"
INPUT, OUTPUT = "input", "probabilities"
OPSET = 17


@dataclass(frozen=True)
class Recipe:
    name: str
    hidden: tuple[int, ...]
    alpha: float
    shifted: bool
    formats: tuple[str, ...]


RECIPES = (
    Recipe("digits-small", (32,), 1e-3, False, ("tflite", "onnx", "openvino")),
    Recipe("digits-medium", (256,), 1e-2, True, ("onnx", "openvino")),
    Recipe("digits-large", (512, 256), 1e-2, True, ("onnx",)),
)


@dataclass(frozen=True)
class Layer:
    weights: np.ndarray  # [in, out]
    bias: np.ndarray  # [out]


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


def forward(layers: Sequence[Layer], x: np.ndarray) -> np.ndarray:
    """The reference forward pass every exported file must reproduce."""
    for layer in layers[:-1]:
        x = np.maximum(x @ layer.weights + layer.bias, 0.0)
    logits = x @ layers[-1].weights + layers[-1].bias
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


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


def write_openvino(onnx_path: Path, xml_path: Path) -> None:
    import openvino as ov

    # Core.read_model, not ov.convert_model: the latter leaves OpenBLAS's threads spinning,
    # and every later numpy matmul in this process hangs.
    model = ov.Core().read_model(str(onnx_path))
    # Keep FP32 weights: save_model would otherwise compress them to FP16.
    ov.save_model(model, str(xml_path), compress_to_fp16=False)
    _strip_conversion_paths(xml_path)


def _strip_conversion_paths(xml_path: Path) -> None:
    """Drop the rt_info block that records this machine's paths, so rebuilds are identical."""
    import re

    text = xml_path.read_text()
    xml_path.write_text(re.sub(r"\s*<rt_info>.*?</rt_info>", "", text, flags=re.DOTALL))


class _TfliteWriter:
    """Writes a FULLY_CONNECTED/SOFTMAX network as a TFLite flatbuffer."""

    def __init__(self) -> None:
        import flatbuffers

        self.fb = flatbuffers.Builder(1 << 16)
        self.buffers: list[bytes] = [b""]  # buffer 0 is the empty sentinel
        self.tensors: list[tuple[str, list[int], int]] = []  # (name, shape, buffer)

    def constant(self, name: str, array: np.ndarray) -> int:
        self.buffers.append(np.ascontiguousarray(array, dtype=np.float32).tobytes())
        return self._tensor(name, list(array.shape), len(self.buffers) - 1)

    def activation(self, name: str, width: int) -> int:
        return self._tensor(name, [-1, width], 0)

    def _tensor(self, name: str, shape: list[int], buffer: int) -> int:
        self.tensors.append((name, shape, buffer))
        return len(self.tensors) - 1

    def _vector(self, start: Any, items: Sequence[int], prepend: Any) -> int:
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
        self, operators: list[tuple[int, list[int], list[int], str]], inputs: list[int], outputs: list[int]
    ) -> bytes:
        import tflite

        fb = self.fb
        buffer_offsets = []
        for data in self.buffers:
            data_offset = self._aligned_bytes(data) if data else None
            tflite.BufferStart(fb)
            if data_offset is not None:
                tflite.BufferAddData(fb, data_offset)
            buffer_offsets.append(tflite.BufferEnd(fb))
        tensor_offsets = [self._tensor_table(*t) for t in self.tensors]
        operator_offsets = [self._operator(*op) for op in operators]
        subgraph = self._subgraph(tensor_offsets, operator_offsets, inputs, outputs)
        codes = [
            self._operator_code(code)
            for code in (tflite.BuiltinOperator.FULLY_CONNECTED, tflite.BuiltinOperator.SOFTMAX)
        ]
        codes_vector = self._offsets(tflite.ModelStartOperatorCodesVector, codes)
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

    def _tensor_table(self, name: str, shape: list[int], buffer: int) -> int:
        import tflite

        fb = self.fb
        name_offset = fb.CreateString(name)
        concrete = self._ints(tflite.TensorStartShapeVector, [1 if d == -1 else d for d in shape])
        signature = self._ints(tflite.TensorStartShapeSignatureVector, shape)
        tflite.TensorStart(fb)
        tflite.TensorAddShape(fb, concrete)
        tflite.TensorAddShapeSignature(fb, signature)
        tflite.TensorAddType(fb, tflite.TensorType.FLOAT32)
        tflite.TensorAddBuffer(fb, buffer)
        tflite.TensorAddName(fb, name_offset)
        return int(tflite.TensorEnd(fb))

    def _operator(self, opcode: int, inputs: list[int], outputs: list[int], kind: str) -> int:
        import tflite

        fb = self.fb
        inputs_vector = self._ints(tflite.OperatorStartInputsVector, inputs)
        outputs_vector = self._ints(tflite.OperatorStartOutputsVector, outputs)
        if kind == "softmax":
            tflite.SoftmaxOptionsStart(fb)
            tflite.SoftmaxOptionsAddBeta(fb, 1.0)
            options, options_type = tflite.SoftmaxOptionsEnd(fb), tflite.BuiltinOptions.SoftmaxOptions
        else:
            tflite.FullyConnectedOptionsStart(fb)
            activation = (
                tflite.ActivationFunctionType.RELU if kind == "relu" else tflite.ActivationFunctionType.NONE
            )
            tflite.FullyConnectedOptionsAddFusedActivationFunction(fb, activation)
            options, options_type = (
                tflite.FullyConnectedOptionsEnd(fb),
                tflite.BuiltinOptions.FullyConnectedOptions,
            )
        tflite.OperatorStart(fb)
        tflite.OperatorAddOpcodeIndex(fb, opcode)
        tflite.OperatorAddInputs(fb, inputs_vector)
        tflite.OperatorAddOutputs(fb, outputs_vector)
        tflite.OperatorAddBuiltinOptionsType(fb, options_type)
        tflite.OperatorAddBuiltinOptions(fb, options)
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


def write_tflite(layers: Sequence[Layer], path: Path) -> None:
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
    path.write_bytes(writer.finish(operators, [first_input], [probabilities]))


def build(recipe: Recipe, splits: Any) -> None:
    layers = train(recipe, splits.fit)
    onnx_path = FAMILY_DIR / f"{recipe.name}.onnx"
    write_onnx(layers, onnx_path)
    if "openvino" in recipe.formats:
        write_openvino(onnx_path, FAMILY_DIR / f"{recipe.name}.xml")
    if "tflite" in recipe.formats:
        write_tflite(layers, FAMILY_DIR / f"{recipe.name}.tflite")
    accuracy = float((forward(layers, splits.held_out.x).argmax(axis=1) == splits.held_out.y).mean())
    parameters = sum(layer.weights.size + layer.bias.size for layer in layers)
    print(
        f"{recipe.name:<14} {parameters:>7} parameters  held-out accuracy {accuracy:.4f}  {', '.join(recipe.formats)}"
    )


def main() -> None:
    FAMILY_DIR.mkdir(exist_ok=True)
    splits = digits_splits()
    for recipe in RECIPES:
        build(recipe, splits)


if __name__ == "__main__":
    main()
