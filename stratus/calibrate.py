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
  per variant (temperatures fitted on this same split by ``models/build.py``), so they
  estimate the chance of being right; on a few hundred examples the counted accuracy moves
  in steps of one or two examples, which is noise when the tiers' models are close.

Thresholds are chosen on each tier's FP32 variant; its lower-precision children share
them, as they are served only when they agree with it (``models verify``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from stratus.confidence import confidence
from stratus.datasets import Split, dataset_for
from stratus.errors import ConfigError
from stratus.repository import FamilySpec, VariantSpec, write_thresholds
from stratus.runtimes import LoadOptions, load_runner
from stratus.tiers import Tier

Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class TierScores:
    """One tier's confidence and correctness on every labelled example."""

    tier: Tier
    variant: str
    confidence: Floats
    correct: Bools


@dataclass(frozen=True)
class Outcome:
    accuracy: float
    reached: tuple[float, ...]  # share of requests that reach each tier, bottom first
    # Mean confidence of the tier that answered each request: the accuracy that calibrated
    # (temperature-scaled) confidences predict.
    expected: float = 0.0


def cascade(scores: Sequence[TierScores], thresholds: Sequence[float]) -> Outcome:
    """Simulate the router's cascade for thresholds of every tier but the top one."""
    pending = np.ones(len(scores[0].correct), dtype=bool)
    correct = np.zeros_like(pending)
    expected = np.zeros(len(pending))
    reached = []
    for index, tier in enumerate(scores):
        reached.append(float(pending.mean()))
        last = index == len(scores) - 1
        answers = pending if last else pending & (tier.confidence >= thresholds[index])
        correct |= answers & tier.correct
        expected[answers] = tier.confidence[answers]
        pending &= ~answers
    return Outcome(accuracy=float(correct.mean()), reached=tuple(reached), expected=float(expected.mean()))


def candidate_thresholds(values: Floats, count: int = 60) -> list[float]:
    """Thresholds worth trying: 0, quantiles of the observed confidences, and just above the max."""
    quantiles = np.quantile(values, np.linspace(0.0, 1.0, count))
    return sorted({0.0, *map(float, quantiles), float(np.nextafter(values.max(), 2.0))})


def for_target_accuracy(scores: Sequence[TierScores], target: float) -> tuple[float, ...]:
    """Fewest requests at the top, then fewest beyond the bottom, with accuracy >= target."""
    grids = [candidate_thresholds(s.confidence) for s in scores[:-1]]
    best: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    for combo in itertools.product(*grids):
        outcome = cascade(scores, combo)
        if outcome.accuracy + 1e-12 < target:
            continue
        cost = (outcome.reached[-1], *reversed(outcome.reached[1:-1]), -outcome.accuracy)
        if best is None or cost < best[0]:
            best = (cost, combo)
    if best is None:
        top = scores[-1]
        raise ConfigError(
            f"no thresholds reach accuracy {target:.4f} on the calibration split; "
            f"sending everything to {top.variant} gives {float(top.correct.mean()):.4f}"
        )
    return best[1]


def for_max_escalation(scores: Sequence[TierScores], share: float) -> tuple[float, ...]:
    """Highest expected, then counted, accuracy (then highest thresholds) with at most
    ``share`` reaching the top tier."""
    grids = [candidate_thresholds(s.confidence) for s in scores[:-1]]
    best: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    for combo in itertools.product(*grids):
        outcome = cascade(scores, combo)
        if outcome.reached[-1] > share + 1e-12:
            continue
        rank = (outcome.expected, outcome.accuracy, sum(combo), *combo)
        if best is None or rank > best[0]:
            best = (rank, combo)
    if best is None:  # unreachable: thresholds of 0 send nothing up
        raise ConfigError(f"no thresholds keep the top tier's share under {share:.1%}")
    return best[1]


def reference_variant(family: FamilySpec, tier: Tier) -> VariantSpec:
    """The tier's FP32 variant: thresholds are chosen on it, and its lower-precision children
    are served only when they agree with it (``models verify``), so they share its thresholds."""
    variants = family.variants_for(tier)
    return next((v for v in variants if v.precision == "FP32" and v.parent is None), variants[0])


def tier_scores(family: FamilySpec, split: Split, cache: Path) -> list[TierScores]:
    """Run each tier's FP32 variant over a split (in the best runtime here)."""
    scores = []
    for tier in sorted({v.tier for v in family.variants}):
        variant = reference_variant(family, tier)
        runner = load_runner(family, variant, LoadOptions(tier=tier, cache_dir=cache))
        try:
            outputs = runner.infer({family.inputs[0].name: split.x})[family.confidence.output]
        finally:
            runner.close()
        conf = confidence(
            outputs,
            method=family.confidence.method,
            apply_softmax=family.confidence.apply_softmax,
            temperature=variant.temperature,
        )
        scores.append(
            TierScores(tier, variant.name, conf.astype(np.float64), outputs.argmax(axis=1) == split.y)
        )
    if len(scores) < 2:
        raise ConfigError(f"{family.source}: calibrating needs variants on at least two tiers")
    return scores


@dataclass(frozen=True)
class Calibration:
    thresholds: dict[Tier, float]
    calibration: Outcome
    held_out: Outcome
    table: str


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
) -> Calibration:
    if (target_accuracy is None) == (max_escalation is None):
        raise ConfigError("give exactly one of --target-accuracy and --max-escalation")
    data = dataset_for(family.name)
    scores = tier_scores(family, data.calibration, cache)
    if target_accuracy is not None:
        chosen = for_target_accuracy(scores, target_accuracy)
    else:
        chosen = for_max_escalation(scores, float(max_escalation or 0.0))
    held_out = tier_scores(family, data.held_out, cache)
    return Calibration(
        thresholds={s.tier: t for s, t in zip(scores, chosen, strict=False)},
        calibration=cascade(scores, chosen),
        held_out=cascade(held_out, chosen),
        table=sweep_table(scores, chosen),
    )


def describe(result: Calibration, tiers: Mapping[Tier, str]) -> str:
    def line(name: str, outcome: Outcome) -> str:
        shares = ", ".join(f"{t.label} {r:.1%}" for t, r in zip(tiers, outcome.reached, strict=False))
        return f"{name:<12} accuracy {outcome.accuracy:.4f}; requests reaching: {shares}"

    chosen = ", ".join(f"{t.label} = {v:.4f}" for t, v in result.thresholds.items())
    return "\n".join(
        [
            result.table,
            "",
            f"chosen thresholds: {chosen}",
            line("calibration", result.calibration),
            line("held-out", result.held_out) + "  (information only; not used to choose)",
        ]
    )


def write(family: FamilySpec, result: Calibration) -> None:
    write_thresholds(family.source, result.thresholds)
