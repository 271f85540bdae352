"""Gray release on the request path: under a rollout on a tier, a step's share of its items goes
to the candidate's agents (:func:`arm_of`), each arm's outcome is told to the plan
(:func:`record_arm`), and a shadow step mirrors items to the candidate and only compares
(:func:`shadow`). The plans themselves, and when a step advances, are :mod:`router.rollout`'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from router.backends.base import Backend
from router.cascade.common import DEFAULT_BUDGET_MS, Answer, Arm, CascadeContext, Job, dispatch
from router.fleet.index import line_key
from router.policy import Attempt, NoTarget, Target, choose
from router.rollout.judge import top1
from router.rollout.plan import Plan
from stratus.convert.tensors import Tensors
from stratus.errors import StratusError


def arm_of(
    context: CascadeContext, family: str, target: Target[Backend], attempt: Attempt
) -> tuple[Target[Backend], Arm | None]:
    """Under a rollout on the target's tier, the step's share goes to the candidate
    (on an agent that serves it); the rest, and any the candidate cannot take, stay."""
    drawn = context.rollouts.arm(family, target.tier)
    if drawn is None:
        return target, None
    plan, to_candidate = drawn
    if to_candidate:
        chosen = candidate_target(context, plan, attempt)
        if chosen is not None:
            return chosen, Arm(plan=plan, candidate=True)
    return target, Arm(plan=plan, candidate=False)


def candidate_target(context: CascadeContext, plan: Plan, attempt: Attempt) -> Target[Backend] | None:
    """An agent of the rollout's tier that serves its candidate and can take the items."""
    key = line_key(plan.candidate)
    narrowed = dataclasses.replace(attempt, model=key, min_tier=plan.tier, max_tier=plan.tier, above=None)
    target = choose(narrowed, context.snapshot(key), context.rng)
    return None if isinstance(target, NoTarget) else target


def record_arm(
    context: CascadeContext, arm: Arm, *, answer: Answer | None, accepted: Sequence[bool], items: int
) -> None:
    latency = answer.elapsed_ms if answer is not None else 0.0
    unsure = sum(1 for ok in accepted if not ok)
    plan = arm.plan
    context.rollouts.record(
        plan, candidate=arm.candidate, ok=answer is not None, latency_ms=latency, items=items, unsure=unsure
    )
    context.observer.rollout_request(plan.family, plan.tier, candidate=arm.candidate, ok=answer is not None)


def shadow(
    context: CascadeContext, plan: Plan, job: Job, *, attempt: Attempt, items: Tensors, answer: Answer
) -> None:
    """Mirror items the current variant answered to the candidate, in the background;
    its answers are only compared (top-1 agreement), never returned."""
    target = candidate_target(context, plan, attempt)
    if target is None:
        return

    async def mirror() -> None:
        try:
            budget_ms = attempt.remaining_ms or DEFAULT_BUDGET_MS
            mirrored = await dispatch(context, target, job, items, budget_ms, model=line_key(plan.candidate))
        except StratusError:
            return
        mine, theirs = top1(answer.outputs), top1(mirrored.outputs)
        if mine is not None and theirs is not None and mine.shape == theirs.shape:
            context.rollouts.record_shadow(plan, int((mine == theirs).sum()), len(mine))

    context.background(mirror)
