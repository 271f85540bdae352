"""Model folders for gray-release tests: a copy of the shipped digits family, and new
device variants added to it the way a user would (an ONNX file and a [[variants]] entry)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .cluster import MODELS


def copy_digits(root: Path) -> Path:
    """A models folder of its own, holding the shipped digits family."""
    shutil.copytree(MODELS / "digits", root / "digits")
    return root


def add_device_variant(models: Path, name: str, *, shuffled: bool = False, broken: bool = False) -> None:
    """``name``: digits-small's weights (a good candidate), shuffled within each tensor (a
    bad one: it answers, but unsure and mostly wrong), or not a model at all (``broken``)."""
    folder = models / "digits"
    target = folder / f"{name}.onnx"
    if broken:
        target.write_bytes(b"this is not an ONNX model")
    else:
        model = onnx.load(MODELS / "digits" / "digits-small.onnx")
        if shuffled:
            rng = np.random.default_rng(0)
            for tensor in model.graph.initializer:
                values = numpy_helper.to_array(tensor)
                flat = values.flatten()
                rng.shuffle(flat)
                tensor.CopyFrom(numpy_helper.from_array(flat.reshape(values.shape), tensor.name))
        onnx.save(model, target)
    config = folder / "family.toml"
    entry = (
        f'\n[[variants]]\nname = "{name}"\ntier = "device"\nprecision = "FP32"\n'
        f'temperature = 0.561\nfiles = {{ onnx = "{target.name}" }}\n'
    )
    config.write_text(config.read_text() + entry)
