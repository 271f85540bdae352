"""Thresholds suggested from the fleet's audits, by calibrate's own chooser.

The router keeps audit rows (``router/audit/rows.py``): an unbiased share of the traffic, each
item with every lower tier's confidence and class, labelled with the top tier's class (for a
generative family: each lower tier's confidence and whether its text agreed with the top's). Those
rows are a labelled split like calibrate's, with one difference: the label *is* the top tier's
answer, so the top tier is right on every row, and its confidence of agreeing with itself is 1.
:func:`audit_scores` turns them into calibrate's :class:`TierScores`, and :func:`suggest` runs
``for_target_accuracy`` or ``for_max_escalation`` on them unchanged: the accuracy it targets is
agreement with the top tier, which is what the audits measure and what ``[tier_accuracy]``
records as ``agreement``.

Any agreement up to 1 is within reach: with every lower tier at ``PASS_ALL`` all rows go to the
top tier. A tier whose answers the top tier contradicts at a confidence of 1.0 can only be
held to the goal that way, and the suggestion says so (``Suggestion.notes``): thresholds cannot
undo such errors, retraining can.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from stratus.errors import ConfigError
from stratus.families.audit import goal_problem
from stratus.families.confidence import PASS_ALL
from stratus.tiers import Tier
from stratus.tools.calibrate.classifier import (
    Outcome,
    TierScores,
    cascade,
    for_max_escalation,
    for_target_accuracy,
)
from stratus.wire import fleet_pb2 as fpb

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


def audit_scores(rows: Sequence[fpb.AuditRow], *, min_rows: int = MIN_ROWS) -> list[TierScores]:
    """Calibrate's per-tier scores from audit rows, the top tier's class as the label."""
    if not rows:
        raise ConfigError(f"no audit rows yet: a suggestion needs at least {min_rows}{_AUDIT_PACE}")
    top = rows[-1].top_tier
    rows = [r for r in rows if r.top_tier == top]  # audits asked another top before the fleet changed
    lower = sorted({Tier.parse(a.tier) for r in rows for a in r.tiers})
    incomplete = sum(1 for r in rows if len(r.tiers) != len(lower))
    if incomplete:
        raise ConfigError(
            f"{incomplete} of {len(rows)} audit rows lack a tier below the {top} tier (items that settled "
            "low were not asked of every tier between): a suggestion needs each row to hold every tier"
        )
    if len(rows) < min_rows:
        raise ConfigError(f"{len(rows)} audit rows so far; a suggestion needs at least {min_rows}{_AUDIT_PACE}")
    labels = np.array([r.label for r in rows])
    scores = [_tier_scores(tier, [r.tiers[i] for r in rows], labels) for i, tier in enumerate(lower)]
    ones = np.ones(len(rows))
    return [*scores, TierScores(Tier.parse(top), "audits", ones, np.ones(len(rows), dtype=bool), labels)]


def _tier_scores(tier: Tier, answers: Sequence[fpb.TierAnswer], labels: np.ndarray) -> TierScores:
    """A classifier row's tier is right when its class is the label; a generative row's when
    its text agreed with the top tier's (``agrees``, judged by the router)."""
    if any(Tier.parse(a.tier) is not tier for a in answers):
        raise ConfigError("audit rows list their tiers bottom first, each once")
    confidence = np.array([a.confidence for a in answers], dtype=np.float64)
    judged = sum(1 for a in answers if a.HasField("agrees"))
    if judged == len(answers):
        agreed = np.array([a.agrees for a in answers], dtype=bool)
        return TierScores(tier, "audits", confidence, agreed, agreed)
    if judged:
        raise ConfigError(f"the {tier.label} tier's audit rows mix classes and texts: one family is one kind")
    classes = np.array([a.answer for a in answers])
    return TierScores(tier, "audits", confidence, classes == labels, classes)


def suggest(
    rows: Sequence[fpb.AuditRow],
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
