"""Each cloud gateway as a backend: candidates for the policy on ``Tier.CLOUD``, as agents are
on theirs.

The cloud is one gateway or a pool of them (:mod:`router.cloud.pool`). Each gateway's link is
one target, chosen by the same rules as an agent (:func:`router.policy.two_choices`: the less
busy of two, within the budget), and a gateway that fails a request is excluded from its
climb, which then tries another gateway or degrades (:mod:`router.policy.climb`); audits and
the offline judge take the spare one (:func:`router.policy.spare`). A gateway is ready while
its link takes calls; it has no queue limit of its own (it refuses for itself when full), and
the tier's moving round trip is the whole of its predicted latency (see :attr:`CloudBackend.rtt_ms`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

from router.backends.base import Classified, Generated, OnChunk
from router.cloud.link import CloudLink
from router.cloud.pool import CloudTier
from stratus.convert.parameters import (
    COMPUTE_MS,
    COMPUTE_PRECISION,
    CONFIDENCE,
    PRECISION,
    QUEUE_MS,
    VARIANT,
    parameter_value,
    reported_ms,
    values_of,
)
from stratus.convert.tensors import MAX_REQUEST_ITEMS, Tensors
from stratus.errors import Unavailable
from stratus.families.generation import Chunk
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

# One backend per gateway for as long as its link lives: a snapshot per request builds none.
_BACKENDS: weakref.WeakKeyDictionary[CloudLink, CloudBackend] = weakref.WeakKeyDictionary()


def gateway_backends(cloud: CloudTier | None, model: str) -> tuple[CloudBackend, ...]:
    """The cloud's gateways as backends: those whose link has learnt that it serves ``model``
    (up or down: one down is listed, not ready)."""
    if cloud is None:
        return ()
    return tuple(_backend(link, cloud) for link in cloud.gateways() if link.models.get(model, False))


def _backend(link: CloudLink, tier: CloudTier) -> CloudBackend:
    backend = _BACKENDS.get(link)
    if backend is None:
        backend = _BACKENDS[link] = CloudBackend(link, tier)
    return backend


class CloudBackend:
    """One cloud gateway's link, as the policy and the cascades see every target."""

    def __init__(self, link: CloudLink, pool: CloudTier) -> None:
        self.link = link
        self.pool = pool  # the cloud tier it is one gateway of

    @property
    def id(self) -> str:
        return f"cloud@{self.link.address}"

    @property
    def tier(self) -> Tier:
        return Tier.CLOUD

    @property
    def ready(self) -> bool:
        return self.link.available

    @property
    def in_flight(self) -> int:
        return self.link.in_flight

    @property
    def capacity(self) -> int:
        return max(1, self.link.capacity)  # calls its link may hold at once

    @property
    def limit(self) -> int:
        return 0

    @property
    def rtt_ms(self) -> float:
        """The tier's moving round trip, the gateway's run included: all the policy predicts.

        The tier's, not this gateway's: a gateway's own estimate is refreshed only by the calls
        it is chosen for, so one slow moment made it look slow for good, and the policy, which
        breaks ties in load by the prediction, never chose it again (at one call in flight,
        184 of 200 escalations to one of two gateways). Replicas are told apart by their
        load; the budget is held against the tier's round trip."""
        return self.pool.predicted_ms

    def max_batch(self, model: str) -> int:
        return MAX_REQUEST_ITEMS

    def cost_ms(self, model: str, items: int) -> float:
        return 0.0  # inside rtt_ms: the link measures whole round trips

    async def classify(
        self, items: Tensors, *, model: str, outputs: Sequence[str], request_id: str, budget_ms: float
    ) -> Classified:
        request = pb.ModelInferRequest(model_name=model, id=request_id)
        request.outputs.extend(pb.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in outputs)
        items.write_request(request)
        response = await self.link.infer(request, timeout_s=budget_ms / 1000.0)
        params = response.parameters
        said = CONFIDENCE in params
        confidence = parameter_value(params[CONFIDENCE]) if said else 1.0
        answered = Tensors.from_response(response)
        if answered.items != items.items:
            raise Unavailable(f"the cloud answered {answered.items} items for {items.items}")
        return Classified(
            agent=self.id,
            variant=_named(params, VARIANT, model),
            outputs=answered,
            confidences=(float(confidence or 0.0),) * items.items,
            said_confidence=said,
            precision=_named(params, PRECISION, ""),
            compute=_named(params, COMPUTE_PRECISION, ""),
            queue_ms=reported_ms(params, QUEUE_MS) or 0.0,  # a foreign cloud says neither
            compute_ms=reported_ms(params, COMPUTE_MS) or 0.0,
        )

    async def generate(self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, budget_ms: float) -> Generated:
        async def deliver(chunk: Chunk) -> None:
            on_chunk(chunk)

        response = await self.link.generate(request, deliver, timeout_s=budget_ms / 1000.0)
        params = response.parameters
        confidence = parameter_value(params[CONFIDENCE]) if CONFIDENCE in params else None
        return Generated(
            agent=self.id,
            variant=_named(params, VARIANT, request.model_name),
            said=values_of(params),
            confidence=float(confidence or 0.0) if confidence is not None else None,
            precision=_named(params, PRECISION, ""),
        )


def _named(params: Mapping[str, pb.InferParameter], key: str, default: str) -> str:
    """A string parameter of the cloud's answer, or ``default`` where it names none."""
    return str(parameter_value(params[key])) if key in params else default
