"""Audits: a random share of the answers settled below a family's top tier, asked of it too.

A tier's confidence threshold was chosen for an accuracy on the calibration split; nothing on
the request path says whether it still holds (a dirty lens, a shifted input, a bad model file).
So the router samples items that settled below the family's top tier *by their own confidence*
(each with probability ``share``, at most ``max_per_s`` a second per family), asks the top tier
the same question in the background, and compares the two answers: top-1 class for a
classifier; the text for a generative family (exactly, stripped, or as numbers). Each outcome
lands in an :class:`~router.audit.agreement.AgreementBook` keyed by (family, tier, variant, agent).

An audit never delays the client (the answer has gone back before it is queued) and never
displaces client traffic: it waits in a bounded queue (the oldest is dropped when it is full),
one of ``workers`` background tasks takes it, and it is sent only while the top tier has spare
capacity: the cloud under ``cloud_spare`` of its links' capacity busy, or a top-tier agent with
a free slot. Otherwise it is dropped (and counted): audits are the first thing load sheds.
That background is :mod:`router.audit.workers`; this module chooses what it audits.

Escalated items give a second sample for free: an unsure item that climbed to the top tier
anyway carries both answers. That sample is biased (unsure items only) and is kept in a book
of its own, reported beside the unbiased estimate, never mixed into it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from router.audit.agreement import AgreementBook, AuditKey
from router.audit.climbs import CascadeView, agreement_row, item_visits, tiers_missing, whole_answers
from router.audit.rows import RowBook
from router.audit.sampling import (
    COMPARATORS,
    Audit,
    AuditPolicy,
    Sampler,
    WholeAnswer,
    same_text,
)
from router.audit.workers import AuditWorkers, Capture, RolloutEvidence
from router.cascade.generate import Generation
from router.cloud.pool import CloudTier
from router.fleet.registry import FleetRegistry
from stratus.convert.tensors import top1
from stratus.families.audit import EXACT
from stratus.families.confidence import accepts
from stratus.families.description import FamilyDescription
from stratus.families.suggest import TierAnswer
from stratus.obs.metrics import RouterMetrics
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

if TYPE_CHECKING:
    from router.cascade.common import Answer, Arm

# While a rollout's step is judged, every settled answer of either arm may be audited (within
# the family's rate, each arm on its own budget): the judge waits for each arm's audits, and
# the candidate may hold 5% of the traffic.
ROLLOUT_SHARE: Final = 1.0


@dataclass
class Auditor:
    """Samples settled answers, audits them in the background, keeps the agreement books."""

    registry: FleetRegistry
    cloud: CloudTier | None
    policy: AuditPolicy = field(default_factory=AuditPolicy)
    metrics: RouterMetrics | None = None
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    capture: Capture | None = None  # --capture: audited and escalated items kept as Parquet
    rollouts: RolloutEvidence | None = None  # told of each audited answer of a rollout's arm

    def __post_init__(self) -> None:
        self.book = self._new_book()  # the unbiased estimate
        self.escalated = self._new_book()  # the biased sample escalations carry, kept apart
        self.sampler = Sampler(rng=self.rng, clock=self.clock)
        self.rows = RowBook(clock=self.clock)  # what a threshold suggestion is chosen on
        self._climbed = Sampler(rng=self.rng, clock=self.clock)  # rows of items that climbed anyway
        self.workers = AuditWorkers(
            self.registry,
            self.cloud,
            self.policy,
            self.book,
            self.rows,
            self.rng,
            self.clock,
            self,
            metrics=self.metrics,
        )

    def _new_book(self) -> AgreementBook:
        policy = self.policy
        return AgreementBook(max_audits=policy.window_audits, max_age_s=policy.window_s, clock=self.clock)

    # -- life --------------------------------------------------------------------------------
    def start(self) -> None:
        self.workers.start()

    async def close(self) -> None:
        await self.workers.close()

    @property
    def queued(self) -> int:
        return len(self.workers.waiting)

    @property
    def dropped(self) -> int:
        """Items of audits dropped, ever."""
        return self.workers.dropped

    @dropped.setter
    def dropped(self, items: int) -> None:
        self.workers.dropped = items

    # -- what a family asks for ------------------------------------------------------------------
    def top_of(self, family: str) -> Tier | None:
        """The tier audits ask: the cloud where it serves the family (and the family lets its
        inputs leave the site), else its highest agent tier."""
        info = self.registry.family(family)
        escalates = info is None or info.escalate
        if self.cloud is not None and self.cloud.models.get(family, False) and escalates:
            return Tier.CLOUD
        tiers = self.registry.index.tiers(family)
        return max(tiers) if tiers else None

    def calibrated_lines(self, info: FamilyDescription) -> dict[Tier, float]:
        """Each tier's calibrated agreement, where it was measured against the tier audits ask
        now: a fleet without the cloud audits against the edge, which calibration did not."""
        top = calibrated_top(info)
        if top is None or top != self.top_of(info.name):
            return {}
        return {
            tier: figures.agreement for tier, figures in info.tier_accuracy.items() if figures.agreement is not None
        }

    def share_of(self, info: FamilyDescription) -> float:
        return info.audit.share if info.audit.share is not None else self.policy.share

    def rate_of(self, info: FamilyDescription) -> float:
        return info.audit.max_per_s if info.audit.max_per_s is not None else self.policy.max_per_s

    # -- offered by the cascades, after the client's answer is built -----------------------------
    def classified(self, view: CascadeView) -> None:
        """Sample the items of a classifier request that settled below the top tier."""
        family = view.job.family
        info = self.registry.family(family)
        top = self.top_of(family)
        if info is None or info.generative or not info.outputs or top is None:
            return
        if len(view.answers) == 1 and view.answers[0].tier >= top:
            return  # answered on the top tier at once: no climb to note, nothing below it to audit
        output = info.outputs[0].name
        climbed = len(view.answers) > 1
        visited = item_visits(view, output) if climbed else {}
        if climbed:
            self._note_climbs(view, top, output)
            self._climbed_rows(view, info, top, visited)
            if self.capture is not None and self.capture.wants(family):
                self.capture.escalated(view, top, output)
        chosen = self._sampled_items(view, info, top, output)
        if chosen and not climbed:
            visited = item_visits(view, output)
        for answer, pairs in chosen.values():
            classes = top1(answer.outputs, output)
            if classes is None:
                continue
            self.workers.enqueue(
                Audit(
                    key=AuditKey(family, answer.tier, answer.variant, answer.agent),
                    top=top,
                    queued_at=self.clock(),
                    inputs=view.job.inputs.take([item for item, _ in pairs]),
                    output=output,
                    classes=tuple(int(classes[row]) for _, row in pairs),
                    visited=tuple(visited.get(item, ()) for item, _ in pairs),
                    confidences=tuple(answer.confidences[row] for _, row in pairs),
                    request_id=view.job.id,
                    arm=answer.arm,
                )
            )

    def _climbed_rows(
        self, view: CascadeView, info: FamilyDescription, top: Tier, visited: dict[int, tuple[TierAnswer, ...]]
    ) -> None:
        """Rows of the items that climbed to the top tier, drawn with the audits' share: they
        carry every answer already, so they cost nothing, and without them the rows would hold
        only the items the thresholds settled (a biased sample of the traffic)."""
        share, rate = self.share_of(info), self.rate_of(info)
        for _, answers in sorted(visited.items()):
            lower = tuple(a for a in answers if a.tier < top)
            final = next((a for a in answers if a.tier == top), None)
            if final is not None and lower and self._climbed.draw(info.name, share, rate):
                self.rows.add(view.job.family, lower, top, final.answer)

    def _sampled_items(
        self, view: CascadeView, info: FamilyDescription, top: Tier, output: str
    ) -> dict[int, tuple[Answer, list[tuple[int, int]]]]:
        """(item, row) pairs drawn for audit, grouped by the answer that settled them."""
        thresholds = self.registry.thresholds(info.name)
        share, rate = self.share_of(info), self.rate_of(info)
        chosen: dict[int, tuple[Answer, list[tuple[int, int]]]] = {}
        if share <= 0.0 and not any(_judged_arm(a) for a, _ in view.best.values()):
            return chosen
        for item, (answer, row) in sorted(view.best.items()):
            own = accepts(answer.confidences[row], answer.tier, thresholds=thresholds, min_confidence=None)
            if answer.tier >= top or not own or output not in answer.outputs.names():
                continue
            if self.sampler.draw(*_drawn_as(info.name, answer, share), rate):
                chosen.setdefault(id(answer), (answer, []))[1].append((item, row))
        return chosen

    def _note_climbs(self, view: CascadeView, top: Tier, output: str) -> None:
        """The free, biased sample: an unsure item's lower answer against the top tier's."""
        classes: dict[int, np.ndarray[Any, Any] | None] = {}

        def of(answer: Answer) -> np.ndarray[Any, Any] | None:
            if id(answer) not in classes:
                classes[id(answer)] = top1(answer.outputs, output)
            return classes[id(answer)]

        for answer, items in zip(view.answers, view.sent, strict=False):
            for row, item in enumerate(items):
                final, final_row = view.best[item]
                if answer.tier >= top or final is answer or final.tier != top:
                    continue
                mine, theirs = of(answer), of(final)
                if mine is not None and theirs is not None:
                    key = AuditKey(view.job.family, answer.tier, answer.variant, answer.agent)
                    self.escalated.add(key, bool(mine[row] == theirs[final_row]))

    def generated(
        self,
        info: FamilyDescription,
        prompt: pb.ModelInferRequest,
        result: Generation,
        climbed: Sequence[Generation],
    ) -> None:
        """Sample a generative answer settled below the top tier (and note the climbs); draw
        rows from the rest with the same share, as for a classifier."""
        top = self.top_of(info.name)
        compare = info.audit.compare or EXACT
        if top is None or result.degraded:
            return
        said = whole_answers(result, climbed, top)
        if result.tier == top:
            self._note_generated_climbs(info.name, result, climbed, COMPARATORS.get(compare, same_text))
            if self.capture is not None and self.capture.wants(info.name):
                self.capture.escalated_text(info.name, prompt, result, climbed)
            if self._climbed.draw(info.name, self.share_of(info), self.rate_of(info)):
                self._climbed_text_row(info, top, prompt, said, text=result.text, compare=compare)
            return
        threshold = info.thresholds.get(result.tier)
        own = threshold is None or result.confidence >= threshold
        if own and self.sampler.draw(info.name, self.share_of(info), self.rate_of(info)):
            self.workers.enqueue(
                Audit(key=_key(info.name, result), top=top, queued_at=self.clock(), prompt=_asked(prompt, info.name),
                      text=result.text, compare=compare, confidences=(result.confidence,), said=said,
                      request_id=prompt.id)
            )  # fmt: skip

    def _climbed_text_row(
        self,
        info: FamilyDescription,
        top: Tier,
        prompt: pb.ModelInferRequest,
        said: tuple[WholeAnswer, ...],
        *,
        text: str,
        compare: str,
    ) -> None:
        """The row of a prompt that climbed to the top: at once when its climb holds every
        tier's whole answer, else a job that asks the missing tiers (with its own copy of the
        prompt, as an audit has)."""
        below = self.workers.below(info.name, top)
        if not below:  # no tier below the top serves it now: a row would hold nothing
            return
        if not tiers_missing(said, below):
            self.rows.add(info.name, agreement_row(said, text, COMPARATORS.get(compare, same_text)), top, 0)
            return
        key = AuditKey(info.name, top, "", "")
        job = Audit(key=key, top=top, queued_at=self.clock(), prompt=_asked(prompt, info.name), compare=compare,
                    said=said, reference_text=text, request_id=prompt.id)  # fmt: skip
        self.workers.enqueue(job)

    def _note_generated_climbs(
        self, family: str, result: Generation, climbed: Sequence[Generation], same: Callable[[str, str], bool]
    ) -> None:
        """The biased sample: each whole unsure answer that climbed, against the top tier's."""
        for lower in climbed:
            if lower.tier < result.tier and lower.finish_reason != "cancelled":
                self.escalated.add(_key(family, lower), same(lower.text, result.text))

def _drawn_as(family: str, answer: Answer, share: float) -> tuple[str, float]:
    """The sampler's bucket and share for one settled answer: the family's own, or, for an
    answer of a rollout's arm, that arm's bucket at ROLLOUT_SHARE (so the current arm's 95%
    of the traffic cannot spend the candidate's audits)."""
    arm = _judged_arm(answer)
    if arm is None:  # no rollout, or one complete or promoted: as any answer
        return family, share
    return f"{family}\0rollout:{'candidate' if arm.candidate else 'current'}", ROLLOUT_SHARE


def _judged_arm(answer: Answer) -> Arm | None:
    """The rollout arm the answer was given for, where that rollout's step is still judged."""
    return answer.arm if answer.arm is not None and answer.arm.plan.judging else None


def calibrated_top(info: FamilyDescription) -> Tier | None:
    """The top tier the family's figures were calibrated against: the highest one they list."""
    return max(info.tier_accuracy, default=None)


def _asked(prompt: pb.ModelInferRequest, family: str) -> pb.ModelInferRequest:
    """The prompt as the top tier is asked it: under the family's name (not a pinned variant's)."""
    asked = pb.ModelInferRequest()
    asked.CopyFrom(prompt)
    asked.model_name = family
    return asked


def _key(family: str, answer: Generation) -> AuditKey:
    return AuditKey(family, answer.tier, answer.variant, answer.agent)
