"""The shipped families and how each of their networks is trained and written."""

from __future__ import annotations

from pathlib import Path

from models import cnn, cnn_train
from models.build.family import Family, Recipe
from models.build.train import TrainCnn, TrainMlp
from stratus.tools.datasets import DEFECT_SIDE, defects_splits, digits_splits

DIGITS_RECIPES = (
    Recipe("digits-small", "device", TrainMlp((128,), 1e-1, True), ("tflite", "onnx", "openvino"), ("INT8",)),
    Recipe("digits-medium", "edge", TrainMlp((256,), 1e-2, True), ("onnx", "openvino"), ("INT8", "FP16")),
    Recipe("digits-large", "cloud", TrainMlp((512, 256), 1e-2, True), ("onnx",), ("FP16",)),
)

DEFECT_CLASSES = 4
DEFECTS_RECIPES = (
    Recipe(
        "defects-small",
        "device",
        TrainCnn(
            "defects-small",
            cnn.Architecture(((8,), (16,), (32,)), DEFECT_CLASSES),
            cnn_train.Schedule(epochs=8, seed=1),
        ),
        ("tflite", "onnx"),
        ("INT8",),
    ),
    Recipe(
        "defects-medium",
        "edge",
        TrainCnn(
            "defects-medium",
            cnn.Architecture(((16,), (32,), (64,)), DEFECT_CLASSES),
            cnn_train.Schedule(epochs=8, seed=2),
        ),
        ("onnx", "openvino"),
        ("FP16",),
    ),
    Recipe(
        "defects-large",
        "cloud",
        TrainCnn(
            "defects-large",
            cnn.Architecture(((16,), (32, 32), (64, 64)), DEFECT_CLASSES),
            cnn_train.Schedule(epochs=8, seed=3),
        ),
        ("onnx",),
        (),
    ),
)


def families(root: Path) -> dict[str, tuple[Family, tuple[Recipe, ...]]]:
    return {
        "digits": (Family("digits", root / "digits", "input", (64,), 10, digits_splits), DIGITS_RECIPES),
        "defects": (
            Family(
                "defects",
                root / "defects",
                "image",
                (DEFECT_SIDE, DEFECT_SIDE, 1),
                DEFECT_CLASSES,
                defects_splits,
            ),
            DEFECTS_RECIPES,
        ),
    }
