"""The climb's rules, pure (router/policy/climb.py): no fleet, no clock, no cascade.

Both cascades perform these decisions; tests/unit/cascade/ checks that they do. Here each
rule is checked on its own: how a climb ends, how a climb past a tier is counted, and what
a failure or an empty fleet leaves behind.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from router.policy import Attempt, FleetSnapshot, Target
from router.policy.climb import (
    FAILED,
    TOO_SLOW,
    UNSURE,
    Accept,
    ClimbState,
    CloudFacts,
    Degrade,
    Dispatch,
    Escalation,
    Fail,
    Stop,
    after_answer,
    after_failure,
    escalation,
    finish,
    is_final,
    next_action,
    retryable,
)
from stratus.errors import DeadlineExceeded, InvalidInput, Overloaded, Unavailable
from stratus.tiers import Tier

DEVICE, EDGE, CLOUD = Tier.DEVICE, Tier.EDGE, Tier.CLOUD
SERVING = CloudFacts(serves=True, status="open (3 failures)", fail_without=True)


@dataclass(frozen=True, kw_only=True)
class Agent:
    """A Candidate with fixed figures."""

    id: str
    tier: Tier
    in_flight: int = 0
    limit: int = 0
    ready: bool = True
    capacity: int = 1
    rtt_ms: float = 0.5

    def max_batch(self, model: str) -> int:
        return 1

    def cost_ms(self, model: str, items: int) -> float:
        return 2.0 * items


def end(
    state: ClimbState, *, answered: bool = True, unsure: str = "", cloud: CloudFacts | None = SERVING
) -> object:
    return finish(state, answered=answered, unsure=unsure, budget_ms=80.0, cloud=cloud)


# -- how a climb ends ---------------------------------------------------------------------------


def test_a_climb_with_nothing_unsure_is_accepted() -> None:
    assert end(ClimbState(), unsure="") == Accept()


def test_unsure_answers_below_a_cloud_that_was_the_way_up_fail_under_on_cloud_failure_fail() -> None:
    state = ClimbState()
    after_answer(state, DEVICE)
    ended = end(state, unsure="2 item(s) were still unsure")
    assert isinstance(ended, Fail) and isinstance(ended.error, Unavailable)
    assert str(ended.error) == (
        "the cloud is unavailable (open (3 failures)) and the router runs with "
        "--on-cloud-failure fail; 2 item(s) were still unsure"
    )


@pytest.mark.parametrize(
    ("max_tier", "cloud", "answered_by"),
    [
        (EDGE, SERVING, DEVICE),  # the client forbade the cloud
        (CLOUD, CloudFacts(serves=False, status="ok", fail_without=True), DEVICE),  # it lacks the model
        (CLOUD, SERVING, CLOUD),  # it answered (an unsure answer of the top tier is final anyway)
        (CLOUD, CloudFacts(serves=True, status="open", fail_without=False), DEVICE),  # the default rule
        (CLOUD, None, DEVICE),  # no cloud at all
    ],
    ids=["max_tier=edge", "cloud lacks the model", "cloud answered", "on-cloud-failure degrade", "no cloud"],
)
def test_unsure_answers_are_degraded_where_the_cloud_was_not_the_way_up(
    max_tier: Tier, cloud: CloudFacts | None, answered_by: Tier
) -> None:
    state = ClimbState(max_tier=max_tier)
    after_answer(state, answered_by)
    assert end(state, unsure="the answer was still unsure", cloud=cloud) == Degrade()


def test_a_climb_without_an_answer_fails_with_the_last_failure_met() -> None:
    state = ClimbState()
    after_failure(state, Target(tier=EDGE, candidate=Agent(id="e1", tier=EDGE)), Overloaded("e1 is full"))
    ended = end(state, answered=False)
    assert isinstance(ended, Fail) and str(ended.error) == "e1 is full"


def test_a_climb_that_met_nothing_fails_as_the_budget_running_out() -> None:
    ended = end(ClimbState(), answered=False)
    assert isinstance(ended, Fail) and isinstance(ended.error, DeadlineExceeded)
    assert str(ended.error) == "budget of 80.0 ms ran out before any tier answered"


# -- how a climb past a tier is counted ---------------------------------------------------------


def test_the_first_try_above_the_lowest_tiers_counts_them_as_too_slow() -> None:
    state = ClimbState(min_tier=DEVICE)
    assert escalation(state, CLOUD, frozenset({DEVICE, EDGE})) == Escalation(
        left=DEVICE, to=CLOUD, reason=TOO_SLOW
    )
    assert escalation(ClimbState(min_tier=EDGE), EDGE, frozenset({DEVICE, EDGE})) is None


def test_a_climb_after_an_answer_is_unsure_and_after_a_failure_failed() -> None:
    state = ClimbState()
    after_answer(state, DEVICE)
    assert escalation(state, EDGE, frozenset({DEVICE, EDGE})) == Escalation(
        left=DEVICE, to=EDGE, reason=UNSURE
    )
    after_failure(state, Target(tier=EDGE, candidate=Agent(id="e1", tier=EDGE)), Unavailable("lost"))
    assert escalation(state, CLOUD, frozenset({DEVICE, EDGE})) == Escalation(
        left=EDGE, to=CLOUD, reason=FAILED
    )
    assert escalation(state, EDGE, frozenset({DEVICE, EDGE})) is None  # a retry on the same tier


# -- failures and an empty fleet ----------------------------------------------------------------------


def test_only_errors_another_target_may_not_repeat_are_retried() -> None:
    assert all(retryable(e) for e in (Unavailable("x"), Overloaded("x"), DeadlineExceeded("x")))
    assert not retryable(InvalidInput("x"))


def test_a_failed_target_is_never_tried_again_for_the_request() -> None:
    state = ClimbState()
    after_failure(state, Target(tier=CLOUD, candidate=Agent(id="cloud@gw:8002", tier=CLOUD)), Unavailable("down"))
    after_failure(state, Target(tier=EDGE, candidate=Agent(id="e1", tier=EDGE)), Unavailable("lost"))
    assert state.attempt("digits", 50.0).exclude == frozenset({"cloud@gw:8002", "e1"})


def test_nothing_to_try_stops_the_climb_and_keeps_why() -> None:
    full = Agent(id="e1", tier=EDGE, in_flight=2, limit=2)
    snapshot = FleetSnapshot(pools={EDGE: [full]}, tiers=frozenset({EDGE}))
    state = ClimbState()
    assert next_action(state, state.attempt("digits", 50.0), snapshot, random.Random(1)) == Stop()
    assert isinstance(state.problem, Overloaded) and "full work queue" in str(state.problem)


def test_a_failure_met_on_the_way_explains_more_than_an_empty_fleet() -> None:
    state = ClimbState()
    after_failure(state, Target(tier=DEVICE, candidate=Agent(id="d1", tier=DEVICE)), DeadlineExceeded("d1 timed out"))
    assert (
        next_action(state, state.attempt("digits", 50.0), FleetSnapshot(pools={}), random.Random(1)) == Stop()
    )
    assert str(state.problem) == "d1 timed out"


def test_a_dispatch_to_the_highest_tier_the_request_may_reach_is_final() -> None:
    snapshot = FleetSnapshot(
        pools={DEVICE: [Agent(id="d1", tier=DEVICE)], EDGE: [Agent(id="e1", tier=EDGE)]},
        tiers=frozenset({DEVICE, EDGE}),
    )
    state = ClimbState(max_tier=EDGE)
    action = next_action(state, state.attempt("digits", 50.0), snapshot, random.Random(1))
    assert action == Dispatch(target=Target(tier=DEVICE, candidate=Agent(id="d1", tier=DEVICE)), final=False)
    assert is_final(EDGE, snapshot, EDGE) and not is_final(DEVICE, snapshot, EDGE)
    assert is_final(DEVICE, snapshot, EDGE, pinned=True)
    assert is_final(DEVICE, snapshot, DEVICE)  # max_tier keeps the request on the device


def test_an_attempt_carries_the_climbs_bounds_and_progress() -> None:
    state = ClimbState(min_tier=EDGE, max_tier=EDGE)
    after_answer(state, EDGE)
    assert state.attempt("digits", 12.5, items=3) == Attempt(
        model="digits", remaining_ms=12.5, items=3, min_tier=EDGE, max_tier=EDGE, above=EDGE
    )
