"""Judging one rollout step (pure): what each arm did over the step's window, and whether
the candidate is worse than the current variant beyond the rollout's margins, with the
sampling noise of the shares taken into account. ``router.rollout.plans`` holds the plans and
acts on the verdicts."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from stratus import datatypes
from stratus.convert.tensors import Tensors
from stratus.errors import InvalidInput

# Latencies kept per arm and step: enough for a stable p99, bounded memory.
WINDOW_LATENCIES: Final = 20_000


@dataclass(frozen=True, kw_only=True)
class Margins:
    """How much worse than the current variant a candidate may be and still advance."""

    max_error_increase: float = 0.01
    max_p99_ratio: float = 1.5
    # Below a few milliseconds a ratio alone would judge scheduler noise.
    p99_slack_ms: float = 2.0
    max_unsure_increase: float = 0.05
    # Agreement with the family's top tier, from the audits: a model wrong and sure of itself
    # has no more errors, latency or unsure answers than a good one, only this. A step advances
    # once the candidate's agreement is surely within this of the current's, and rolls back
    # once it is surely below it at all (see agreement_verdict).
    max_disagreement_increase: float = 0.01

    def __post_init__(self) -> None:
        shares = (self.max_error_increase, self.max_unsure_increase, self.max_disagreement_increase)
        if not all(0 <= share <= 1 for share in shares):
            raise InvalidInput("error, unsure and disagreement margins are shares between 0 and 1")
        if self.max_p99_ratio < 1 or self.p99_slack_ms < 0:
            raise InvalidInput("the p99 ratio must be at least 1 and its slack not negative")


@dataclass
class ArmWindow:
    """What one variant did in the current step: requests, errors, latency, unsure items."""

    requests: int = 0
    errors: int = 0
    items: int = 0
    unsure: int = 0
    latencies_ms: list[float] = field(default_factory=list)  # sorted
    audited: int = 0  # its answers the family's top tier was asked too (router.audit.auditor)
    disagreed: int = 0  # of those, the ones the top tier answered otherwise

    def add_audit(self, *, agreed: bool) -> None:
        self.audited += 1
        self.disagreed += 0 if agreed else 1

    @property
    def agreement(self) -> float:
        """The share of its audited answers the top tier answered alike (1 with none audited)."""
        return 1.0 - self.disagreed / self.audited if self.audited else 1.0

    def add(self, *, ok: bool, latency_ms: float, items: int, unsure: int) -> None:
        self.requests += 1
        if not ok:
            self.errors += 1
            return
        self.items += items
        self.unsure += unsure
        if len(self.latencies_ms) < WINDOW_LATENCIES:
            bisect.insort(self.latencies_ms, latency_ms)

    @property
    def error_share(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def unsure_share(self) -> float:
        return self.unsure / self.items if self.items else 0.0

    @property
    def p99_ms(self) -> float:
        values = self.latencies_ms
        return values[min(len(values) - 1, int(0.99 * len(values)))] if values else 0.0


@dataclass(frozen=True)
class Verdict:
    action: str  # "wait", "advance" or "rollback"
    reason: str
    # Waiting because the audits so far neither show the candidate within the margin nor
    # surely worse: the next look needs more of them (router.rollout.plans grows the count).
    inconclusive: bool = False


def judge(
    current: ArmWindow, candidate: ArmWindow, *, min_requests: int, margins: Margins, min_audits: int = 0
) -> Verdict:
    """The candidate against the current variant over one window (pure). ``min_audits``: the
    audits each arm needs before it is judged (0 where nothing above the tier can audit it)."""
    if current.requests < min_requests or candidate.requests < min_requests:
        return Verdict(
            "wait",
            f"{candidate.requests} candidate and {current.requests} current requests of {min_requests} each",
        )
    worse = _worse(current, candidate, margins)
    if worse:  # what the requests show needs no audit
        return Verdict("rollback", worse)
    if current.audited < min_audits or candidate.audited < min_audits:
        return Verdict(
            "wait", f"{candidate.audited} candidate and {current.audited} current audits of {min_audits} each"
        )
    agreement = agreement_verdict(current, candidate, margins) if min_audits else None
    if agreement is not None and agreement.action != "advance":
        return agreement
    agreed = f", {agreement.reason}" if agreement is not None else ""
    return Verdict(
        "advance",
        f"no worse over {candidate.requests}/{current.requests} requests: errors "
        f"{candidate.error_share:.1%} vs {current.error_share:.1%}, p99 {candidate.p99_ms:.1f} vs "
        f"{current.p99_ms:.1f} ms, unsure {candidate.unsure_share:.1%} vs {current.unsure_share:.1%}{agreed}",
    )


def _worse(current: ArmWindow, candidate: ArmWindow, margins: Margins) -> str:
    """Why the candidate's requests are worse beyond a margin (errors, tail, unsure), or ""."""
    if worse_beyond(candidate.errors, candidate.requests, current.errors, current.requests) > (
        margins.max_error_increase
    ):
        return (
            f"errors {candidate.error_share:.1%} vs {current.error_share:.1%} "
            f"(margin {margins.max_error_increase:.1%})"
        )
    slower = _slower(current, candidate, margins)
    if slower:
        return slower
    if worse_beyond(candidate.unsure, candidate.items, current.unsure, current.items) > (
        margins.max_unsure_increase
    ):
        return (
            f"unsure {candidate.unsure_share:.1%} vs {current.unsure_share:.1%} "
            f"(margin {margins.max_unsure_increase:.1%})"
        )
    return ""


# Looks at the audits are repeated as they accrue, and each look at an equal candidate could
# wrongly find it worse: a rollback on agreement asks for a one-sided 99.5% interval, and
# router.rollout.plans spaces the looks (each needs AUDIT_LOOK_GROWTH times the audits of the last).
# Simulated with the default margin (tests/unit/test_rollout_judge.py does it): equal arms at
# 98% or 95% agreement are wrongly rolled back at 3.5% or 4.5% of steps.
_Z_WORSE: Final = 2.576
AUDIT_LOOK_GROWTH: Final = 1.5


def agreement_verdict(current: ArmWindow, candidate: ArmWindow, margins: Margins) -> Verdict:
    """The candidate's agreement with the top tier against the current variant's, from each
    arm's audited answers: "rollback" when it is surely lower at all, "advance" when surely
    no more than ``max_disagreement_increase`` lower, else an inconclusive "wait". A 1.3-point
    loss (99.5% against 98.2%, the review's case) is rolled back at 83% of steps, the median
    step deciding at about 860 audits an arm."""
    margin = margins.max_disagreement_increase
    figures = (
        f"agreement {candidate.agreement:.1%} vs {current.agreement:.1%} with the top tier over "
        f"{candidate.audited}/{current.audited} audits"
    )
    if (
        worse_beyond(candidate.disagreed, candidate.audited, current.disagreed, current.audited, z=_Z_WORSE)
        > 0
    ):
        return Verdict("rollback", f"{figures} (surely lower)")
    # the upper end of the difference's interval: how much worse it could still be
    could_be = -worse_beyond(current.disagreed, current.audited, candidate.disagreed, candidate.audited)
    if could_be < margin:
        return Verdict("advance", f"{figures} (within {margin:.1%})")
    return Verdict("wait", f"{figures}: not yet surely within {margin:.1%}", inconclusive=True)


# The share of requests a p99 leaves out: a candidate must surely exceed the current
# variant's slow share by more than this before its tail counts as slower.
TAIL_SHARE: Final = 0.01
# One-sided 95% normal quantile.
_Z = 1.645


def worse_beyond(bad_a: int, n_a: int, bad_b: int, n_b: int, *, z: float = _Z) -> float:
    """How much A's share of bad outcomes surely exceeds B's: the lower end of a one-sided
    95% interval for the difference (Wald, with a continuity floor so 0/n is not certain;
    ``z`` for another confidence)."""
    if n_a == 0 or n_b == 0:
        return 0.0
    p_a, p_b = bad_a / n_a, bad_b / n_b
    noise = math.sqrt(max(p_a * (1 - p_a), 0.25 / n_a) / n_a + max(p_b * (1 - p_b), 0.25 / n_b) / n_b)
    return (p_a - p_b) - z * noise


def _slower(current: ArmWindow, candidate: ArmWindow, margins: Margins) -> str:
    """Why the candidate's tail is slower beyond the margin, or "".

    A p99 read from a few hundred requests is the second or third slowest of them: noise.
    So the p99 is judged by what it means: the share of requests slower than the current
    variant's p99 times ``max_p99_ratio`` (or plus ``p99_slack_ms``). A candidate no slower
    has about as few of those as the current one (under 1%); it is rolled back when its
    share is surely more than TAIL_SHARE larger, which a slower tail shows at once and a
    like one, a few unlucky requests apart, does not.
    """
    limit = max(current.p99_ms * margins.max_p99_ratio, current.p99_ms + margins.p99_slack_ms)
    mine, theirs = _count_above(current.latencies_ms, limit), _count_above(candidate.latencies_ms, limit)
    if worse_beyond(theirs, len(candidate.latencies_ms), mine, len(current.latencies_ms)) <= TAIL_SHARE:
        return ""
    share = theirs / len(candidate.latencies_ms)
    return (
        f"p99 {candidate.p99_ms:.1f} ms vs {current.p99_ms:.1f} ms: {share:.1%} of its requests took "
        f"over {limit:.1f} ms (the current p99 x {margins.max_p99_ratio:g}, or + {margins.p99_slack_ms:g} ms)"
    )


def _count_above(sorted_values: list[float], limit: float) -> int:
    return len(sorted_values) - bisect.bisect_right(sorted_values, limit)


def top1(tensors: Tensors) -> np.ndarray[Any, Any] | None:
    """Each item's highest-scoring class in the first output, for shadow agreement."""
    names = tensors.names()
    if not names:
        return None
    raw = tensors.get(names[0])
    if not raw.fixed_size or len(raw.shape) < 2:
        return None
    values = np.frombuffer(raw.data, dtype=datatypes.numpy_dtype(raw.datatype))
    best: np.ndarray[Any, Any] = values.reshape(raw.shape[0], -1).argmax(axis=1)
    return best
