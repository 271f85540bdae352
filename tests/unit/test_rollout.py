"""Gray release, the pure parts: the verdict and the steps (the site's store: tests/unit/test_rollout_records.py)."""

from __future__ import annotations

import random
import re

import pytest

from router.rollout.judge import ArmWindow, Margins, judge, worse_beyond
from router.rollout.plan import ABORTED, COMPLETE, PROMOTED, ROLLED_BACK, RUNNING, check_steps
from router.rollout.plans import Rollouts
from stratus.errors import Conflict, InvalidInput, NotFound
from stratus.tiers import Tier


def window(requests: int, *, errors: int = 0, unsure: int = 0, latency_ms: float = 1.0) -> ArmWindow:
    arm = ArmWindow()
    for index in range(requests):
        failed = index < errors
        arm.add(
            ok=not failed,
            latency_ms=latency_ms,
            items=1,
            unsure=1 if index - errors < unsure and not failed else 0,
        )
    return arm


def test_waits_until_both_variants_served_enough() -> None:
    verdict = judge(window(99), window(500), min_requests=100, margins=Margins())
    assert verdict.action == "wait" and "500 candidate and 99 current" in verdict.reason


def test_equal_variants_advance() -> None:
    verdict = judge(window(200, unsure=4), window(100, unsure=3), min_requests=100, margins=Margins())
    assert verdict.action == "advance", verdict.reason


@pytest.mark.parametrize(
    ("candidate", "word"),
    [
        (window(100, errors=10), "errors"),
        (window(100, latency_ms=9.0), "p99"),
        (window(100, unsure=60), "unsure"),
    ],
)
def test_a_worse_candidate_is_rolled_back_saying_why(candidate: ArmWindow, word: str) -> None:
    current = window(300, unsure=6, latency_ms=2.0)
    verdict = judge(current, candidate, min_requests=100, margins=Margins())
    assert verdict.action == "rollback" and verdict.reason.startswith(word), verdict.reason


def test_p99_needs_both_the_ratio_and_the_slack() -> None:
    current = window(100, latency_ms=1.0)
    # 2.9 ms is 2.9x the current p99, but within the 2 ms slack: scheduler noise at this scale
    assert (
        judge(current, window(100, latency_ms=2.9), min_requests=100, margins=Margins()).action == "advance"
    )
    assert (
        judge(current, window(100, latency_ms=3.1), min_requests=100, margins=Margins()).action == "rollback"
    )


def test_a_few_slow_requests_are_not_a_slower_tail_but_a_slow_tenth_is() -> None:
    def tail(fast: int, slow: int, slow_ms: float) -> ArmWindow:
        arm = window(fast, latency_ms=10.0)
        for _ in range(slow):
            arm.add(ok=True, latency_ms=slow_ms, items=1, unsure=0)
        return arm

    current = tail(198, 2, 30.0)  # p99 30 ms
    unlucky = tail(197, 3, 50.0)  # its p99 (50 ms) is past 1.5 x 30 ms, by three requests
    assert judge(current, unlucky, min_requests=100, margins=Margins()).action == "advance"
    slow = tail(180, 20, 50.0)
    verdict = judge(current, slow, min_requests=100, margins=Margins())
    assert verdict.action == "rollback" and "10.0% of its requests took over 45.0 ms" in verdict.reason


def test_shares_are_judged_with_their_noise() -> None:
    assert worse_beyond(2, 30, 0, 30) < 0.05  # two unlucky items in thirty are not evidence
    assert worse_beyond(60, 100, 2, 100) > 0.4
    assert worse_beyond(0, 100, 50, 100) < 0  # better is never worse
    assert worse_beyond(5, 0, 0, 10) == 0.0


def test_steps_must_rise_within_0_and_100() -> None:
    assert check_steps([5, 25, 100]) == (5.0, 25.0, 100.0)
    with pytest.raises(InvalidInput, match="a rollout needs 1 to"):
        check_steps([])
    for bad in ([0, 50], [50, 25], [5, 5], [5, 101]):
        with pytest.raises(InvalidInput, match=re.escape(f"steps {[float(s) for s in bad]} must rise strictly")):
            check_steps(bad)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def serve(rollouts: Rollouts, clock: Clock, *, candidate_unsure: bool, count: int) -> None:
    """``count`` requests on the rollout's tier, split by the rollout's own draw."""
    for _ in range(count):
        drawn = rollouts.arm("digits", Tier.DEVICE)
        if drawn is None:
            return
        plan, to_candidate = drawn
        unsure = 1 if to_candidate and candidate_unsure else 0
        clock.now += 0.1
        rollouts.record(plan, candidate=to_candidate, ok=True, latency_ms=1.0, items=1, unsure=unsure)


def test_a_good_candidate_climbs_every_step_and_stays_at_the_last() -> None:
    clock = Clock()
    rollouts = Rollouts(router_id="a", rng=random.Random(1), clock=clock)
    rollouts.start("digits", Tier.DEVICE, "digits-small-v2", steps=(10, 50, 100), min_requests=20)
    seen = []
    for _ in range(20):
        serve(rollouts, clock, candidate_unsure=False, count=50)
        seen.append(rollouts.plan("digits", Tier.DEVICE).share)
    plan = rollouts.plan("digits", Tier.DEVICE)
    assert plan.state == COMPLETE and plan.share == 100.0
    assert seen == sorted(seen) and seen[0] == 10.0
    assert [h.split(":")[0] for h in plan.history] == [
        "started by an operator at 10%",
        "advanced from 10% to 50%",
        "advanced from 50% to 100%",
    ]
    assert rollouts.arm("digits", Tier.DEVICE) == (plan, True)


def test_a_bad_candidate_goes_to_zero_and_gets_no_more_requests() -> None:
    clock = Clock()
    rollouts = Rollouts(router_id="a", rng=random.Random(2), clock=clock)
    rollouts.start("digits", Tier.DEVICE, "digits-small-bad", steps=(25, 100), min_requests=20)
    serve(rollouts, clock, candidate_unsure=True, count=400)
    plan = rollouts.plan("digits", Tier.DEVICE)
    assert plan.state == ROLLED_BACK and plan.share == 0.0
    assert plan.reason.startswith("rolled back at 25%: unsure 100.0% vs 0.0%")
    assert rollouts.arm("digits", Tier.DEVICE) is None


def test_a_router_that_does_not_hold_the_judge_lease_measures_but_never_judges() -> None:
    """On a site only the lease's holder decides a step; the others keep counting, so the
    evidence is there the moment the lease comes to them."""
    clock = Clock()
    here = [False]
    rollouts = Rollouts(router_id="a", rng=random.Random(2), clock=clock)
    rollouts.judging_here = lambda: here[0]
    rollouts.start("digits", Tier.DEVICE, "digits-small-bad", steps=(25, 100), min_requests=20)
    serve(rollouts, clock, candidate_unsure=True, count=400)
    plan = rollouts.plan("digits", Tier.DEVICE)
    assert plan.state == RUNNING and plan.share == 25.0  # plenty of evidence, no decision
    current, candidate, _, _ = rollouts.evidence("digits", Tier.DEVICE)
    assert candidate.requests >= 20 and current.requests >= 20
    here[0] = True  # the lease came here: the next request decides on what was counted
    serve(rollouts, clock, candidate_unsure=True, count=1)
    assert rollouts.plan("digits", Tier.DEVICE).state == ROLLED_BACK


def audit_all(rollouts: Rollouts, clock: Clock, *, candidate_wrong_every: int, count: int) -> None:
    """``count`` requests on the rollout's tier, each arm's answer audited by the tier above:
    the current arm's always agree, every ``candidate_wrong_every``-th of the candidate's not
    (0: none)."""
    candidate_audits = 0
    for _ in range(count):
        drawn = rollouts.arm("digits", Tier.DEVICE)
        if drawn is None:
            return
        plan, to_candidate = drawn
        clock.now += 0.1
        rollouts.record(plan, candidate=to_candidate, ok=True, latency_ms=1.0, items=1, unsure=0)
        candidate_audits += 1 if to_candidate else 0
        wrong = to_candidate and candidate_wrong_every > 0 and candidate_audits % candidate_wrong_every == 0
        rollouts.record_audit(plan, candidate=to_candidate, agreed=not wrong)


def test_where_a_tier_above_audits_a_step_waits_for_each_arms_audits() -> None:
    clock = Clock()
    rollouts = Rollouts(router_id="a", rng=random.Random(3), clock=clock)
    rollouts.auditable = lambda family, tier: (family, tier) == ("digits", Tier.DEVICE)
    rollouts.start("digits", Tier.DEVICE, "digits-small-v2", steps=(50, 100), min_requests=20, min_audits=40)
    serve(rollouts, clock, candidate_unsure=False, count=200)  # requests enough, no audit yet
    assert rollouts.plan("digits", Tier.DEVICE).state == RUNNING
    audit_all(rollouts, clock, candidate_wrong_every=0, count=100)  # 40 each: too few to tell
    assert rollouts.plan("digits", Tier.DEVICE).state == RUNNING
    audit_all(rollouts, clock, candidate_wrong_every=0, count=400)
    plan = rollouts.plan("digits", Tier.DEVICE)
    assert plan.state == COMPLETE, plan.reason
    found = re.search(r"agreement 100\.0% vs 100\.0% with the top tier over (\d+)/(\d+) audits \(within 1\.0%\)$", plan.reason)
    assert found, plan.reason
    # all agreeing, an arm needs 117 audits before 1.645 x sqrt(2 x 0.25 / n) / n is under 1%
    assert min(int(found[1]), int(found[2])) >= 117, plan.reason


def test_a_candidate_wrong_and_sure_is_rolled_back_on_its_agreement() -> None:
    clock = Clock()
    rollouts = Rollouts(router_id="a", rng=random.Random(4), clock=clock)
    rollouts.auditable = lambda family, tier: True
    rollouts.start("digits", Tier.DEVICE, "digits-small-bad", steps=(50, 100), min_requests=20, min_audits=40)
    audit_all(rollouts, clock, candidate_wrong_every=5, count=400)  # no more errors, tail or unsure
    plan = rollouts.plan("digits", Tier.DEVICE)
    assert plan.state == ROLLED_BACK, plan.reason
    assert re.match(r"rolled back at 50%: agreement 8\d\.\d% vs 100\.0% with the top tier", plan.reason), plan.reason


def test_without_a_tier_above_requests_alone_decide_and_stale_audits_are_ignored() -> None:
    clock = Clock()
    rollouts = Rollouts(router_id="a", rng=random.Random(5), clock=clock)  # nothing is auditable
    first = rollouts.start("digits", Tier.DEVICE, "digits-small-v2", steps=(50, 100), min_requests=20)
    serve(rollouts, clock, candidate_unsure=False, count=100)
    plan = rollouts.plan("digits", Tier.DEVICE)
    assert plan.state == COMPLETE and "agreement" not in plan.reason, plan.reason
    clock.now += 1.0
    for _ in range(100):  # audits of the first step's plan, arriving after it advanced
        rollouts.record_audit(first, candidate=True, agreed=False)
    assert rollouts.plan("digits", Tier.DEVICE) == plan


def test_operators_promote_and_abort_and_cannot_start_twice() -> None:
    rollouts = Rollouts(router_id="a")
    rollouts.start("digits", Tier.EDGE, "digits-medium-v2")
    with pytest.raises(Conflict, match="is running; promote or abort it first"):
        rollouts.start("digits", Tier.EDGE, "digits-medium-v3")
    assert rollouts.promote("digits", Tier.EDGE).share == 100.0
    assert rollouts.plan("digits", Tier.EDGE).state == PROMOTED
    aborted = rollouts.abort("digits", Tier.EDGE)
    assert (aborted.state, aborted.share) == (ABORTED, 0.0)
    with pytest.raises(InvalidInput, match="already aborted"):
        rollouts.abort("digits", Tier.EDGE)
    restarted = rollouts.start("digits", Tier.EDGE, "digits-medium-v3")
    assert restarted.state == RUNNING and restarted.revision > aborted.revision
    assert restarted.history == ("started by an operator at 5%",)
    with pytest.raises(NotFound, match="no rollout on the device tier"):
        rollouts.abort("digits", Tier.DEVICE)
