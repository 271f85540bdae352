"""Model folders for gray-release tests: a copy of the shipped digits family, and new
device variants added to it the way a user adds them (``stratus models import``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from stratus.tools.importer import ImportOptions, import_model

from .cluster import MODELS


def copy_digits(root: Path) -> Path:
    """A models folder of its own, holding the shipped digits family."""
    shutil.copytree(MODELS / "digits", root / "digits")
    return root


def shuffled_copy(source: Path, target: Path, seed: int = 0) -> None:
    """The same network with each weight tensor's values shuffled: it still answers, but
    unsure and mostly wrong (a candidate a rollout must roll back)."""
    model = onnx.load(source)
    rng = np.random.default_rng(seed)
    for tensor in model.graph.initializer:
        values = numpy_helper.to_array(tensor)
        flat = values.flatten()
        rng.shuffle(flat)
        tensor.CopyFrom(numpy_helper.from_array(flat.reshape(values.shape), tensor.name))
    onnx.save(model, target)


def swapped_copy(source: Path, target: Path, classes: tuple[int, int]) -> None:
    """The same network answering two classes each as the other: every answer exactly as
    sure as the original's (the same probabilities, two of them trading places), so errors,
    latency and unsure answers match (where its temperature is the original's), and about a
    fifth of them are wrong. A candidate only audits against the tier above tell from a
    good one."""
    model = onnx.load(source)
    last_matmul = [n for n in model.graph.node if n.op_type == "MatMul"][-1]
    last_add = [n for n in model.graph.node if n.op_type == "Add"][-1]
    names = {last_matmul.input[1], last_add.input[1]}  # the output layer's weight and bias
    a, b = classes
    for tensor in model.graph.initializer:
        if tensor.name in names:
            values = numpy_helper.to_array(tensor).copy()
            values[..., [a, b]] = values[..., [b, a]]
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    onnx.save(model, target)


def add_device_variant(
    models: Path,
    name: str,
    *,
    shuffled: bool = False,
    swapped: tuple[int, int] | None = None,
    broken: bool = False,
) -> None:
    """``name``: digits-small's weights (a good candidate), shuffled (a bad one, unsure),
    with two classes swapped (a bad one, sure of itself), or a file that is not a model at
    all (``broken``: written straight into the config, since import would rightly refuse it)."""
    folder = models / "digits"
    source = models.parent / f"{name}.onnx"
    if broken:
        (folder / source.name).write_bytes(b"this is not an ONNX model")
        config = folder / "family.toml"
        entry = f'\n[[variants]]\nname = "{name}"\ntier = "device"\nfiles = {{ onnx = "{source.name}" }}\n'
        config.write_text(config.read_text() + entry)
        return
    original = MODELS / "digits" / "digits-small.onnx"
    if shuffled:
        shuffled_copy(original, source)
    else:
        shutil.copy(original, source)
    # No INT8/FP16 children: an INT8 CPU would serve the candidate's child in its place, and
    # these tests judge the candidate's own file (as the swapped copy below replaces it).
    import_model(
        source,
        ImportOptions(
            family="digits", tier="device", variant=name, root=models, convert=False, children=False
        ),
    )
    if swapped is not None:  # after import, so its fitted temperature is digits-small's: as sure
        imported = folder / source.name
        swapped_copy(imported, imported, swapped)
