"""``stratus models verify``: every variant in every runtime here, on the held-out split.

A variant must give the same answer whichever runtime serves it: the router may send the
same request to a TFLite device today and an OpenVINO one tomorrow. So each variant runs
in every (runtime, format) it ships that this machine can run, and the largest absolute
output difference between any two of them is reported and bounded.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stratus.codec import Array
from stratus.datasets import Split, dataset_for
from stratus.errors import ConfigError
from stratus.repository import FamilySpec, ModelRepository, VariantSpec
from stratus.runtimes import RUNNERS, Choice, LoadOptions, available_runtimes, open_runner

TOLERANCE = 1e-4


@dataclass(frozen=True, kw_only=True)
class VerifyRow:
    name: str
    tier: str
    runtime: str
    format: str
    accuracy: float | None
    max_abs_diff: float
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    rows: tuple[VerifyRow, ...]
    skipped: dict[str, str]

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.error is None and r.max_abs_diff <= TOLERANCE for r in self.rows)


def _all_choices(variant: VariantSpec, usable: set[str]) -> list[Choice]:
    return [
        Choice(runtime=name, format=fmt, path=variant.files[fmt])
        for name, runner in RUNNERS.items()
        if name in usable
        for fmt in runner.formats
        if fmt in variant.files
    ]


def _labelled(family: FamilySpec) -> Split | None:
    try:
        return dataset_for(family.name).held_out
    except ConfigError:
        return None


def _run(family: FamilySpec, variant: VariantSpec, choice: Choice, x: Array, cache: Path) -> Array:
    runner = open_runner(family, variant, choice, LoadOptions(tier=variant.tier, cache_dir=cache))
    try:
        runner.warmup()
        return runner.infer({family.inputs[0].name: x})[family.confidence.output]
    finally:
        runner.close()


def verify_variant(
    family: FamilySpec, variant: VariantSpec, data: Split, usable: set[str], cache: Path
) -> list[VerifyRow]:
    outputs: dict[Choice, Array] = {}
    errors: dict[Choice, str] = {}
    for choice in _all_choices(variant, usable):
        try:
            outputs[choice] = _run(family, variant, choice, data.x, cache)
        except Exception as exc:  # a verify run reports every failure, per row, whatever raised it
            errors[choice] = f"{type(exc).__name__}: {exc}"
    rows = []
    for choice in [*outputs, *errors]:
        output = outputs.get(choice)
        diff = (
            max((float(np.abs(output - other).max()) for other in outputs.values()), default=0.0)
            if output is not None
            else 0.0
        )
        accuracy = (
            float((output.argmax(axis=1) == data.y).mean()) if output is not None and len(data.y) else None
        )
        rows.append(
            VerifyRow(
                name=variant.name,
                tier=variant.tier.label,
                runtime=choice.runtime,
                format=choice.format,
                accuracy=accuracy,
                max_abs_diff=diff,
                error=errors.get(choice),
            )
        )
    return rows


def verify(repository: ModelRepository, *, cache_dir: Path | None = None) -> VerifyReport:
    availability = available_runtimes()
    usable = {name for name, status in availability.items() if status.available}
    skipped = {name: status.reason for name, status in availability.items() if not status.available}
    rows: list[VerifyRow] = []
    with tempfile.TemporaryDirectory(prefix="stratus-verify-") as scratch:
        cache = cache_dir or Path(scratch)
        for family in repository.families.values():
            data = _labelled(family) or _random_inputs(family)
            for variant in family.variants:
                rows += verify_variant(family, variant, data, usable, cache)
    return VerifyReport(rows=tuple(rows), skipped=skipped)


def _random_inputs(family: FamilySpec) -> Split:
    """Families without bundled labels are still checked for agreement between runtimes."""
    spec = family.inputs[0]
    shape = tuple(64 if d == -1 else d for d in spec.shape)
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    return Split(x, np.empty(0, dtype=np.int64))


def format_report(report: VerifyReport) -> str:
    header = (
        f"{'variant':<16}{'tier':<8}{'runtime':<13}{'format':<10}{'accuracy':>9}{'max|diff|':>12}  status"
    )
    lines = [header, "-" * len(header)]
    for row in report.rows:
        accuracy = f"{row.accuracy:.4f}" if row.accuracy is not None else "-"
        status = (
            "ok" if row.error is None and row.max_abs_diff <= TOLERANCE else (row.error or "outputs differ")
        )
        lines.append(
            f"{row.name:<16}{row.tier:<8}{row.runtime:<13}{row.format:<10}{accuracy:>9}{row.max_abs_diff:>12.2e}  {status}"
        )
    for runtime, reason in report.skipped.items():
        lines.append(f"skipped {runtime}: {reason}")
    lines.append(
        f"verdict: {'PASS' if report.ok else 'FAIL'} (runtimes of a variant agree within {TOLERANCE:g})"
    )
    return "\n".join(lines)
