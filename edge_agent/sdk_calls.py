"""One SDK call and what comes back: the call checked (model, variant, inputs, options,
budget), the local answer and the items it leaves unsure, the escalation of those items, and
the result, the router's answers merged among the local ones, or why no router answered."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from edge_agent.sdk_routers import Metadata, Routers, status_of
from stratus.convert import codec
from stratus.convert.parameters import RequestOptions, Served, unanswered_reason
from stratus.datatypes import Array
from stratus.errors import Unavailable
from stratus.families.confidence import threshold_for
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc


@dataclass(frozen=True, kw_only=True)
class InferResult:
    """One answer: ``outputs`` by name, ``confidence`` (the least sure item's), ``tier`` (the
    highest tier that answered an item), ``path`` (the tiers tried, in order), ``item_tiers``
    (the tier of each item), ``degraded`` (an unsure item came back from the device because
    no router answered), and the ``variant`` and ``agent`` of the highest tier's answer."""

    outputs: dict[str, Array]
    confidence: float
    tier: Tier
    path: tuple[Tier, ...]
    timings_ms: dict[Tier, float] = field(default_factory=dict)
    degraded: bool = False
    variant: str = ""
    agent: str = ""
    item_tiers: tuple[Tier, ...] = ()  # the tier that answered each item, in order
    reason: str = ""  # why unsure items stayed where they were answered (stratus.reason)


@dataclass(frozen=True, kw_only=True)
class LocalRun:
    """The local variant's answer to a call, item by item, and the items it leaves unsure."""

    family: FamilySpec
    variant: VariantSpec
    inputs: dict[str, Array]
    outputs: dict[str, Array]
    confidences: Array  # one per item
    ms: float
    pushed: float | None = None  # the router's threshold for this tier, where it said one

    @property
    def confidence(self) -> float:
        return float(self.confidences.min()) if self.confidences.size else 1.0

    def unsure(self, min_confidence: float | None) -> Array:
        """Indices of the items this tier's answer does not settle."""
        thresholds = dict(self.family.thresholds)
        if self.pushed is not None:  # the router's pushed threshold wins over the folder's
            thresholds[self.variant.tier] = self.pushed
        threshold = threshold_for(self.variant.tier, thresholds, min_confidence)  # the router's rule
        if threshold is None:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self.confidences < threshold)


@dataclass(frozen=True, kw_only=True)
class Call:
    """One call, checked: the local variant that would answer, the inputs and the options."""

    model: str
    family: FamilySpec
    variant: VariantSpec
    inputs: dict[str, Array]
    options: RequestOptions
    started: float

    @property
    def local(self) -> bool:
        """Whether the caller's tiers allow the local variant's (a min_tier above it skips it)."""
        return self.options.min_tier <= self.variant.tier <= self.options.max_tier

    def remaining_ms(self) -> float | None:
        budget = self.options.budget_ms
        return None if budget is None else max(0.1, budget - (time.perf_counter() - self.started) * 1000.0)

    def timeout_s(self) -> float:
        remaining = self.remaining_ms()
        return 30.0 if remaining is None else max(0.001, remaining / 1000.0)

    def request(self, rows: Array | None = None, *, min_tier: Tier | None = None) -> pb.ModelInferRequest:
        """The call for the router: every item (or ``rows``), with what is left of its budget."""
        request = pb.ModelInferRequest(model_name=self.model)
        inputs = self.inputs if rows is None else {name: array[rows] for name, array in self.inputs.items()}
        codec.encode_request_inputs(request, inputs)
        options = self.options
        RequestOptions(
            budget_ms=self.remaining_ms(),
            min_confidence=options.min_confidence,
            max_tier=options.max_tier,
            min_tier=max(options.min_tier, min_tier or Tier.DEVICE),
        ).write(request.parameters)
        return request


class Failed:
    """Why no router answered a call: each one's error, for the caller when nothing else can answer."""

    def __init__(self, routers: Routers) -> None:
        self.router = routers.named
        self.errors: list[str] = []
        self._routers = routers

    def add(self, address: str, exc: grpc.RpcError) -> None:
        """``address`` failed the call: it goes to the back of the line, and its error is kept."""
        self._routers.failed(address)
        code, details = status_of(exc)
        self.errors.append(f"{address}: {code.name if code is not None else type(exc).__name__}: {details}")

    def reason(self, local: LocalRun, unsure: Array) -> str:
        """``stratus.reason`` of the local answer degraded because no router answered."""
        why = f"no router answered ({'; '.join(self.errors) or 'none found'})"
        return unanswered_reason(int(unsure.size), local.variant.tier, why)

    def error(self, call: Call) -> Unavailable:
        skipped = f"min_tier={call.options.min_tier.label} skips the {call.variant.tier.label} model here"
        if call.options.max_tier < call.variant.tier:
            skipped = f"max_tier={call.options.max_tier.label} is below the {call.variant.tier.label} model here"
        if self.router is None:
            return Unavailable(f"{skipped}, and this client has no router")
        return Unavailable(f"{skipped}, and no router answered ({'; '.join(self.errors) or 'none found'})")


def escalation(call: Call, local: LocalRun, *, unsure: Array) -> pb.ModelInferRequest:
    """The unsure items only, for the tiers above this one."""
    return call.request(unsure, min_tier=Tier(min(local.variant.tier + 1, Tier.CLOUD)))


def remote_answer(call: Call, response: pb.ModelInferResponse | Failed) -> InferResult:
    """The router's answer for the whole call (the local model skipped); Unavailable when none came."""
    if isinstance(response, Failed):
        raise response.error(call)
    served = Served.read(response.parameters)
    return InferResult(
        outputs=codec.decode_response_outputs(response),
        confidence=served.confidence,
        tier=served.tier,
        path=tuple(served.path),
        timings_ms=dict(served.timings_ms or {}),
        degraded=served.degraded,
        variant=served.variant,
        agent=served.agent,
        item_tiers=tuple(served.item_tiers),
        reason=served.reason,
    )


def merged_answer(local: LocalRun, unsure: Array, response: pb.ModelInferResponse) -> InferResult:
    """The router's answers for the unsure items, each in its place among the local ones."""
    served = Served.read(response.parameters)
    remote = codec.decode_response_outputs(response)
    outputs = {}
    for name, array in local.outputs.items():
        merged = array.copy()
        merged[unsure] = remote[name]
        outputs[name] = merged
    tiers = [local.variant.tier] * len(local.confidences)
    remote_tiers = served.item_tiers or (served.tier,) * len(unsure)
    for index, tier in zip(unsure.tolist(), remote_tiers, strict=True):
        tiers[index] = tier
    settled = np.delete(local.confidences, unsure)
    timings = {local.variant.tier: local.ms, **(served.timings_ms or {})}
    return InferResult(
        outputs=outputs,
        confidence=min(served.confidence, float(settled.min()) if settled.size else 1.0),
        tier=max(tiers),
        path=(local.variant.tier, *served.path),
        timings_ms=timings,
        degraded=served.degraded,
        variant=served.variant,
        agent=served.agent,
        item_tiers=tuple(tiers),
        reason=served.reason,
    )


def send(
    routers: Routers, metadata: Metadata, call: Call, request: pb.ModelInferRequest
) -> pb.ModelInferResponse | Failed:
    """The first router's answer, trying each in turn; what went wrong where none answered."""
    failed = Failed(routers)
    for address in routers.to_try():
        stub = pb_grpc.GRPCInferenceServiceStub(routers.channel(address))
        try:
            response: pb.ModelInferResponse = stub.ModelInfer(
                request, timeout=call.timeout_s(), metadata=metadata
            )
        except grpc.RpcError as exc:
            failed.add(address, exc)
            continue
        routers.answered(address)
        return response
    return failed


async def asend(
    routers: Routers, metadata: Metadata, call: Call, request: pb.ModelInferRequest
) -> pb.ModelInferResponse | Failed:
    """:func:`send` on the caller's event loop."""
    failed = Failed(routers)
    for address in await routers.ato_try():
        stub = pb_grpc.GRPCInferenceServiceStub(routers.achannel(address))
        try:
            response: pb.ModelInferResponse = await stub.ModelInfer(
                request, timeout=call.timeout_s(), metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            failed.add(address, exc)
            continue
        routers.answered(address)
        return response
    return failed
