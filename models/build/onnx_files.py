"""FP32 ONNX files (an MLP, a CNN), their FP16 copies, and OpenVINO IR made from them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models import cnn
from models.build.family import OPSET, OUTPUT, Family, Layer


def save_onnx(nodes: list[Any], initializers: list[Any], family: Family, path: Path) -> None:
    """One graph from the family's input to its probabilities, dynamic batch, checked."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info(family.input, TensorProto.FLOAT, ["batch", *family.features])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", family.classes])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="stratus")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())


def write_onnx(layers: Sequence[Layer], family: Family, path: Path) -> None:
    from onnx import helper, numpy_helper

    nodes, initializers, current = [], [], family.input
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
    save_onnx(nodes, initializers, family, path)


def write_onnx_cnn(network: cnn.Network, family: Family, path: Path) -> None:
    """Transpose NHWC to NCHW, then Conv/Relu per convolution and MaxPool per stage;
    GlobalMaxPool, Flatten, Gemm, Softmax."""
    from onnx import helper, numpy_helper

    nodes = [helper.make_node("Transpose", [family.input], ["nchw"], perm=[0, 3, 1, 2])]
    initializers, current, index = [], "nchw", 0
    for number, stage in enumerate(network.stages):
        for conv in stage:
            w, b = f"conv{index}_w", f"conv{index}_b"
            initializers += [
                numpy_helper.from_array(np.ascontiguousarray(conv.weights.transpose(3, 2, 0, 1)), w),
                numpy_helper.from_array(conv.bias, b),
            ]
            nodes.append(
                helper.make_node(
                    "Conv", [current, w, b], [f"conv{index}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
                )
            )
            nodes.append(helper.make_node("Relu", [f"conv{index}"], [f"relu{index}"]))
            current, index = f"relu{index}", index + 1
        nodes.append(
            helper.make_node("MaxPool", [current], [f"pool{number}"], kernel_shape=[2, 2], strides=[2, 2])
        )
        current = f"pool{number}"
    initializers += [
        numpy_helper.from_array(network.dense.weights, "dense_w"),
        numpy_helper.from_array(network.dense.bias, "dense_b"),
    ]
    nodes += [
        helper.make_node("GlobalMaxPool", [current], ["global"]),
        helper.make_node("Flatten", ["global"], ["features"], axis=1),
        helper.make_node("Gemm", ["features", "dense_w", "dense_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], [OUTPUT], axis=-1),
    ]
    save_onnx(nodes, initializers, family, path)


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
# FP16 ONNX
# ---------------------------------------------------------------------------------------------


def write_onnx_fp16(fp32_path: Path, family: Family, path: Path) -> None:
    """FP16 weights and arithmetic; Cast nodes keep the family's FP32 input and output."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(fp32_path)), keep_io_types=True)
    model.graph.name = path.stem
    _rename_casts(model.graph, family)
    _sort_topologically(model.graph)
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())


def _rename_casts(graph: Any, family: Family) -> None:
    """Name the converter's FP16 tensors after the FP32 ones they carry (``input_fp16``).

    OpenVINO folds an FP16->FP32 Cast at the output into one tensor holding both names and
    reports the first in sort order; ``probabilities_fp16`` sorts after ``probabilities``
    where the converter's ``graph_output_cast_0`` sorted before it.
    """
    renames = {"graph_input_cast_0": f"{family.input}_fp16", "graph_output_cast_0": f"{OUTPUT}_fp16"}
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
