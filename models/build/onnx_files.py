"""FP32 ONNX files (an MLP, a CNN), their FP16 copies, and OpenVINO IR made from them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models import cnn
from models.build.family import OPSET, OUTPUT, Family, Layer
from stratus.tools import lower_precision


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
    lower_precision.save_ir(onnx_path, xml_path, fp16=fp16)
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
    lower_precision.write_onnx_fp16(fp32_path, path)
