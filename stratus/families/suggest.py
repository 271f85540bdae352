"""Thresholds chosen by simulating the cascade: the pure search that ``stratus models calibrate``
runs on a labelled split, and that a router's audit rows feed (``stratus fleet thresholds
--suggest``, and ``--auto-thresholds`` in the router itself).

It reads arrays of confidences and correctness, never a model, a file or a message: calibrate
scores its split with the runtimes (``stratus/tools/calibrate``), the router keeps audit rows
(``router/audit/rows.py``) as :class:`AuditRow` values, and both ask this module.

Audit rows are a labelled split like calibrate's, with one difference: the label *is* the top
tier's answer, so the top tier is right on every row, and its confidence of agreeing with itself
is 1. :func:`audit_scores` turns them into :class:`TierScores`, and :func:`suggest` runs
:func:`for_target_accuracy` or :func:`for_max_escalation` on them unchanged: the accuracy it
targets is agreement with the top tier, which is what the audits measure and what
``[tier_accuracy]`` records as ``agreement``.

Any agreement up to 1 is within reach: with every lower tier at ``PASS_ALL`` all rows go to the
top tier. A tier whose answers the top tier contradicts at a confidence of 1.0 can only be held
to the goal that way, and the suggestion says so (``Suggestion.notes``): thresholds cannot undo
such errors, retraining can.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from stratus.errors import ConfigError
from stratus.families.audit import goal_problem
from stratus.families.confidence import PASS_ALL
from stratus.tiers import Tier

Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]

# family.toml keeps thresholds with this many decimals (``write_thresholds``).
THRESHOLD_DECIMALS: Final = 4


@dataclass(frozen=True)
class TierScores:
    """One tier's confidence and correctness on every labelled example."""

    tier: Tier
    variant: str
    confidence: Floats
    correct: Bools
    # Each example's answer (class, or stripped text): agreement with the top tier is read from it.
    answers: npt.NDArray[Any] | None = None


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
    """Thresholds worth trying: 0, quantiles of the observed confidences, and the smallest
    value above the max (``PASS_ALL`` above a confidence of 1.0: the tier then answers
    nothing), all with ``THRESHOLD_DECIMALS`` decimals."""
    quantiles = np.quantile(values, np.linspace(0.0, 1.0, count))
    return sorted({0.0, *(_written(float(q)) for q in quantiles), _just_above(float(values.max()))})


def _written(value: float) -> float:
    """``value`` rounded down to what family.toml stores. The cascade is simulated with this
    stored value, so writing it changes nothing that was printed."""
    step = 10**THRESHOLD_DECIMALS
    return round(math.floor(value * step) / step, THRESHOLD_DECIMALS)


def _just_above(value: float) -> float:
    """The smallest storable threshold above ``value``: every answer of the tier escalates.
    Above a confidence of 1.0 (a saturated softmax) that is ``PASS_ALL``."""
    threshold = _written(value)
    while threshold <= value:
        threshold = round(threshold + 10.0**-THRESHOLD_DECIMALS, THRESHOLD_DECIMALS)
    return min(threshold, PASS_ALL)


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


@dataclass(frozen=True)
class TierAnswer:
    """One tier's answer on one audited item: its confidence and its top-1 class; for a
    generative family, whether its text agreed with the top tier's (``answer`` is then 0)."""

    tier: Tier
    confidence: float
    answer: int
    agrees: bool | None = None


@dataclass(frozen=True)
class AuditRow:
    """One audited item: the lower tiers' answers (bottom first) and the top tier's class."""

    lower: tuple[TierAnswer, ...]
    top: Tier
    label: int
    at: float = 0.0  # monotonic time it was kept (a router's rows age out)


# Fewer rows than this and the counted accuracy moves in steps of a percent: no suggestion.
MIN_ROWS: Final = 200
# How rows accrue, said with every "too few": at the default share, 200 rows are ~20,000 requests.
_AUDIT_PACE: Final = (
    ". Audits ask the top tier about 1% of answers by default, so that is about 100 requests a row: "
    "wait for more, or audit more for a while (`stratus router --audit-share 0.05`, or the family's "
    "[audit] share)"
)


@dataclass(frozen=True, kw_only=True)
class Suggestion:
    thresholds: dict[Tier, float]
    goal: str
    rows: int
    outcome: Outcome  # on the rows, with the suggested thresholds
    tiers: tuple[Tier, ...]  # bottom first, as ``outcome.reached``
    notes: tuple[str, ...] = ()  # what an operator should know beside the thresholds


def audit_scores(rows: Sequence[AuditRow], *, min_rows: int = MIN_ROWS) -> list[TierScores]:
    """Calibrate's per-tier scores from audit rows, the top tier's class as the label."""
    if not rows:
        raise ConfigError(f"no audit rows yet: a suggestion needs at least {min_rows}{_AUDIT_PACE}")
    top = rows[-1].top
    rows = [r for r in rows if r.top == top]  # audits asked another top before the fleet changed
    lower = sorted({a.tier for r in rows for a in r.lower})
    incomplete = sum(1 for r in rows if len(r.lower) != len(lower))
    if incomplete:
        raise ConfigError(
            f"{incomplete} of {len(rows)} audit rows lack a tier below the {top} tier (items that settled "
            "low were not asked of every tier between): a suggestion needs each row to hold every tier"
        )
    if len(rows) < min_rows:
        raise ConfigError(f"{len(rows)} audit rows so far; a suggestion needs at least {min_rows}{_AUDIT_PACE}")
    labels = np.array([r.label for r in rows])
    scores = [_tier_scores(tier, [r.lower[i] for r in rows], labels) for i, tier in enumerate(lower)]
    ones = np.ones(len(rows))
    return [*scores, TierScores(top, "audits", ones, np.ones(len(rows), dtype=bool), labels)]


def _tier_scores(tier: Tier, answers: Sequence[TierAnswer], labels: npt.NDArray[Any]) -> TierScores:
    """A classifier row's tier is right when its class is the label; a generative row's when
    its text agreed with the top tier's (``agrees``, judged by the router)."""
    if any(a.tier is not tier for a in answers):
        raise ConfigError("audit rows list their tiers bottom first, each once")
    confidence = np.array([a.confidence for a in answers], dtype=np.float64)
    judged = sum(1 for a in answers if a.agrees is not None)
    if judged == len(answers):
        agreed = np.array([a.agrees for a in answers], dtype=bool)
        return TierScores(tier, "audits", confidence, agreed, agreed)
    if judged:
        raise ConfigError(f"the {tier.label} tier's audit rows mix classes and texts: one family is one kind")
    classes = np.array([a.answer for a in answers])
    return TierScores(tier, "audits", confidence, classes == labels, classes)


def suggest(
    rows: Sequence[AuditRow],
    *,
    target_accuracy: float | None = None,
    max_escalation: float | None = None,
    min_rows: int = MIN_ROWS,
) -> Suggestion:
    """The thresholds calibrate would choose for the goal, on the audit rows."""
    if (target_accuracy is None) == (max_escalation is None):
        raise ConfigError("give exactly one goal: --target-accuracy or --max-escalation")
    scores = audit_scores(rows, min_rows=min_rows)
    if target_accuracy is not None:
        chosen = for_target_accuracy(scores, target_accuracy)  # agreement 1 is in reach: all to the top
        goal = f"target_accuracy {target_accuracy:g}"
    else:
        share = float(max_escalation or 0.0)
        chosen, goal = for_max_escalation(scores, share), f"max_escalation {share:g}"
    return Suggestion(
        thresholds={s.tier: t for s, t in zip(scores, chosen, strict=False)},
        goal=goal,
        rows=len(scores[0].correct),
        outcome=cascade(scores, chosen),
        tiers=tuple(s.tier for s in scores),
        notes=_passed_notes(scores, chosen),
    )


def _passed_notes(scores: Sequence[TierScores], chosen: Sequence[float]) -> tuple[str, ...]:
    """Why a tier is suggested at ``PASS_ALL``: its answers the top tier contradicts at a
    confidence of 1.0, which no threshold up to 1 sends up. Those are for retraining."""
    top = scores[-1].tier.label
    notes = []
    for tier, threshold in zip(scores, chosen, strict=False):
        if threshold < PASS_ALL:
            continue
        sure = int(np.sum((tier.confidence >= 1.0) & ~tier.correct))
        notes.append(
            f"the {tier.tier.label} tier passes every request up ({PASS_ALL}): {sure} of its "
            f"{len(tier.correct)} audited answers disagreed with the {top} tier at full confidence, "
            "which no threshold up to 1 sends up. Retrain it on captured items (README: capture and "
            "retrain), roll it out, then --revert or suggest again"
        )
    return tuple(notes)


def goal_of(recorded: str) -> tuple[float | None, float | None]:
    """(target_accuracy, max_escalation) from a goal as calibrate records it ("target_accuracy 0.985")."""
    problem = goal_problem(recorded)
    if problem is not None:
        raise ConfigError(f"[calibration] goal {problem}")
    name, _, value = recorded.partition(" ")
    return (float(value), None) if name == "target_accuracy" else (None, float(value))
