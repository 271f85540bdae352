"""Retrain the defects device model on what a router captured (``--capture``), for the loop in
the README's "What the device should learn next" and issue 20's drift benchmark.

    python scripts/finetune_defects.py --capture DIR --out defects-small-v2.onnx [--source all] [--most N]

It trains defects-small's own recipe (models/build/recipes.py: the 8-16-32 CNN of models/cnn.py,
its schedule and seed) on the bundled fit split plus the captured images, each labelled with the
top tier's answer, and writes the ONNX file with the project's own writer; ``stratus models
import`` then adds it as a candidate variant (and fits its temperature). The labels are the
cloud's opinion, not the truth: the model learns to agree with the cloud, mistakes included.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from models.build.recipes import DEFECTS_RECIPES, families
from models.build.train import Cnn
from stratus.obs.capture import read_dataset
from stratus.tools.datasets import Split, defects_splits

DEVICE_RECIPE = "defects-small"
INPUT = "image"


def training_data(capture: Path, source: str | None, most: int, seed: int = 0) -> tuple[Split, int]:
    """The bundled fit split and at most ``most`` captured images (a seeded draw; labels: the
    top tier's), and how many were captured and taken."""
    inputs, labels = read_dataset(capture, "defects", source=source)
    images = inputs[INPUT].astype(np.float32)
    if len(labels) > most:
        keep = np.sort(np.random.default_rng(seed).choice(len(labels), size=most, replace=False))
        images, labels = images[keep], labels[keep]
    fit = defects_splits().fit
    return Split(np.concatenate([fit.x, images]), np.concatenate([fit.y, labels])), len(labels)


def finetune(capture: Path, out: Path, *, source: str | None = None, most: int = 6000) -> str:
    """Train, write ``out``, and say what was done in one line."""
    data, captured = training_data(capture, source, most)
    recipe = next(r for r in DEFECTS_RECIPES if r.name == DEVICE_RECIPE)
    started = time.perf_counter()
    model = recipe.train(data)
    assert isinstance(model, Cnn)
    family, _ = families(out.parent)["defects"]
    out.parent.mkdir(parents=True, exist_ok=True)
    model.write_onnx(family, out)
    took = time.perf_counter() - started
    return (
        f"trained {DEVICE_RECIPE}'s recipe on {len(data)} images ({captured} captured) in {took:.0f} s; "
        f"wrote {out}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", type=Path, required=True, help="the router's --capture folder")
    parser.add_argument("--out", type=Path, required=True, help="the ONNX file to write")
    parser.add_argument("--source", choices=("audit", "escalated", "all"), default="all",
                        help="which captured items to learn from (default all: the escalated ones are "
                        "the cases the device is unsure of)")  # fmt: skip
    parser.add_argument("--most", type=int, default=6000,
                        help="captured images trained on at most (a seeded draw), to bound the time")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        print(finetune(args.capture, args.out, source=None if args.source == "all" else args.source, most=args.most))
    except FileNotFoundError as exc:
        print(f"finetune_defects: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
