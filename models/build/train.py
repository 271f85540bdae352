"""Training: the digits MLPs (scikit-learn, in this process) and the defects CNNs
(``models/cnn_train.py``, in worker processes), each returned as a :class:`Model` that writes
itself in every format."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models import cnn, cnn_train
from models.build.family import Family, Layer, Model, hidden_activations
from models.build.onnx_files import write_onnx, write_onnx_cnn
from models.build.quantize import (
    quantize_cnn,
    write_onnx_cnn_int8,
    write_onnx_int8,
    write_tflite_cnn_int8,
    write_tflite_int8,
)
from models.build.tflite_files import write_tflite, write_tflite_cnn
from stratus.tools.datasets import DEFECT_SIDE, Split

# ---------------------------------------------------------------------------------------------
# digits: multi-layer perceptrons (scikit-learn)
# ---------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class TrainMlp:
    hidden: tuple[int, ...]
    alpha: float
    shifted: bool
    cost: float = 0.0  # training is quick: no worker process

    def __call__(self, fit: Split) -> Model:
        from sklearn.neural_network import MLPClassifier

        x, y = augmented(fit) if self.shifted else (fit.x, fit.y)
        model = MLPClassifier(hidden_layer_sizes=self.hidden, alpha=self.alpha, max_iter=600, random_state=0)
        model.fit(x, y)
        return Mlp(
            [
                Layer(np.asarray(w, dtype=np.float32), np.asarray(b, dtype=np.float32))
                for w, b in zip(model.coefs_, model.intercepts_, strict=True)
            ]
        )


def forward(layers: Sequence[Layer], x: np.ndarray) -> np.ndarray:
    """The reference forward pass every exported FP32 file must reproduce."""
    logits = hidden_activations(layers, x)[-1]
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


class Mlp:
    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers
        self.parameters = sum(layer.weights.size + layer.bias.size for layer in layers)

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        return forward(self.layers, x)

    def write_onnx(self, family: Family, path: Path) -> None:
        write_onnx(self.layers, family, path)

    def write_tflite(self, family: Family, path: Path) -> None:
        write_tflite(self.layers, family, path)

    def write_tflite_int8(self, family: Family, calibration: np.ndarray, path: Path) -> None:
        write_tflite_int8(self.layers, family, calibration, path)

    def write_onnx_int8(self, family: Family, fp32: Path, calibration: np.ndarray, path: Path) -> None:
        write_onnx_int8(fp32, family, calibration, path)

    def notes(self, family: Family) -> str:
        return ""


# ---------------------------------------------------------------------------------------------
# defects: convolutional networks (models/cnn.py, trained by models/cnn_train.py)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainCnn:
    """Picklable, so that the networks train side by side in worker processes."""

    name: str
    architecture: cnn.Architecture
    schedule: cnn_train.Schedule

    @property
    def cost(self) -> float:
        """Relative training time: multiply-accumulates per image times epochs."""
        return float(self.architecture.macs(DEFECT_SIDE, DEFECT_SIDE) * self.schedule.epochs)

    def __call__(self, fit: Split) -> Model:
        def log(line: str) -> None:
            print(f"{self.name}:{line}", flush=True)

        return Cnn(cnn_train.train(self.architecture, fit.x, fit.y, self.schedule, log=log))


class Cnn:
    def __init__(self, network: cnn.Network) -> None:
        self.network = network
        self.parameters = network.architecture.parameter_count()

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        return cnn.probabilities(self.network, x)

    def write_onnx(self, family: Family, path: Path) -> None:
        write_onnx_cnn(self.network, family, path)

    def write_tflite(self, family: Family, path: Path) -> None:
        write_tflite_cnn(self.network, family, path)

    def write_tflite_int8(self, family: Family, calibration: np.ndarray, path: Path) -> None:
        write_tflite_cnn_int8(quantize_cnn(self.network, calibration), family, path)

    def write_onnx_int8(self, family: Family, fp32: Path, calibration: np.ndarray, path: Path) -> None:
        write_onnx_cnn_int8(quantize_cnn(self.network, calibration), family, path)

    def notes(self, family: Family) -> str:
        architecture = self.network.architecture
        widths = " | ".join("-".join(map(str, stage)) for stage in architecture.stages)
        macs = architecture.macs(*family.features[:2])
        return (
            f"3x3 convolutions {widths} (a 2x2 max pool after each stage), global max pool, "
            f"dense {architecture.features}-{architecture.classes}\n"
            f"{self.parameters:,} parameters; {macs:,} multiply-accumulates per image"
        )
