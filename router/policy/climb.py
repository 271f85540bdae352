"""The climb, as a pure step: where a request goes next, and how it ends.

Both cascades (a classifier's, item by item, and a generation's, held until accepted) climb
by the same rules, decided here from the climb's state, the fleet snapshot and the answers:

* :func:`next_action` picks the next target (:class:`Dispatch`), or says the climb stops;
* :func:`after_answer` and :func:`after_failure` move the state on;
* :func:`finish` turns a stopped climb into :class:`Accept`, :class:`Degrade` or
  :class:`Fail`, which holds the error the client gets.

No I/O, no clock reads: the cascades perform each action and report what came back. Because
the rules live once, the two kinds of request cannot drift apart again (issue 19).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Generic

from router.policy import Attempt, C, FleetSnapshot, NoTarget, Target, choose, top_tier
from stratus.errors import DeadlineExceeded, Overloaded, StratusError, Unavailable
from stratus.tiers import Tier

# Errors after which another agent (or tier) may still succeed, within what budget is left.
_RETRYABLE = (Unavailable, Overloaded, DeadlineExceeded)
# How a climb past a tier is counted (the escalation metric's reason).
UNSURE, FAILED, TOO_SLOW = "unsure", "failed", "too_slow"


@dataclass(kw_only=True)
class ClimbState:
    """One request's climb so far: what it tried, what failed, and why it left a tier."""

    min_tier: Tier = Tier.DEVICE
    max_tier: Tier = Tier.CLOUD
    above: Tier | None = None  # only tiers above the last one that answered
    exclude: set[str] = field(default_factory=set)  # the targets (by id) that failed this request
    problem: StratusError | None = None  # the last failure met, which explains a climb that ends empty
    left: tuple[Tier, str] | None = None  # the tier left last, and why
    answered: list[Tier] = field(default_factory=list)  # the tiers whose answers were kept

    def attempt(self, model: str, remaining_ms: float, items: int = 1) -> Attempt:
        return Attempt(
            model=model,
            remaining_ms=remaining_ms,
            items=items,
            min_tier=self.min_tier,
            max_tier=self.max_tier,
            above=self.above,
            exclude=frozenset(self.exclude),
        )


@dataclass(frozen=True, kw_only=True)
class Escalation:
    """A climb to count: from ``left`` to ``to``, and why."""

    left: Tier
    to: Tier
    reason: str


@dataclass(frozen=True, kw_only=True)
class Dispatch(Generic[C]):
    """Send the request (its unsure items) to ``target``; ``final``: nothing above may be
    reached after it, so its answer settles everything it is sent."""

    target: Target[C]
    final: bool
    escalation: Escalation | None = None


@dataclass(frozen=True, kw_only=True)
class Stop:
    """Nothing more can be tried: the climb ends (see :func:`finish`)."""


@dataclass(frozen=True, kw_only=True)
class Accept:
    """Every item is settled: answer as it is."""


@dataclass(frozen=True, kw_only=True)
class Degrade:
    """Some answer is unsure and nothing above can take it: the best so far, marked degraded."""


@dataclass(frozen=True, kw_only=True)
class Fail:
    """No answer the client may have: fail with ``error``."""

    error: StratusError


def retryable(error: StratusError) -> bool:
    """Whether another agent or tier may still succeed after ``error``."""
    return isinstance(error, _RETRYABLE)


def is_final(tier: Tier, snapshot: FleetSnapshot[C], max_tier: Tier, *, pinned: bool = False) -> bool:
    """An answer from ``tier`` is final: pinned, or from the highest tier the request may reach."""
    top = top_tier(snapshot, max_tier)
    return pinned or top is None or tier >= top


def next_action(
    state: ClimbState, attempt: Attempt, snapshot: FleetSnapshot[C], rng: random.Random, *, pinned: bool = False
) -> Dispatch[C] | Stop:
    """Where the attempt goes next, or Stop (keeping why nothing could take it)."""
    target = choose(attempt, snapshot, rng)
    if isinstance(target, NoTarget):
        # A failure met on the way up explains more than "nothing is left to try".
        if state.problem is None:
            state.problem = no_target_error(target)
        return Stop()
    final = is_final(target.tier, snapshot, state.max_tier, pinned=pinned)
    return Dispatch(target=target, final=final, escalation=escalation(state, target.tier, snapshot.tiers))


def no_target_error(target: NoTarget) -> StratusError:
    kind = Overloaded if target.full else DeadlineExceeded if target.too_slow else Unavailable
    return kind(target.reason)


def escalation(state: ClimbState, tier: Tier, tiers: frozenset[Tier]) -> Escalation | None:
    """The climb a dispatch to ``tier`` makes: after an unsure answer or a failure, or on the
    first try, past the lower tiers the model has (too slow to try)."""
    if state.left is None:
        lower = [t for t in tiers if state.min_tier <= t < tier]
        return Escalation(left=min(lower), to=tier, reason=TOO_SLOW) if lower else None
    left, reason = state.left
    return Escalation(left=left, to=tier, reason=reason) if tier > left else None


def after_answer(state: ClimbState, tier: Tier) -> None:
    """An answer came back from ``tier``: whatever is still unsure climbs above it."""
    state.above = tier
    state.left = (tier, UNSURE)
    state.answered.append(tier)


def after_failure(state: ClimbState, target: Target[C], error: StratusError) -> None:
    """``target`` failed (retryably): try elsewhere, never there again for this request."""
    state.exclude.add(target.id)
    state.problem = error
    state.left = (target.tier, FAILED)


@dataclass(frozen=True, kw_only=True)
class CloudFacts:
    """What :func:`finish` needs to know of the cloud, where the router has one."""

    serves: bool  # the model
    status: str  # as the cloud link says it, for the error
    fail_without: bool  # the router runs with --on-cloud-failure fail


def finish(
    state: ClimbState,
    *,
    answered: bool,
    unsure: str,
    budget_ms: float,
    cloud: CloudFacts | None,
) -> Accept | Degrade | Fail:
    """How a stopped climb ends. ``unsure`` says what is still unsure ("" when nothing is).

    Unsure answers are degraded, except under ``--on-cloud-failure fail`` when the cloud
    was the way up (it serves the model, the request allows it, and it did not answer): then
    the request fails UNAVAILABLE. With no answer at all, the last failure met is the error.
    """
    if answered and not unsure:
        return Accept()
    if answered:
        if cloud is not None and cloud.fail_without and needed_cloud(state, cloud):
            return Fail(
                error=Unavailable(
                    f"the cloud is unavailable ({cloud.status}) and the router runs with "
                    f"--on-cloud-failure fail; {unsure}"
                )
            )
        return Degrade()
    return Fail(
        error=state.problem
        or DeadlineExceeded(f"budget of {budget_ms:.1f} ms ran out before any tier answered")
    )


def needed_cloud(state: ClimbState, cloud: CloudFacts) -> bool:
    """The climb stopped below a cloud that serves the model and was not refused by max_tier."""
    return cloud.serves and state.max_tier >= Tier.CLOUD and Tier.CLOUD not in state.answered
