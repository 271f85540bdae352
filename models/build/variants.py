"""From a trained model to a family's variants: every file of each precision, checked
against the network, its temperature fitted, and the ``[[variants]]`` tables written."""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from models.build.family import OUTPUT, Built, Family, Model, Recipe, _chunks
from models.build.onnx_files import write_onnx_fp16, write_openvino
from stratus.families import confidence
from stratus.tools.datasets import Split, Splits


def onnx_probabilities(path: Path, family: Family, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.concatenate(
        [
            np.asarray(session.run([OUTPUT], {family.input: chunk})[0], dtype=np.float64)
            for chunk in _chunks(x)
        ]
    )


def fit_temperature(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """The temperature with the lowest NLL on the calibration split (as `models import` fits it)."""
    return confidence.fit_temperature(probabilities, labels, apply_softmax=False)


def build_fp32(family: Family, recipe: Recipe, model: Model, check: np.ndarray) -> Built:
    """Every FP32 file; each must reproduce the trained network on ``check``."""
    built = Built(recipe.name, recipe.tier, "FP32", None, notes=model.notes(family))
    onnx_path = family.folder / f"{recipe.name}.onnx"
    model.write_onnx(family, onnx_path)
    if "tflite" in recipe.formats:
        model.write_tflite(family, family.folder / f"{recipe.name}.tflite")
        built.files["tflite"] = f"{recipe.name}.tflite"
    built.files["onnx"] = onnx_path.name
    if "openvino" in recipe.formats:
        write_openvino(onnx_path, family.folder / f"{recipe.name}.xml")
        built.files["openvino"] = f"{recipe.name}.xml"
    difference = np.abs(onnx_probabilities(onnx_path, family, check) - model.probabilities(check)).max()
    if difference > 1e-4:
        raise AssertionError(f"{onnx_path.name} differs from the trained network by {difference:.2e}")
    return built


def build_int8(family: Family, recipe: Recipe, model: Model, calibration: np.ndarray) -> Built:
    name = f"{recipe.name}-int8"
    built = Built(name, recipe.tier, "INT8", recipe.name)
    if "tflite" in recipe.formats:
        model.write_tflite_int8(family, calibration, family.folder / f"{name}.tflite")
        built.files["tflite"] = f"{name}.tflite"
        if model.notes(family):  # the figure a microcontroller's flash budget is held against
            size = (family.folder / f"{name}.tflite").stat().st_size
            built.notes = f"{name}.tflite: {size:,} bytes (weights and graph; full-integer)"
    fp32 = family.folder / f"{recipe.name}.onnx"
    model.write_onnx_int8(family, fp32, calibration, family.folder / f"{name}.onnx")
    built.files["onnx"] = f"{name}.onnx"
    if "openvino" in recipe.formats:
        write_openvino(family.folder / f"{name}.onnx", family.folder / f"{name}.xml")
        built.files["openvino"] = f"{name}.xml"
    return built


def build_fp16(family: Family, recipe: Recipe) -> Built:
    name = f"{recipe.name}-fp16"
    built = Built(name, recipe.tier, "FP16", recipe.name)
    write_onnx_fp16(family.folder / f"{recipe.name}.onnx", family, family.folder / f"{name}.onnx")
    built.files["onnx"] = f"{name}.onnx"
    if "openvino" in recipe.formats:
        write_openvino(family.folder / f"{recipe.name}.onnx", family.folder / f"{name}.xml", fp16=True)
        built.files["openvino"] = f"{name}.xml"
    return built


def variants_toml(built: Sequence[Built]) -> str:
    """The ``[[variants]]`` tables, written by the build so they always match the files."""
    blocks = []
    for variant in built:
        files = ", ".join(f'{fmt} = "{name}"' for fmt, name in variant.files.items())
        lines = [
            "[[variants]]",
            f'name = "{variant.name}"',
            *(f"# {line}" for line in variant.notes.splitlines()),
            f'tier = "{variant.tier}"',
            f'precision = "{variant.precision}"',
            *([f'parent = "{variant.parent}"'] if variant.parent else []),
            f"temperature = {variant.temperature:.3f}",
            f"files = {{ {files} }}",
        ]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def write_family(family: Family, built: Sequence[Built]) -> None:
    """Replace everything from the first ``[[variants]]`` on; the rest of the file is kept."""
    path = family.folder / "family.toml"
    text = path.read_text(encoding="utf-8")
    first = re.search(r"^\[\[variants\]\]", text, flags=re.MULTILINE)
    head = text[: first.start()] if first else text.rstrip("\n") + "\n\n"
    path.write_text(head + variants_toml(built), encoding="utf-8")


def report(family: Family, variant: Built, splits: Splits, parameters: int) -> None:
    """Fit the variant's temperature on the calibration split; print its held-out accuracy."""
    onnx_path = family.folder / variant.files["onnx"]
    variant.temperature = fit_temperature(
        onnx_probabilities(onnx_path, family, splits.calibration.x), splits.calibration.y
    )
    accuracy = float(
        (onnx_probabilities(onnx_path, family, splits.held_out.x).argmax(axis=1) == splits.held_out.y).mean()
    )
    size = sum((family.folder / f).stat().st_size for f in variant.files.values())
    print(
        f"{variant.name:<19} {variant.precision:<5} {parameters:>7} parameters  held-out accuracy {accuracy:.4f}"
        f"  T {variant.temperature:.3f}  {size / 1024:6.1f} KiB  {', '.join(variant.files)}",
        flush=True,
    )


def train_all(recipes: Sequence[Recipe], fit: Split, jobs: int) -> list[Model]:
    """Every recipe's model. Costly ones train in ``jobs`` worker processes at once, the
    costliest first, each with one BLAS thread (on a busy or two-core machine, BLAS threads
    contending for cores are several times slower than one)."""
    started = time.perf_counter()
    costly = sorted((r for r in recipes if r.train.cost > 0), key=lambda r: -r.train.cost)
    models: dict[str, Model] = {}
    if costly and jobs > 1:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read by each worker when it starts
        context = multiprocessing.get_context("spawn")  # no fork of a process with BLAS threads
        with ProcessPoolExecutor(min(jobs, len(costly)), mp_context=context) as pool:
            futures = {r.name: pool.submit(r.train, fit) for r in costly}
            models = {name: future.result() for name, future in futures.items()}
    for recipe in recipes:
        if recipe.name not in models:
            models[recipe.name] = recipe.train(fit)
    print(
        f"trained {', '.join(r.name for r in recipes)} in {time.perf_counter() - started:.0f} s", flush=True
    )
    return [models[r.name] for r in recipes]


def build(family: Family, recipe: Recipe, model: Model, splits: Splits) -> list[Built]:
    built = [build_fp32(family, recipe, model, splits.calibration.x[:256])]
    if "INT8" in recipe.lower:
        built.append(build_int8(family, recipe, model, splits.calibration.x))
    if "FP16" in recipe.lower:
        built.append(build_fp16(family, recipe))
    for variant in built:
        report(family, variant, splits, model.parameters)
    return built
