"""``python -m models.build`` (from the repository root): rebuild the shipped families."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from models.build.family import Family, Recipe
from models.build.recipes import families
from models.build.variants import build, train_all, write_family

# The repository written into by default: models/, the folder holding this package.
HERE = Path(__file__).resolve().parents[1]


def build_family(family: Family, recipes: Sequence[Recipe], jobs: int) -> None:
    family.folder.mkdir(exist_ok=True)
    splits = family.splits()
    models = train_all(recipes, splits.fit, jobs)
    built = [
        variant
        for recipe, model in zip(recipes, models, strict=True)
        for variant in build(family, recipe, model, splits)
    ]
    write_family(family, built)
    from stratus.families.repository import load_family
    from stratus.tools.verify.classifier import record_family
    from stratus.tools.verify.report import format_report

    with tempfile.TemporaryDirectory(prefix="stratus-build-") as cache:
        print(format_report(record_family(load_family(family.folder / "family.toml"), cache_dir=Path(cache))))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m models.build", description="Rebuild the model files of the shipped families."
    )
    parser.add_argument(
        "--family", action="append", choices=["digits", "defects"], help="only this family (repeatable)"
    )
    parser.add_argument(
        "--models",
        type=Path,
        default=HERE,
        help="the repository to write into (default: models/); each family's family.toml must exist",
    )
    parser.add_argument(
        "--jobs", type=int, default=2, help="networks trained at once, in worker processes (default 2)"
    )
    args = parser.parse_args(argv)
    known = families(args.models)
    for name in args.family or list(known):
        started = time.perf_counter()
        build_family(*known[name], jobs=args.jobs)
        print(f"{name}: built in {time.perf_counter() - started:.0f} s\n", flush=True)


if __name__ == "__main__":
    main()
