"""Models as people export them, built here from scikit-learn's bundled digits (never
downloaded): skl2onnx's default export (a ZipMap ``output_probability`` and an
``output_label``), its ``zipmap=False`` export (``label``, ``probabilities``), and a small
CNN from ``torch.onnx.export`` (only where torch is installed: it is not a dev dependency)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stratus.tools.datasets import Split, digits_splits

FEATURES = 64


@dataclass(frozen=True)
class Digits:
    """What the models train on, and the labelled examples they never saw (``--data``)."""

    fit: Split
    unseen: Split

    def npz(self, path: Path, input_name: str) -> Path:
        np.savez(path, **{input_name: self.unseen.x, "labels": self.unseen.y})
        return path


def digits() -> Digits:
    splits = digits_splits()
    unseen = Split(
        np.concatenate([splits.calibration.x, splits.held_out.x]),
        np.concatenate([splits.calibration.y, splits.held_out.y]),
    )
    return Digits(fit=splits.fit, unseen=unseen)


def fitted(kind: str, data: Digits, *, trees: int = 8, depth: int | None = 6) -> Any:
    """A scikit-learn classifier fitted on the fit split: small, so tests stay quick."""
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier

    models = {
        "logistic": lambda: LogisticRegression(C=0.05, max_iter=300),
        "forest": lambda: RandomForestClassifier(n_estimators=trees, max_depth=depth, random_state=0),
        "mlp": lambda: MLPClassifier(hidden_layer_sizes=(48,), max_iter=400, random_state=0),
    }
    model = models[kind]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the MLP's ConvergenceWarning
        model.fit(data.fit.x, data.fit.y)
    return model


def skl_onnx(model: Any, path: Path, *, zipmap: bool = True, input_name: str = "X") -> Path:
    """skl2onnx's export: its default (ZipMap) or with ``options={id(model): {'zipmap': False}}``."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType

    options = None if zipmap else {id(model): {"zipmap": False}}
    onx = to_onnx(model, initial_types=[(input_name, FloatTensorType([None, FEATURES]))], options=options)
    path.write_bytes(onx.SerializeToString())
    return path


def mlp_onnx(model: Any, path: Path, *, input_name: str = "x", output_name: str = "probabilities") -> Path:
    """A fitted scikit-learn MLP (ReLU, softmax) written as a plain ONNX graph (MatMul, Add,
    Relu, Softmax), as a hand-made exporter writes one: unlike skl2onnx's, with no
    ``ai.onnx.ml`` label branch, so that ONNX Runtime and OpenVINO both run it."""
    from onnx import TensorProto, helper, numpy_helper, save

    nodes, weights, current = [], [], input_name
    layers = list(zip(model.coefs_, model.intercepts_, strict=True))
    for index, (w, b) in enumerate(layers):
        weights += [
            numpy_helper.from_array(w.astype(np.float32), f"w{index}"),
            numpy_helper.from_array(b.astype(np.float32), f"b{index}"),
        ]
        nodes += [
            helper.make_node("MatMul", [current, f"w{index}"], [f"m{index}"]),
            helper.make_node("Add", [f"m{index}", f"b{index}"], [f"z{index}"]),
        ]
        current = f"z{index}"
        if index < len(layers) - 1:
            nodes.append(helper.make_node("Relu", [current], [f"h{index}"]))
            current = f"h{index}"
    nodes.append(helper.make_node("Softmax", [current], [output_name], axis=-1))
    classes = layers[-1][1].shape[0]
    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["batch", classes])],
        weights,
    )
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx_model.ir_version = 8
    save(onnx_model, str(path))
    return path


def torch_cnn(data: Digits, path: Path, *, channels: int = 8, epochs: int = 30, seed: int = 0) -> Path:
    """A small CNN on the 8x8 images (input ``image`` [N, 1, 8, 8], output ``logits``),
    trained for a few seconds on the CPU and exported with ``torch.onnx.export``."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, channels, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(channels * 16, 10),
    )
    x = torch.from_numpy(images(data.fit.x))
    y = torch.from_numpy(data.fit.y)
    optimiser = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(epochs):
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimiser.step()
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's DeprecationWarning
        torch.onnx.export(
            model,
            (x[:2],),
            str(path),
            input_names=["image"],
            output_names=["logits"],
            dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
            dynamo=False,  # the torch.export-based one needs onnxscript, not installed here
        )
    return path


def images(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(-1, 1, 8, 8), dtype=np.float32)
