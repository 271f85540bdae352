"""``stratus models calibrate``: pick each tier's escalation threshold from labelled data.

The cascade answers a request on the lowest tier whose confidence reaches that tier's
threshold; the top tier always answers. Thresholds are chosen on the calibration split
(carved from the training data, unseen by the models while they trained), never on the
held-out split, which is only reported for information.

* ``--target-accuracy A``: the thresholds that send the fewest requests to the top tier
  (then the fewest beyond the bottom tier) while the cascade's accuracy stays >= A.
* ``--max-escalation R``: at most a share R of all requests may reach the top tier (the
  expensive one); within that, the cascade with the highest *expected* accuracy (the mean
  confidence of the tier that answers each request), then the highest counted accuracy,
  then the most conservative (highest) thresholds. Confidences are temperature-scaled
  per variant (temperatures fitted on this same split by ``models/build/``), so they
  estimate the chance of being right; on a few hundred examples the counted accuracy moves
  in steps of one or two examples, which is noise when the tiers' models are close.

Thresholds are chosen on each tier's current FP32 variant; its lower-precision children
share them, as they are served only when they agree with it (``models verify``).

Labelled data: a shipped family's bundled splits by default (``stratus.tools.datasets``), or a
``.npz`` file (``--data``) holding one array named after the family's input and
``labels`` (int, one class per example), for any classification family. The file is split
once, stratified by label with a fixed seed: ``CALIBRATION_SHARE`` of each class for
choosing thresholds, the rest for the report.

Thresholds are chosen among values with ``THRESHOLD_DECIMALS`` decimals, as
``family.toml`` stores them, so the written thresholds give exactly the shares printed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stratus.datatypes import Array
from stratus.errors import ConfigError
from stratus.families.audit import TierCalibration
from stratus.families.confidence import ConfidenceMethod, confidence
from stratus.families.spec import CalibrationRecord, FamilySpec, VariantSpec
from stratus.families.suggest import Outcome, TierScores, cascade, for_max_escalation, for_target_accuracy
from stratus.families.writer import write_thresholds
from stratus.runtimes import LoadOptions, load_runner
from stratus.tiers import Tier
from stratus.tools.calibrate.labelled_data import LabelledData, bundled_data
from stratus.tools.calibrate.tier_accuracy import describe_figures, tier_figures, write_tier_accuracy
from stratus.tools.datasets import Split


def reference_variant(family: FamilySpec, tier: Tier) -> VariantSpec:
    """The tier's current FP32 variant: thresholds are chosen on it, and its lower-precision
    children are served only when they agree with it (``models verify``), so they share its
    thresholds."""
    return family.current_variant(tier)


@dataclass(frozen=True)
class TierOutputs:
    """What one tier's current variant answered on every example of a split."""

    tier: Tier
    variant: VariantSpec
    outputs: Array


def tier_outputs(family: FamilySpec, split: Split, cache: Path) -> list[TierOutputs]:
    """Run each tier's current FP32 variant over a split (in the best runtime here)."""
    tiers = sorted({v.tier for v in family.variants})
    if len(tiers) < 2:
        raise ConfigError(f"{family.source}: calibrating needs variants on at least two tiers")
    results = []
    for tier in tiers:
        variant = reference_variant(family, tier)
        runner = load_runner(family, variant, LoadOptions(tier=tier, cache_dir=cache))
        try:
            outputs = runner.infer({family.inputs[0].name: split.x})[family.confidence.output]
        finally:
            runner.close()
        results.append(TierOutputs(tier, variant, outputs))
    return results


def scored(
    family: FamilySpec, results: Sequence[TierOutputs], labels: Array, method: ConfidenceMethod | None = None
) -> list[TierScores]:
    """Each tier's confidence (by ``method``, default the family's) and correctness."""
    spec = family.confidence
    return [
        TierScores(
            r.tier,
            r.variant.name,
            confidence(
                r.outputs,
                method=method or spec.method,
                apply_softmax=spec.apply_softmax,
                temperature=r.variant.temperature,
            ).astype(np.float64),
            r.outputs.argmax(axis=1) == labels,
            r.outputs.argmax(axis=1),
        )
        for r in results
    ]


def tier_scores(family: FamilySpec, split: Split, cache: Path) -> list[TierScores]:
    """Each tier's confidence and correctness on a split, as the family config says."""
    return scored(family, tier_outputs(family, split, cache), split.y)


@dataclass(frozen=True)
class Calibration:
    thresholds: dict[Tier, float]
    tiers: tuple[Tier, ...]  # bottom first, as ``Outcome.reached``
    calibration: Outcome
    held_out: Outcome
    table: str
    data: LabelledData
    goal: str  # "target_accuracy 0.985" or "max_escalation 0.04", as recorded beside the thresholds
    # What the user should act on (also printed to stderr by the command).
    warnings: tuple[str, ...] = ()
    # Per tier, the calibration split's items the thresholds settle there ([tier_accuracy]).
    per_tier: dict[Tier, TierCalibration] = field(default_factory=dict)

    def record(self) -> CalibrationRecord:
        """What is written beside the thresholds: the goal, and what they gave where chosen."""
        return CalibrationRecord(
            goal=self.goal,
            data=self.data.calibration_name,
            accuracy=self.calibration.accuracy,
            cloud_share=cloud_share(self.tiers, self.calibration),
        )


def cloud_share(tiers: Sequence[Tier], outcome: Outcome) -> float:
    """The share of requests that reached the cloud tier (none when the family has no cloud tier)."""
    return outcome.reached[tiers.index(Tier.CLOUD)] if Tier.CLOUD in tiers else 0.0


def sweep_table(scores: Sequence[TierScores], chosen: Sequence[float]) -> str:
    """For each tier: its threshold swept, the others held at their chosen values."""
    header = f"{'tier':<8}{'threshold':>10}{'escalated':>11}{'to top':>9}{'cascade acc':>13}"
    lines = [header, "-" * len(header)]
    for index, tier in enumerate(scores[:-1]):
        values = sorted({*np.round(np.linspace(0.3, 1.0, 15), 3), round(chosen[index], 4)})
        for value in values:
            trial = list(chosen)
            trial[index] = float(value)
            outcome = cascade(scores, trial)
            escalated = outcome.reached[index + 1] / outcome.reached[index] if outcome.reached[index] else 0.0
            mark = "  <- chosen" if abs(value - chosen[index]) < 1e-9 else ""
            lines.append(
                f"{tier.tier.label:<8}{value:>10.4f}{escalated:>11.1%}{outcome.reached[-1]:>9.1%}"
                f"{outcome.accuracy:>13.4f}{mark}"
            )
    return "\n".join(lines)


def calibrate(
    family: FamilySpec,
    *,
    cache: Path,
    target_accuracy: float | None = None,
    max_escalation: float | None = None,
    data: LabelledData | None = None,
) -> Calibration:
    """Thresholds chosen on ``data.calibration`` (default: the family's bundled data)."""
    if (target_accuracy is None) == (max_escalation is None):
        raise ConfigError("give exactly one of --target-accuracy and --max-escalation")
    data = data or bundled_data(family)
    return choose(
        tier_scores(family, data.calibration, cache),
        lambda: tier_scores(family, data.report, cache),
        data,
        target_accuracy=target_accuracy,
        max_escalation=max_escalation,
    )


def choose(
    scores: Sequence[TierScores],
    report: Callable[[], Sequence[TierScores]],
    data: LabelledData,
    *,
    target_accuracy: float | None,
    max_escalation: float | None,
) -> Calibration:
    """Thresholds for the goal, chosen on ``scores``; the outcome on the report split too."""
    if target_accuracy is not None:
        chosen = for_target_accuracy(scores, target_accuracy)
        goal = f"target_accuracy {target_accuracy:g}"
    else:
        chosen = for_max_escalation(scores, float(max_escalation or 0.0))
        goal = f"max_escalation {float(max_escalation or 0.0):g}"
    held_out = report()
    thresholds = {s.tier: t for s, t in zip(scores, chosen, strict=False)}
    on_report = cascade(held_out, chosen)
    warning = (
        shortfall_warning(thresholds, on_report.accuracy, target_accuracy, data)
        if target_accuracy is not None
        else ""
    )
    return Calibration(
        thresholds=thresholds,
        tiers=tuple(s.tier for s in scores),
        calibration=cascade(scores, chosen),
        held_out=on_report,
        table=sweep_table(scores, chosen),
        data=data,
        goal=goal,
        warnings=(warning,) if warning else (),
        per_tier=tier_figures(scores, chosen),
    )


def shortfall_warning(
    thresholds: Mapping[Tier, float], reported: float, target: float, data: LabelledData
) -> str:
    """A warning when the report split falls short of the target the thresholds were chosen
    for: they met it on the calibration examples only (too few, or not like the rest)."""
    if reported + 1e-12 >= target:
        return ""
    never = [tier.label for tier, value in thresholds.items() if value <= 0.0]
    zero = (
        f" A threshold of 0 ({', '.join(never)}) means that tier never escalates: on the calibration "
        "split it reached the target alone."
        if never
        else ""
    )
    margin = min(1.0, math.ceil((2 * target - reported) * 100) / 100)
    return (
        f"the report split's accuracy {reported:.4f} is below the target {target:.4f}: the thresholds reach "
        f"it on {data.calibration_name} but not on {data.report_name}.{zero} To hold the target, calibrate "
        f"on more labelled data (--data FILE.npz), or leave a margin (for example --target-accuracy "
        f"{margin:.2f}), and check the report line with --dry-run before writing"
    )


def _outcome_line(name: str, tiers: Sequence[Tier], outcome: Outcome) -> str:
    shares = ", ".join(f"{t.label} {r:.1%}" for t, r in zip(tiers, outcome.reached, strict=True))
    return f"{name:<12} accuracy {outcome.accuracy:.4f}; requests reaching: {shares}"


def describe(result: Calibration) -> str:
    chosen = ", ".join(f"{t.label} = {v:.4f}" for t, v in result.thresholds.items())
    return "\n".join(
        [
            result.table,
            "",
            f"thresholds chosen on: {result.data.calibration_name}",
            f"reported on:          {result.data.report_name} (information only; not used to choose)",
            f"chosen thresholds: {chosen}",
            _outcome_line("calibration", result.tiers, result.calibration),
            _outcome_line("report", result.tiers, result.held_out),
            *describe_figures(result.per_tier),
            *(f"warning: {warning}" for warning in result.warnings),
        ]
    )


def write(family: FamilySpec, result: Calibration) -> None:
    """The thresholds, and what they gave on the calibration split (the router's baseline),
    and each tier's figures (the audits' calibrated line)."""
    write_thresholds(family.source, result.thresholds, result.record())
    write_tier_accuracy(family.source, result.per_tier)


# ---------------------------------------------------------------------------------------------
# Comparing confidence methods
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodResult:
    """One confidence method at a target accuracy; ``thresholds`` is None where no
    thresholds reach the target on the calibration split."""

    method: ConfidenceMethod
    thresholds: dict[Tier, float] | None
    calibration: Outcome | None
    report: Outcome | None


def compare_methods(
    family: FamilySpec, *, cache: Path, target_accuracy: float, data: LabelledData | None = None
) -> list[MethodResult]:
    """For each confidence method, the thresholds for ``target_accuracy`` on the calibration
    split and what they give on both splits. The models run once per split."""
    data = data or bundled_data(family)
    calibration = tier_outputs(family, data.calibration, cache)
    report = tier_outputs(family, data.report, cache)
    results = []
    for method in ConfidenceMethod:
        scores = scored(family, calibration, data.calibration.y, method)
        try:
            chosen = for_target_accuracy(scores, target_accuracy)
        except ConfigError:
            results.append(MethodResult(method, None, None, None))
            continue
        results.append(
            MethodResult(
                method,
                {s.tier: t for s, t in zip(scores, chosen, strict=False)},
                cascade(scores, chosen),
                cascade(scored(family, report, data.report.y, method), chosen),
            )
        )
    return results


def describe_comparison(
    results: Sequence[MethodResult], *, family: FamilySpec, target: float, data: LabelledData
) -> str:
    top = max(v.tier for v in family.variants).label
    header = (
        f"{'method':<13}{'to ' + top + ' (cal)':>16}{'acc (cal)':>11}"
        f"{'to ' + top + ' (report)':>19}{'acc (report)':>14}  thresholds"
    )
    lines = [
        f"target accuracy {target:.4f}; thresholds chosen on: {data.calibration_name}",
        f"reported on: {data.report_name} (information only); nothing is written",
        "",
        header,
        "-" * len(header),
    ]
    for r in results:
        if r.thresholds is None or r.calibration is None or r.report is None:
            lines.append(f"{r.method.value:<13}  no thresholds reach the target on the calibration split")
            continue
        chosen = ", ".join(f"{t.label} = {v:.4f}" for t, v in r.thresholds.items())
        lines.append(
            f"{r.method.value:<13}{r.calibration.reached[-1]:>16.1%}{r.calibration.accuracy:>11.4f}"
            f"{r.report.reached[-1]:>19.1%}{r.report.accuracy:>14.4f}  {chosen}"
        )
    current = family.confidence.method.value
    lines += ["", f"the family's config uses: {current} ([confidence] method in {family.source})"]
    return "\n".join(lines)
