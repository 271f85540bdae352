"""``stratus models``: check, calibrate and import the model repository."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _default_cache() -> Path:
    return Path.home() / ".cache" / "stratus"


def _models_verify(args: argparse.Namespace) -> int:
    from stratus.repository import ModelRepository
    from stratus.verify import format_report, verify

    report = verify(ModelRepository.load(args.dir), cache_dir=args.cache_dir, record=args.record)
    if args.json:
        payload = {
            "variants": [row.to_json() for row in report.rows],
            "skipped": report.skipped,
            "records": report.records,
            "ok": report.ok,
        }
        print(json.dumps(payload, indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def _models_calibrate(args: argparse.Namespace) -> int:
    from stratus import calibrate
    from stratus.repository import ModelRepository

    family = ModelRepository.load(args.dir).family(args.family)
    result = calibrate.calibrate(
        family, cache=args.cache_dir, target_accuracy=args.target_accuracy, max_escalation=args.max_escalation
    )
    print(calibrate.describe(result, {v.tier: v.name for v in family.variants}))
    if not args.dry_run:
        calibrate.write(family, result)
        print(f"wrote thresholds to {family.source}")
    return 0


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1")
    return value


def add_models(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = commands.add_parser("models", help="check and calibrate the model repository")
    sub = models.add_subparsers(dest="models_command", required=True)
    verify = sub.add_parser("verify", help="run every variant in every runtime on the held-out split")
    verify.add_argument("dir", nargs="?", type=Path, default=Path("models"))
    verify.add_argument("--json", action="store_true")
    verify.add_argument(
        "--cache-dir", type=Path, default=None, help="runtime caches (default: a scratch folder)"
    )
    verify.add_argument(
        "--record", action="store_true", help="write each family's verified.toml (what agents trust)"
    )
    verify.set_defaults(handler=_models_verify)
    calibrate = sub.add_parser("calibrate", help="pick each tier's escalation threshold")
    calibrate.add_argument("family")
    calibrate.add_argument("--dir", type=Path, default=Path("models"))
    goal = calibrate.add_mutually_exclusive_group(required=True)
    goal.add_argument("--target-accuracy", type=_fraction)
    goal.add_argument("--max-escalation", type=_fraction)
    calibrate.add_argument("--dry-run", action="store_true", help="print, do not write the config")
    calibrate.add_argument("--cache-dir", type=Path, default=_default_cache())
    calibrate.set_defaults(handler=_models_calibrate)
