"""What every part of the build shares: a family's tensors and data, a recipe, a variant as
written, and an MLP's layers as numpy computes them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from stratus.tools.datasets import Split, Splits

OUTPUT = "probabilities"
OPSET = 17


@dataclass(frozen=True)
class Family:
    """What the writers need to know of a family: its folder, tensors and data."""

    name: str
    folder: Path
    input: str
    features: tuple[int, ...]  # one item's input shape (the batch dimension comes first)
    classes: int
    splits: Callable[[], Splits]

    def input_shape(self) -> list[int]:
        return [-1, *self.features]


class Model(Protocol):
    """A trained FP32 network, and how it is written in each format."""

    parameters: int

    def probabilities(self, x: np.ndarray) -> np.ndarray: ...

    def write_onnx(self, family: Family, path: Path) -> None: ...

    def write_tflite(self, family: Family, path: Path) -> None: ...

    def write_tflite_int8(self, family: Family, calibration: np.ndarray, path: Path) -> None: ...

    def write_onnx_int8(self, family: Family, fp32: Path, calibration: np.ndarray, path: Path) -> None:
        """INT8 ONNX; ``fp32`` is the FP32 ONNX file already written."""

    def notes(self, family: Family) -> str: ...


class Trainer(Protocol):
    cost: float  # relative training time; 0 trains in this process

    def __call__(self, fit: Split) -> Model: ...


@dataclass(frozen=True)
class Recipe:
    name: str
    tier: str
    train: Trainer
    formats: tuple[str, ...]
    lower: tuple[str, ...]  # the lower precisions derived from this FP32 variant


@dataclass
class Built:
    """One variant as written: what goes into its ``[[variants]]`` table."""

    name: str
    tier: str
    precision: str
    parent: str | None
    files: dict[str, str] = field(default_factory=dict)
    temperature: float = 1.0
    notes: str = ""  # comment lines in its table (sizes, multiply-accumulates)


@dataclass(frozen=True)
class Layer:
    weights: np.ndarray  # [in, out]
    bias: np.ndarray  # [out]


def hidden_activations(layers: Sequence[Layer], x: np.ndarray) -> list[np.ndarray]:
    """Every layer's output before softmax: the ranges INT8 quantization must cover."""
    outputs = []
    for index, layer in enumerate(layers):
        x = x @ layer.weights + layer.bias
        if index < len(layers) - 1:
            x = np.maximum(x, 0.0)
        outputs.append(x)
    return outputs


def _chunks(x: np.ndarray, size: int = 256) -> list[np.ndarray]:
    return [x[i : i + size] for i in range(0, len(x), size)]
