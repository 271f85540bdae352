"""What a cascade keeps of a request it answers provisionally (pure: no I/O).

Each unsure item is kept with every answer it got on its way up, lowest tier first, each as
its top-1 class in the family's first output and its confidence: the last is the provisional
answer the client got, which the cloud's verdict is compared with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from router.cloud.pool import CloudTier
from router.policy.climb import ClimbState
from stratus.convert.tensors import Tensors, top1
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb


class AnswerRows(Protocol):
    """What is read of one tier's answer (router.cascade.classify.Answer)."""

    @property
    def tier(self) -> Tier: ...
    @property
    def agent(self) -> str: ...
    @property
    def variant(self) -> str: ...
    @property
    def outputs(self) -> Tensors: ...
    @property
    def confidences(self) -> tuple[float, ...]: ...


class UnsureJob(Protocol):
    """What deferral reads of the request (router.cascade.classify.Job)."""

    @property
    def id(self) -> str: ...
    @property
    def family(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def pinned(self) -> str | None: ...
    @property
    def inputs(self) -> Tensors: ...


class UnsureClimb(Protocol):
    """What deferral reads of a climb that ended with unsure items (the classifier cascade)."""

    @property
    def job(self) -> UnsureJob: ...
    @property
    def state(self) -> ClimbState: ...
    @property
    def answers(self) -> Sequence[AnswerRows]: ...
    @property
    def sent(self) -> Sequence[Sequence[int]]: ...
    @property
    def pending(self) -> Sequence[int]: ...
    @property
    def path(self) -> Sequence[Tier]: ...


def provisional_reason(
    cloud_status: str, items: int, tier: Tier, *, request_id: str, refused: str | None
) -> str:
    """``stratus.reason`` of an answer whose unsure items the cloud could not take."""
    why = f"the cloud could not answer ({cloud_status})"
    if refused is None:
        return (
            f"{why}: {items} item(s) below the {tier.label} threshold were answered provisionally; "
            f"the cloud judges them when it is back (corrections name request id {request_id!r})"
        )
    return f"{why}: {items} item(s) stayed below the {tier.label} threshold and were not kept for the cloud to judge ({refused})"


def cloud_was_needed(cloud: CloudTier | None, model: str, state: ClimbState) -> bool:
    """The climb stopped below a cloud that could have taken the items: one the router has,
    that the request allowed, that did not answer, and that serves the model (or whose models
    are not known yet: a router started while its cloud was away)."""
    if cloud is None or state.max_tier < Tier.CLOUD or Tier.CLOUD in state.answered:
        return False
    return bool(cloud.models.get(model)) or not cloud.models


def provisional_items(
    answers: Sequence[AnswerRows], sent: Sequence[Sequence[int]], unsure: Sequence[int], output: str
) -> list[fpb.DeferredItem]:
    """Per unsure item (in order), every answer it got, lowest tier first."""
    classes: list[np.ndarray | None] = [top1(answer.outputs, output) for answer in answers]
    kept = {item: fpb.DeferredItem(index=item) for item in unsure}
    for answer, items, labels in zip(answers, sent, classes, strict=True):
        for row, item in enumerate(items):
            deferred = kept.get(item)
            if deferred is None or labels is None:
                continue
            deferred.answers.append(fpb.ProvisionalAnswer(
                tier=answer.tier.label, variant=answer.variant, agent=answer.agent, label=int(labels[row]),
                confidence=float(answer.confidences[row]),
            ))  # fmt: skip
    return [kept[item] for item in unsure if kept[item].answers]
