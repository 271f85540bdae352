"""An FP32 ONNX model's lower-precision children, as files: INT8 by ONNX Runtime's static
quantization, FP16 by its float16 converter, and OpenVINO IR of either.

``models/build/`` makes the shipped families' children with these, and ``stratus models
import`` a user's, so that both are made, and therefore judged, the same way. onnx,
onnxruntime and OpenVINO are imported when a function is called, never with this module.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from stratus.datatypes import Array

# The operators whose arithmetic INT8 speeds up (ONNX Runtime fuses a QDQ MatMul, Gemm or Conv
# into an integer kernel; OpenVINO reads the pairs as FakeQuantize). Nothing else is quantized:
# a quantized Softmax would step every confidence by 1/256, and an Add or a pool gains nothing.
QUANTIZED_OPS: Final = ("Conv", "Gemm", "MatMul")
CALIBRATION_BATCH: Final = 64


class _CalibrationReader:
    """Feeds a calibration split to ONNX Runtime's quantizer, in batches of 64."""

    def __init__(self, name: str, x: Array) -> None:
        step = CALIBRATION_BATCH
        self._batches = iter([{name: x[i : i + step]} for i in range(0, len(x), step)])

    def get_next(self) -> dict[str, Array] | None:
        return next(self._batches, None)


def write_onnx_int8(
    fp32_path: Path,
    path: Path,
    *,
    input_name: str,
    calibration: Array,
    op_types: Sequence[str] = QUANTIZED_OPS,
) -> None:
    """QDQ static quantization: int8 symmetric per-tensor weights, uint8 activations whose
    ranges are the MinMax of ``calibration`` (real examples: ranges measured on noise would
    clip or waste the 256 steps where real inputs lie).

    QDQ, not QOperator: OpenVINO reads QuantizeLinear/DequantizeLinear pairs as its own
    FakeQuantize, and ONNX Runtime fuses them into integer kernels, so one file serves both.
    Full-range weights (no ``reduce_range``): a child is served only where the CPU has INT8
    dot products (VNNI, AMX, ARM's dotprod), which do not saturate as VPMADDUBSW does.
    """
    quantization = importlib.import_module("onnxruntime.quantization")
    with _root_logger_quiet():
        quantization.quantize_static(
            str(fp32_path),
            str(path),
            _CalibrationReader(input_name, calibration),
            quant_format=quantization.QuantFormat.QDQ,
            op_types_to_quantize=list(op_types),
            per_channel=False,
            activation_type=quantization.QuantType.QUInt8,
            weight_type=quantization.QuantType.QInt8,
            calibrate_method=quantization.CalibrationMethod.MinMax,
        )


@contextlib.contextmanager
def _root_logger_quiet() -> Iterator[None]:
    """The quantizer warns on the root logger that the model was not pre-processed (shape
    inference, fusions), which changes nothing it quantizes; its level is put back after."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def fp16_model(fp32_path: Path, name: str) -> Any:
    """The FP16 ONNX model of an FP32 one: FP16 weights and arithmetic, and Cast nodes that
    keep the FP32 inputs and outputs, so a request and its answer are the parent's types.
    Operators the converter keeps in FP32 (``ai.onnx.ml``'s, TopK, ...) stay so."""
    onnx = importlib.import_module("onnx")
    converter = importlib.import_module("onnxruntime.transformers.float16")
    model = converter.convert_float_to_float16(onnx.load(str(fp32_path)), keep_io_types=True)
    model.graph.name = name
    _rename_casts(model.graph)
    _sort_topologically(model.graph)
    onnx.checker.check_model(model)
    return model


def write_onnx_fp16(fp32_path: Path, path: Path) -> None:
    path.write_bytes(fp16_model(fp32_path, path.stem).SerializeToString())


def _rename_casts(graph: Any) -> None:
    """Name the converter's FP16 tensors after the FP32 ones they carry (``input_fp16``).

    OpenVINO folds an FP16->FP32 Cast at the output into one tensor holding both names and
    reports the first in sort order; ``probabilities_fp16`` sorts after ``probabilities``
    where the converter's ``graph_output_cast_0`` sorted before it.
    """
    renames = {f"graph_input_cast_{i}": f"{t.name}_fp16" for i, t in enumerate(graph.input)}
    renames.update({f"graph_output_cast_{i}": f"{t.name}_fp16" for i, t in enumerate(graph.output)})
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


def save_ir(source: Path, xml_path: Path, *, fp16: bool) -> None:
    """An OpenVINO IR of a model file: its weights as they are, or compressed to FP16.

    ``Core.read_model``, not ``ov.convert_model``: the latter leaves OpenBLAS's threads
    spinning, and every later numpy matmul in this process hangs. ``save_model`` compresses
    to FP16 unless told not to, so FP32 and INT8 children say ``fp16=False``.
    """
    openvino = importlib.import_module("openvino")
    model = openvino.Core().read_model(str(source))
    openvino.save_model(model, str(xml_path), compress_to_fp16=fp16)
