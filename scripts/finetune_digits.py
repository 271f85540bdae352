"""Fine-tune the digits device model on what a router captured (``--capture``), for the loop in
the README's "What the device should learn next".

    python scripts/finetune_digits.py --capture DIR --out digits-small-v2.onnx [--source all]

It trains digits-small's recipe (models/build/recipes.py: a 64-128-10 MLP, scikit-learn, the
same shifted copies) on the bundled fit split plus the captured items, each labelled with the
top tier's answer, and writes the ONNX file with the project's own writer; ``stratus models
import`` then adds it as a candidate variant (and fits its temperature). The labels are the
cloud's opinion, not the truth: the model learns to agree with the cloud, mistakes included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from models.build.family import Family
from models.build.onnx_files import write_onnx
from models.build.recipes import DIGITS_RECIPES
from models.build.train import Mlp
from stratus.obs.capture import read_dataset
from stratus.tools.datasets import Split, digits_splits

DEVICE_RECIPE = "digits-small"


def training_data(capture: Path, source: str | None, repeat: int) -> tuple[Split, int]:
    """The bundled fit split and the captured items ``repeat`` times (labels: the top tier's),
    and how many were captured."""
    inputs, labels = read_dataset(capture, "digits", source=source)
    fit = digits_splits().fit
    x = np.concatenate([fit.x, *[inputs["input"].astype(np.float32)] * repeat])
    return Split(x, np.concatenate([fit.y, *[labels] * repeat])), len(labels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", type=Path, required=True, help="the router's --capture folder")
    parser.add_argument("--out", type=Path, required=True, help="the ONNX file to write")
    parser.add_argument("--source", choices=("audit", "escalated", "all"), default="all",
                        help="which captured items to learn from (default all: the escalated ones are "
                        "the cases the device is unsure of)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1,
                        help="how many copies of the captured items to train on, to weigh them "
                        "against the bundled split")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        data, captured = training_data(args.capture, None if args.source == "all" else args.source, args.repeat)
    except FileNotFoundError as exc:
        print(f"finetune_digits: {exc}", file=sys.stderr)
        return 2
    recipe = next(r for r in DIGITS_RECIPES if r.name == DEVICE_RECIPE)
    model = recipe.train(data)
    assert isinstance(model, Mlp)
    family = Family("digits", args.out.parent, "input", (64,), 10, digits_splits)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_onnx(model.layers, family, args.out)
    print(f"trained {DEVICE_RECIPE}'s recipe on {len(data)} examples ({captured} captured); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
