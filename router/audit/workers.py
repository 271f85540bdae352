"""The auditor's background: a bounded queue of audits and the workers that ask the top tier.

An audit never displaces client traffic: it waits in a bounded queue (the oldest is dropped
when it is full), one of ``workers`` background tasks takes it, and it is sent only while the
top tier has spare capacity: the cloud under ``cloud_spare`` of its links' capacity busy, or a
top-tier agent with a free slot. Otherwise it is dropped (and counted). What it learns goes
to the agreement book, the rows a threshold suggestion is chosen on, a rollout's judge and
``--capture``. :class:`~router.audit.auditor.Auditor` samples the answers that become audits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from router.audit.agreement import AgreementBook, AuditKey
from router.audit.climbs import CascadeView, text_row
from router.audit.rows import RowBook
from router.audit.sampling import COMPARATORS, Audit, AuditPolicy, Reference, WholeAnswer, same_text
from router.backends.base import Backend, Classified
from router.backends.cloud import gateway_backends
from router.cascade.generate import Generation
from router.cloud.pool import CloudTier
from router.fleet.registry import FleetRegistry
from router.policy import Target, spare
from stratus.convert.tensors import Tensors, top1
from stratus.errors import StratusError
from stratus.families.suggest import TierAnswer
from stratus.obs.metrics import RouterMetrics
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

if TYPE_CHECKING:
    from router.rollout.plan import Plan

log = logging.getLogger("stratus.audit")

AGREED: Final = "agreed"
DISAGREED: Final = "disagreed"
DROPPED: Final = "dropped"


class RolloutEvidence(Protocol):
    """Where an audited answer of a rollout's arm goes (router.rollout.plans.Rollouts): the step's
    judge weighs each arm's agreement with the top tier."""

    def record_audit(self, plan: Plan, *, candidate: bool, agreed: bool) -> None: ...


class Capture(Protocol):
    """Where audited and escalated items go under ``--capture`` (router/audit/capture.py's
    CaptureHook; a protocol here, so that the auditor does not import what imports it)."""

    def wants(self, family: str) -> bool: ...
    def audited(self, audit: Audit, reference: Reference) -> None: ...
    def audited_text(self, audit: Audit, reference: Reference) -> None: ...
    def escalated(self, view: CascadeView, top: Tier, output: str) -> None: ...
    def escalated_text(
        self, family: str, prompt: pb.ModelInferRequest, result: Generation, climbed: Sequence[Generation]
    ) -> None: ...


class Outlets(Protocol):
    """Where an audit's outcome goes besides the books (the Auditor, whose owner sets them)."""

    @property
    def capture(self) -> Capture | None: ...

    @property
    def rollouts(self) -> RolloutEvidence | None: ...


@dataclass
class AuditWorkers:
    """The queue of audits waiting, and the tasks that ask the top tier for them."""

    registry: FleetRegistry
    cloud: CloudTier | None
    policy: AuditPolicy
    book: AgreementBook  # each audited answer's agreement with the top tier
    rows: RowBook  # what a threshold suggestion is chosen on
    rng: random.Random
    clock: Callable[[], float]
    outlets: Outlets  # where an outcome goes besides the books: the auditor's capture and rollouts
    metrics: RouterMetrics | None = None
    dropped: int = 0  # items of audits dropped, ever
    waiting: deque[Audit] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._ids = itertools.count(1)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._work(), name=f"stratus-audit-{i}") for i in range(self.policy.workers)
        ]

    async def close(self) -> None:
        """Cancel the workers (an audit in flight is abandoned) and wait for them."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.waiting.clear()

    def below(self, family: str, top: Tier) -> list[Tier]:
        """The tiers below ``top`` with an agent of ``family`` listed."""
        return sorted(t for t in self.registry.index.tiers(family) if t < top)

    def enqueue(self, audit: Audit) -> None:
        if len(self.waiting) >= self.policy.queue_limit:
            self._drop(self.waiting.popleft(), "the audit queue is full")
        self.waiting.append(audit)
        self._wakeup.set()

    async def _next(self) -> Audit:
        while not self.waiting:
            self._wakeup.clear()
            await self._wakeup.wait()
        return self.waiting.popleft()

    async def _work(self) -> None:
        while True:
            audit = await self._next()
            if self.clock() - audit.queued_at > self.policy.max_wait_s:
                self._drop(audit, "it waited too long")
                continue
            if audit.reference_text is not None:  # a row's job: the top tier has answered already
                job = self._text_row(audit, audit.reference_text)
            elif (target := self._spare(audit)) is not None:
                job = self._audit(audit, target)
            else:
                self._drop(audit, f"the {audit.top.label} tier has no spare capacity")
                continue
            try:
                await job
            except StratusError as exc:
                self._drop(audit, f"the {audit.top.label} tier failed it: {exc}")
            except Exception:  # a bug: said, and the worker outlives it
                log.exception("an audit of %s failed", audit.key.family)
                self._drop(audit, "an unexpected error")

    def _spare(self, audit: Audit) -> Target[Backend] | None:
        """Where the audit may go now without taking room from client work; None: nowhere."""
        if audit.top is Tier.CLOUD:
            gateways = gateway_backends(self.cloud, audit.key.family)
            return _target(Tier.CLOUD, spare(gateways, self.rng, share=self.policy.cloud_spare))
        return self._spare_agent(audit.key.family, audit.top)

    def _spare_agent(self, family: str, tier: Tier) -> Target[Backend] | None:
        """An agent of ``tier`` serving ``family`` with a free slot (the policy's spare choice)."""
        return _target(tier, spare(self.registry.index.pools(family).get(tier, ()), self.rng))

    async def _audit(self, audit: Audit, target: Target[Backend]) -> None:
        capture = self.outlets.capture if self.outlets.capture is not None and self.outlets.capture.wants(audit.key.family) else None
        if audit.inputs is not None:
            reference = await self._classes(audit, target)
            if reference is None or len(reference.classes) != audit.items:
                self._drop(audit, "the top tier's answer holds no classes to compare")
                return
            for mine, theirs in zip(audit.classes, reference.classes, strict=True):
                self._record(audit.key, mine == theirs)
                if audit.arm is not None and self.outlets.rollouts is not None:
                    self.outlets.rollouts.record_audit(audit.arm.plan, candidate=audit.arm.candidate, agreed=mine == theirs)
            if capture is not None:
                capture.audited(audit, reference)
            visited = await self._asked_between(audit)
            for lower, theirs in zip(visited, reference.classes, strict=False):
                self.rows.add(audit.key.family, lower, audit.top, int(theirs))
            return
        reference = await self._text(audit, target)
        self._record(audit.key, COMPARATORS.get(audit.compare, same_text)(audit.text, reference.text))
        if capture is not None:
            capture.audited_text(audit, reference)
        await self._text_row(audit, reference.text)

    async def _text_row(self, audit: Audit, top_text: str) -> None:
        """Keep a prompt's row, asking each tier below the top its climb lacks (on spare
        capacity only: none free, no row)."""
        below = self.below(audit.key.family, audit.top)
        if not below:
            return
        same = COMPARATORS.get(audit.compare, same_text)
        row = await text_row(audit.said, below, top_text, same=same, ask=lambda tier: self._said(audit, tier))
        if row is not None:
            self.rows.add(audit.key.family, row, audit.top, 0)

    async def _said(self, audit: Audit, tier: Tier) -> WholeAnswer | None:
        """``tier``'s whole answer to the audit's prompt, from an agent with a free slot."""
        target = self._spare_agent(audit.key.family, tier)
        if target is None or audit.prompt is None:
            return None
        parts: list[str] = []
        try:
            generated = await target.candidate.generate(
                audit.prompt, lambda chunk: parts.append(chunk.text), budget_ms=self.policy.timeout_s * 1000
            )
        except StratusError as exc:
            log.debug("audit row of %s: the %s tier failed it: %s", audit.key.family, tier.label, exc)
            return None
        confidence = math.nan if generated.confidence is None else generated.confidence
        return WholeAnswer(tier, confidence, "".join(parts))

    async def _asked_between(self, audit: Audit) -> tuple[tuple[TierAnswer, ...], ...]:
        """The items' visits with each tier between theirs and the top asked too (only where an
        agent there has a free slot): a row needs every tier below the top. Nothing where one
        cannot be asked (the agreement is kept; the rows are not)."""
        family, visited = audit.key.family, list(audit.visited)
        for tier in (t for t in self.registry.index.tiers(family) if audit.key.tier < t < audit.top):
            target = self._spare_agent(family, tier)
            if target is None or audit.inputs is None:
                return ()
            try:
                part = await self._ask(target, audit, audit.inputs)
            except StratusError as exc:
                log.debug("audit row of %s: the %s tier failed it: %s", family, tier.label, exc)
                return ()
            classes = top1(part.outputs, audit.output)
            if classes is None or len(classes) != len(visited) or len(part.confidences) != len(visited):
                return ()
            visited = [
                (*v, TierAnswer(tier, float(c), int(k)))
                for v, c, k in zip(visited, part.confidences, classes, strict=True)
            ]
        return tuple(visited)

    async def _ask(self, target: Target[Backend], audit: Audit, inputs: Tensors) -> Classified:
        return await target.candidate.classify(
            inputs,
            model=audit.key.family,
            outputs=(audit.output,),
            request_id=f"audit-{next(self._ids)}",
            budget_ms=self.policy.timeout_s * 1000,
        )

    async def _classes(self, audit: Audit, target: Target[Backend]) -> Reference | None:
        assert audit.inputs is not None
        answered = await self._ask(target, audit, audit.inputs)
        classes = top1(answered.outputs, audit.output)
        if classes is None:
            return None
        said = answered.confidences if answered.said_confidence else (math.nan,) * len(classes)
        return Reference(
            variant=answered.variant,
            agent=answered.agent,
            confidences=said,
            classes=tuple(int(c) for c in classes),
        )

    async def _text(self, audit: Audit, target: Target[Backend]) -> Reference:
        assert audit.prompt is not None
        parts: list[str] = []
        generated = await target.candidate.generate(
            audit.prompt, lambda chunk: parts.append(chunk.text), budget_ms=self.policy.timeout_s * 1000
        )
        confidence = math.nan if generated.confidence is None else generated.confidence
        return Reference(
            variant=generated.variant, agent=generated.agent, confidences=(confidence,), text="".join(parts)
        )

    def _record(self, key: AuditKey, agreed: bool) -> None:
        self.book.add(key, agreed)
        if self.metrics is not None:
            self.metrics.audits.labels(key.family, key.tier.label, AGREED if agreed else DISAGREED).inc()

    def _drop(self, audit: Audit, why: str) -> None:
        if audit.reference_text is not None:  # a row's job, not an audit: nothing to count
            log.debug("an audit row of %s was not kept: %s", audit.key.family, why)
            return
        self.dropped += audit.items
        log.debug("audit of %s (%s) dropped: %s", audit.key.family, audit.key.agent, why)
        if self.metrics is not None:
            self.metrics.audits.labels(audit.key.family, audit.key.tier.label, DROPPED).inc(audit.items)


def _target(tier: Tier, chosen: Backend | None) -> Target[Backend] | None:
    return Target(tier=tier, candidate=chosen) if chosen is not None else None
