"""``stratus models``: check, calibrate and import the model repository."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from stratus.errors import ConfigError
from stratus.families.confidence import ConfidenceMethod

if TYPE_CHECKING:
    from stratus.families.repository import ModelRepository
    from stratus.families.spec import FamilySpec
    from stratus.tools.calibrate.classifier import Calibration
    from stratus.tools.datasets import Split
    from stratus.tools.verify.classifier import DataSource


def _default_cache() -> Path:
    return Path.home() / ".cache" / "stratus"


def _models_verify(args: argparse.Namespace) -> int:
    from stratus.families.repository import ModelRepository
    from stratus.tools.verify import verify
    from stratus.tools.verify.report import format_report

    repository = ModelRepository.load(args.dir)
    report = verify(
        repository,
        cache_dir=args.cache_dir,
        record=args.record,
        data=_held_out(repository, args.data, data_source=args.data_source),
    )
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


def _held_out(repository: ModelRepository, pairs: list[str], *, data_source: str) -> DataSource:
    """``--data FAMILY=FILE.npz`` (or ``FAMILY=DIR``, a capture folder): that family's accuracy
    on the data's report part (the examples ``calibrate --data`` does not choose thresholds on);
    ``--data DIR``: so for each family the folder holds items of; the others as before."""
    from stratus.tools.calibrate import labelled_data
    from stratus.tools.verify.classifier import bundled_held_out

    files = _data_paths(repository, pairs, data_source)
    held_out = {
        name: labelled_data.load_labelled(repository.family(name), path, source=data_source).report
        for name, path in files.items()
    }

    def source(family: FamilySpec) -> Split | None:
        split = held_out.get(family.name)
        return split if split is not None else bundled_held_out(family)

    return source


def _data_paths(repository: ModelRepository, pairs: list[str], source: str) -> dict[str, Path]:
    """Each ``--data`` entry, as family -> path; a bare capture folder names every classifier
    family it holds items of (and none at all is an error, not a silent no-op)."""
    files = {}
    for pair in pairs:
        name, _, path = pair.partition("=")
        if not path and Path(name).is_dir():
            found = _captured_families(repository, Path(name), source)
            files.update(dict.fromkeys(found, Path(name)))
            continue
        if not path:
            raise ConfigError(f"--data {pair}: expected FAMILY=FILE.npz, FAMILY=DIR or a capture folder DIR")
        files[repository.family(name).name] = Path(path)
    return files


def _captured_families(repository: ModelRepository, folder: Path, source: str) -> list[str]:
    from stratus.tools.calibrate import labelled_data

    found = []
    for family in repository.families.values():
        if family.generative:
            continue
        try:
            labelled_data.captured_arrays(family, folder, source)
        except ConfigError:
            continue
        found.append(family.name)
    if not found:
        raise ConfigError(f"--data {folder}: holds no captured {source} items of any classifier family here")
    return found


def _models_calibrate(args: argparse.Namespace) -> int:
    from stratus.families.repository import ModelRepository
    from stratus.tools.calibrate import classifier, labelled_data

    if args.compare_methods and args.target_accuracy is None:
        raise ConfigError("--compare-methods needs --target-accuracy")
    family = ModelRepository.load(args.dir).family(args.family)
    if family.generative:
        return _calibrate_generative(family, args)
    data = (
        labelled_data.load_labelled(family, args.data, source=args.data_source)
        if args.data is not None
        else labelled_data.bundled_data(family)
    )
    if args.compare_methods:
        results = classifier.compare_methods(
            family, cache=args.cache_dir, target_accuracy=args.target_accuracy, data=data
        )
        print(classifier.describe_comparison(results, family=family, target=args.target_accuracy, data=data))
        return 0
    result = classifier.calibrate(
        family,
        cache=args.cache_dir,
        target_accuracy=args.target_accuracy,
        max_escalation=args.max_escalation,
        data=data,
    )
    print(classifier.describe(result))
    _warn(result.warnings)
    if not args.dry_run:
        _write_calibration(family, result)
    return 0


def _write_calibration(family: FamilySpec, result: Calibration) -> None:
    from stratus.tools.calibrate import classifier

    classifier.write(family, result)
    share = result.record().cloud_share
    print(f"wrote thresholds and the calibrated cloud share ({share:.1%}) to {family.source}")


def _calibrate_generative(family: FamilySpec, args: argparse.Namespace) -> int:
    from stratus.tools.calibrate import classifier
    from stratus.tools.calibrate.generative import calibrate_generative

    if args.compare_methods:
        raise ConfigError("--compare-methods is for classifier families")
    result = calibrate_generative(
        family,
        cache=args.cache_dir,
        target_accuracy=args.target_accuracy,
        max_escalation=args.max_escalation,
        data_file=args.data,
    )
    print(classifier.describe(result))
    if not args.dry_run:
        _write_calibration(family, result)
    return 0


def _models_import(args: argparse.Namespace) -> int:
    from stratus.tools.importer import ImportOptions, describe, import_model

    options = ImportOptions(
        family=args.family,
        tier=args.tier,
        variant=args.variant,
        root=args.dir,
        method=ConfidenceMethod(args.method) if args.method else None,
        logits=args.logits,
        data=args.data,
        convert=not args.no_convert,
        cache_dir=args.cache_dir,
        runtimes=_runtime_list(args.runtimes),
        children=not args.no_children,
    )
    result = import_model(args.file, options)
    print(describe(result))
    _warn(result.warnings)
    return 0


def _runtime_list(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise ConfigError("--runtimes: name at least one runtime (onnxruntime, openvino, litert, tensorrt)")
    return names


def _warn(warnings: Sequence[str]) -> None:
    """Warnings go to stderr too, so a script that keeps only stdout still shows them."""
    for warning in warnings:
        print(f"stratus: warning: {warning}", file=sys.stderr)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1")
    return value


def add_models(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = commands.add_parser("models", help="check, calibrate and import the model repository")
    sub = models.add_subparsers(dest="models_command", required=True)
    verify = sub.add_parser("verify", help="run every variant in every runtime on the held-out split")
    verify.add_argument("dir", nargs="?", type=Path, default=Path("models"))
    verify.add_argument("--json", action="store_true", help="the report as JSON")
    verify.add_argument(
        "--cache-dir", type=Path, default=None, help="runtime caches (default: a scratch folder)"
    )
    verify.add_argument(
        "--record", action="store_true", help="write each family's verified.toml (what agents trust)"
    )
    verify.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="FAMILY=FILE.npz",
        help="labelled data for a family without bundled data (its report part is used): FAMILY=FILE.npz, "
        "FAMILY=DIR or DIR, a router's --capture folder (labels: the top tier's answers)",
    )
    _add_data_source(verify)
    verify.set_defaults(handler=_models_verify)
    calibrate = sub.add_parser("calibrate", help="pick each tier's escalation threshold")
    calibrate.add_argument("family")
    calibrate.add_argument(
        "--models", "--dir", dest="dir", type=Path, default=Path("models"), help="the models folder"
    )
    goal = calibrate.add_mutually_exclusive_group(required=True)
    goal.add_argument(
        "--target-accuracy",
        type=_fraction,
        help="the cascade's accuracy to reach, e.g. 0.97 (fewest escalations)",
    )
    goal.add_argument(
        "--max-escalation",
        type=_fraction,
        help="the share of items that may climb, e.g. 0.05 (best accuracy)",
    )
    calibrate.add_argument("--dry-run", action="store_true", help="print, do not write the config")
    calibrate.add_argument(
        "--data",
        type=Path,
        help="labelled data: for a classifier, an .npz with an array named after the family's input "
        'and \'labels\' (int); for a generative family, JSON Lines of {"prompt": ..., "answer": ...}; '
        "or a router's --capture folder (labels: the top tier's answers); default: the family's bundled data",
    )
    _add_data_source(calibrate)
    calibrate.add_argument(
        "--compare-methods",
        action="store_true",
        help="with --target-accuracy: the top tier's share for each confidence method; writes nothing",
    )
    calibrate.add_argument("--cache-dir", type=Path, default=_default_cache(), help="runtime caches")
    calibrate.set_defaults(handler=_models_calibrate)
    _add_import(sub)


def _add_data_source(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--data-source",
        choices=("audit", "escalated", "all"),
        default="audit",
        help="a capture folder's items: audit (an unbiased sample, the default), escalated (unsure "
        "items only: biased towards hard cases) or all",
    )


def _add_import(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    command = sub.add_parser(
        "import", help="add an .onnx, .tflite or OpenVINO .xml model to a family, for one tier"
    )
    command.add_argument("file", type=Path)
    command.add_argument("--family", required=True, help="created when it does not exist")
    command.add_argument("--tier", required=True, help="device, edge or cloud")
    command.add_argument("--variant", help="the variant's name (default: FAMILY-TIER)")
    command.add_argument(
        "--models", "--dir", dest="dir", type=Path, default=Path("models"), help="the models folder"
    )
    command.add_argument(
        "--method",
        choices=[m.value for m in ConfidenceMethod],
        help="a new family's confidence method (default max_softmax)",
    )
    kind = command.add_mutually_exclusive_group()
    kind.add_argument(
        "--logits", dest="logits", action="store_const", const=True, help="the first output is logits"
    )
    kind.add_argument(
        "--probabilities",
        dest="logits",
        action="store_const",
        const=False,
        help="the first output is probabilities (default: detected by running the model)",
    )
    command.add_argument(
        "--data",
        type=Path,
        help="labelled .npz: the temperature and the INT8 child are calibrated on one part, verify "
        "measures accuracy on the other",
    )
    command.add_argument("--no-convert", action="store_true", help="keep only the given format")
    command.add_argument(
        "--no-children",
        action="store_true",
        help="import the FP32 variant alone; by default an ONNX file with labelled data (--data, or a "
        "shipped family's bundled splits) also gets an INT8 child (ONNX Runtime static quantization "
        "calibrated on that data) and an FP16 one, each kept only when verified within the family's "
        "max_accuracy_drop and served where the CPU runs its arithmetic natively",
    )
    command.add_argument(
        "--runtimes",
        metavar="R1,R2",
        help="only these runtimes may serve the variant (recorded in family.toml as its runtimes; "
        "each must run the file here unless it is not installed here); default: every runtime here "
        "that runs the file, and one that refuses it is skipped with its reason",
    )
    command.add_argument("--cache-dir", type=Path, default=None, help="runtime caches (default: scratch)")
    command.set_defaults(handler=_models_import)
