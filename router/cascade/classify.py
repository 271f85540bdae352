"""The classifier cascade: one request's climb through the tiers, item by item.

Every item starts on the lowest tier that fits. After each answer, the items whose own
confidence meets that tier's threshold are settled there; only the unsure ones climb, as a
smaller batch. The response holds every item's answer in the original order. Where to go
next and how the climb ends are :mod:`router.policy.climb`'s to decide; this module sends
the items (to an agent, the cloud, or a rollout's candidate) and builds the response.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

from router.backends.base import Backend
from router.cascade.common import Answer, CascadeContext, Job, allowed_ms, cloud_facts, dispatch
from router.cascade.gray import arm_of, record_arm, shadow
from router.cascade.unsure import kept_unsure
from router.fleet.index import line_key
from router.offline.decisions import Decision, Hop, answered_hop, decision_of, failed_hop, skipped_hops
from router.offline.provisional import cloud_was_needed
from router.policy import Attempt, FleetSnapshot, Target
from router.policy.climb import (
    Accept,
    ClimbState,
    Degrade,
    Dispatch,
    after_answer,
    after_failure,
    finish,
    next_action,
    retryable,
)
from stratus.convert.inference import InferResult
from stratus.convert.parameters import DECISION, Served, unanswered_reason
from stratus.convert.tensors import Tensors
from stratus.errors import DeadlineExceeded, Overloaded, StratusError, Unavailable
from stratus.families.confidence import settled
from stratus.tiers import Tier

log = logging.getLogger("stratus.router")


class ClassifyCascade:
    """Performs one classifier request's climb; :mod:`router.policy.climb` decides it."""

    def __init__(self, context: CascadeContext, job: Job) -> None:
        self.context = context
        self.job = job
        self.pending = list(range(job.inputs.items))
        self.best: dict[int, tuple[Answer, int]] = {}  # item -> (answer, its row there)
        self.answers: list[Answer] = []
        self.sent: list[list[int]] = []  # per answer, the items its rows answer (for audits)
        self.path: list[Tier] = []
        self.timings: dict[Tier, float] = {}
        self.queue_ms = 0.0  # summed over the answers kept, as each tier measured it
        self.compute_ms = 0.0
        self.state = ClimbState(min_tier=job.options.min_tier, max_tier=job.options.max_tier)
        self.degraded = False
        self.tier_label = "none"
        self.reason = ""  # why unsure items were answered where they were (stratus.reason)
        self.nowhere_higher = False  # ... because no tier above serves the family: degraded
        self.hops: list[Hop] = []  # each tier's part, for the decision record
        self.provisional = False  # its unsure items were kept for the cloud to judge
        self.request_id = job.id

    def remaining_ms(self) -> float:
        return self.job.budget_ms - self.elapsed_ms()

    def elapsed_ms(self) -> float:
        return (self.context.now() - self.job.started) * 1000.0

    async def run(self) -> InferResult:
        job = self.job
        thresholds = self.context.registry.thresholds(job.family)
        while (self.pending or not self.answers) and (remaining := self.remaining_ms()) > 0:
            snapshot = self.context.snapshot(job.model)
            attempt = self.state.attempt(job.model, remaining, max(1, len(self.pending)))
            action = next_action(
                self.state, attempt, snapshot, self.context.rng, pinned=job.pinned is not None
            )
            if not isinstance(action, Dispatch):
                break
            await self._step(action, attempt, snapshot, thresholds, remaining)
        unsure = f"{len(self.pending)} item(s) were still unsure" if self.pending else ""
        end = finish(
            self.state,
            answered=bool(self.answers),
            unsure=unsure,
            budget_ms=job.budget_ms,
            cloud=cloud_facts(self.context, job.model),
        )
        if isinstance(end, Accept):
            return self._explained(self._respond(degraded=self.nowhere_higher))
        if isinstance(end, Degrade):
            await self._defer()
            return self._explained(self._respond(degraded=True))
        raise end.error

    async def _defer(self) -> None:
        """Keep the unsure items for the cloud to judge when the climb stopped below a cloud
        that could not answer, where the family asks for it: the answer is then provisional."""
        offline = self.context.offline
        deferral = await offline.defer_unsure(self, self.context.cloud) if offline is not None else None
        if deferral is not None:
            self.request_id, self.provisional, self.reason = deferral

    def _explained(self, result: InferResult) -> InferResult:
        if self.job.options.explain:
            result.parameters[DECISION] = self.decision().to_json()
        return result

    def decision(self) -> Decision:
        """The request's decision record (router/offline/decisions.py)."""
        cloud = self.context.cloud
        held = cloud is not None and not self.context.escalates(self.job.model)
        away = cloud is not None and self.degraded and cloud_was_needed(cloud, self.job.model, self.state)
        return decision_of(
            self, cloud_held=held, cloud_away=f"the cloud is {cloud.status}" if away and cloud else ""
        )

    async def _step(
        self,
        action: Dispatch[Backend],
        attempt: Attempt,
        snapshot: FleetSnapshot[Backend],
        thresholds: Mapping[Tier, float],
        remaining: float,
    ) -> None:
        """Send the unsure items where the climb said (or to a rollout's arm on that tier)."""
        target, arm = action.target, None
        if self.job.pinned is None:  # the tiers with rollouts (never the cloud's) draw an arm
            target, arm = arm_of(self.context, self.job.family, target, attempt)
        if action.escalation is not None:
            step = action.escalation
            self.context.observer.escalated(self.job.label, step.left, step.to, step.reason)
        model = line_key(arm.plan.candidate) if arm is not None and arm.candidate else None
        items = len(self.pending)
        tried = [hop.tier for hop in self.hops]
        self.hops.extend(
            skipped_hops(snapshot.tiers, lowest=self.state.min_tier, before=target.tier, tried=tried)
        )
        answer = await self._try(target, remaining, model)
        if answer is None:
            if arm is not None:
                record_arm(self.context, arm, answer=None, accepted=(), items=items)
            return
        accepted = self._accepted(answer, snapshot, thresholds, final=action.final)
        if arm is not None:
            answer = dataclasses.replace(answer, arm=arm)  # its audits judge the arm too
            record_arm(self.context, arm, answer=answer, accepted=accepted, items=items)
            if not arm.candidate and self.context.rollouts.shadow_wanted(arm.plan):
                sent = self.job.inputs.take(self.pending)
                shadow(self.context, arm.plan, self.job, attempt=attempt, items=sent, answer=answer)
        self._record(answer, accepted)
        self.hops.append(answered_hop(answer.tier, target=answer.agent, variant=answer.variant,
                                      confidences=answer.confidences, accepted=accepted, thresholds=thresholds,
                                      ms=answer.elapsed_ms))  # fmt: skip
        after_answer(self.state, answer.tier)

    def _accepted(
        self,
        answer: Answer,
        snapshot: FleetSnapshot[Backend],
        thresholds: Mapping[Tier, float],
        *,
        final: bool,
    ) -> list[bool]:
        """Which items of ``answer`` stop climbing: each sure one, or all of a final answer
        (which says why it keeps any unsure ones: :mod:`router.cascade.unsure`)."""
        job = self.job
        if final and job.pinned is None and answer.tier < Tier.CLOUD:  # nothing is above the cloud
            kept = kept_unsure(self.context, job, answer, snapshot, thresholds)
            if kept is not None:
                self.reason = kept.reason
                self.nowhere_higher |= kept.nowhere_higher
        return settled(
            answer.confidences,
            answer.tier,
            final=final,
            thresholds=thresholds,
            min_confidence=job.options.min_confidence,
        )

    def _record(self, answer: Answer, accepted: Sequence[bool]) -> None:
        """Keep each sent item's newest answer; only the unsure items stay pending."""
        self.context.observer.tier_answered(
            self.job.label, answer.tier, answer.elapsed_ms, answer.confidences
        )
        self.answers.append(answer)
        self.sent.append(list(self.pending))
        self.path.append(answer.tier)
        self.timings[answer.tier] = self.timings.get(answer.tier, 0.0) + answer.elapsed_ms
        self.queue_ms += answer.queue_ms
        self.compute_ms += answer.compute_ms
        for row, item in enumerate(self.pending):
            self.best[item] = (answer, row)
        self.pending = [item for item, ok in zip(self.pending, accepted, strict=True) if not ok]

    async def _try(
        self, target: Target[Backend], remaining: float, model: str | None = None
    ) -> Answer | None:
        items = self.job.inputs.take(self.pending)
        started = self.context.now()
        try:
            return await dispatch(self.context, target, self.job, items, allowed_ms(remaining), model=model)
        except StratusError as exc:
            if not retryable(exc):
                raise
            ms = (self.context.now() - started) * 1000.0
            self.hops.append(failed_hop(target.tier, target=target.id, items=items.items, error=exc, ms=ms))
            log.info("%s failed for %r: %s", target.id, self.job.id[:64], exc)
            after_failure(self.state, target, exc)
            return None

    def _respond(self, *, degraded: bool) -> InferResult:
        job = self.job
        items = range(job.inputs.items)
        tiers = [self.best[i][0].tier for i in items]
        self.degraded = degraded
        self.tier_label = max(tiers, default=self.answers[-1].tier).label
        last = max(self.answers, key=lambda a: a.tier)
        if degraded:
            problem = self.state.problem
            reason = _STOPPED.get(type(problem), "no_higher_tier") if problem else "no_higher_tier"
            self.context.observer.degraded(job.label, reason)
            # a climb that stopped below the top found nowhere higher (kept_unsure said so) or met
            # a problem: a failure, or no target (router.policy.climb names one for that)
            self.reason = self.reason or unanswered_reason(len(self.pending), last.tier, str(problem))

        served = Served(
            tier=max(tiers, default=last.tier),
            agent=last.agent,
            variant=last.variant,
            precision=last.precision,
            compute=last.compute,
            confidence=min((self.best[i][0].confidences[self.best[i][1]] for i in items), default=1.0),
            path=self.path,
            degraded=degraded,
            timings_ms=self.timings,
            item_tiers=tiers,
            reason=self.reason,
            queue_ms=self.queue_ms,
            compute_ms=self.compute_ms,
            provisional=self.provisional,
            request_id=self.request_id,
        )
        return InferResult(
            model_name=job.asked_for,
            id=self.request_id,
            outputs=self._outputs(),
            raw=job.raw,
            parameters=served.values(),
        )

    def _outputs(self) -> Tensors:
        """Every item's row from the answer that settled it, in the request's order."""
        if len(self.answers) == 1:
            return self.answers[0].outputs
        runs: list[Tensors] = []
        start = 0
        count = self.job.inputs.items
        while start < count:  # consecutive items answered by consecutive rows of one answer
            answer, row = self.best[start]
            stop = start + 1
            while stop < count and self.best[stop][0] is answer and self.best[stop][1] == row + stop - start:
                stop += 1
            runs.append(answer.outputs.rows(row, row + stop - start))
            start = stop
        return Tensors.join(runs)


# Why a climb stopped below the tier an answer needed, as the degraded counter says it.
_STOPPED: dict[type[StratusError], str] = {
    Overloaded: "overloaded",
    DeadlineExceeded: "too_slow",
    Unavailable: "unavailable",
}
