"""A fleet in one process, for pinning down how the router's cascades behave.

The router's own parts are real: a :class:`FleetRegistry` that agents join with a Hello as
a real agent's, a :class:`RouterDataPlane` with a real metrics registry, and the Work,
Cancel, Result and Chunk messages that travel on an AgentLink. Only the far ends are
fakes: :class:`FakeAgent` reads the Work its handle's outbox would put on the link and
answers as it is told (per item, or with chunks of tokens), and :class:`FakeCloud`, a
:class:`CloudLink`, answers escalations from canned values. Time is an injected clock that
an agent moves on by the latency it is given, so timings are exact and nothing sleeps.

Items carry who they are: row ``i`` of a request is ``[key, 0]``, and each tier answers
``MARK[tier] + key`` for it, so a response shows which tier answered which item.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from router.cascade.classify import ClassifyCascade
from router.cascade.generate import Generation
from router.cloud.link import CloudLink, OnChunk
from router.dataplane import RouterDataPlane
from router.fleet.agent_handle import AgentHandle
from router.fleet.registry import FleetRegistry
from stratus.convert import codec
from stratus.convert.fleet import chunk_from_wire, heartbeat_from_wire
from stratus.convert.hello import hello_from_wire
from stratus.convert.inference import InferRequest, InferResult, TextRequest
from stratus.convert.parameters import CONFIDENCE, VARIANT, RequestOptions, Served, set_parameter
from stratus.convert.text import prompt_request, text_result
from stratus.convert.work import result_from_wire
from stratus.errors import StratusError
from stratus.families.generation import (
    COMPLETION_TOKENS,
    FINAL,
    FINISH_REASON,
    PROMPT_TOKENS,
    TEXT_INPUT,
    TEXT_OUTPUT,
    Chunk,
    GenerationParams,
    Token,
)
from stratus.obs.metrics import Metrics, RouterMetrics
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

FAMILY = "toy"
TEXT_FAMILY = "chat"
INPUT, OUTPUT = "x", "scores"
THRESHOLDS = {"device": 0.8, "edge": 0.7}
VARIANTS = {Tier.DEVICE: "small", Tier.EDGE: "medium"}
MARK = {Tier.DEVICE: 100, Tier.EDGE: 200, Tier.CLOUD: 300}
_WIRE_TIER = {Tier.DEVICE: fpb.TIER_DEVICE, Tier.EDGE: fpb.TIER_EDGE}
_TENSOR = pb.ModelMetadataResponse.TensorMetadata

# One generated chunk: (text, log-probability) per token.
Tokens = Sequence[tuple[str, float]]


class Clock:
    """The router's clock, moved on by hand (or by an agent's latency)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1000.0


def classifier_family() -> fpb.FamilyInfo:
    return fpb.FamilyInfo(
        name=FAMILY,
        inputs=[_TENSOR(name=INPUT, datatype="FP32", shape=[-1, 2])],
        outputs=[_TENSOR(name=OUTPUT, datatype="FP32", shape=[-1, 1])],
        thresholds=THRESHOLDS,
    )


def text_family(method: str = "mean_logprob") -> fpb.FamilyInfo:
    return fpb.FamilyInfo(
        name=TEXT_FAMILY,
        inputs=[_TENSOR(name=TEXT_INPUT, datatype="BYTES", shape=[1])],
        outputs=[_TENSOR(name=TEXT_OUTPUT, datatype="BYTES", shape=[-1])],
        thresholds={"device": 0.5, "edge": 0.5},
        kind="generative",
        confidence_method=method,
        max_tokens=8,
    )


def variant_name(family: fpb.FamilyInfo, tier: Tier) -> str:
    return f"{family.name}-{VARIANTS[tier]}"


@dataclass(kw_only=True)
class Behaviour:
    """How a fake agent answers each Work.

    ``confidence`` maps an item's key to its confidence (classifiers); ``chunks`` are the
    token chunks a generation sends before its Result. ``error`` answers every Work with
    that status, ``drop`` loses the link on the first Work, and ``hold_after`` stops after
    that many chunks (0 for a classifier: never answers) until the router cancels.
    """

    confidence: Callable[[int], float] = lambda _key: 0.99
    chunks: Sequence[Tokens] = ((("4", -0.1),),)
    latency_ms: float = 1.0
    error: grpc.StatusCode | None = None
    drop: bool = False
    hold_after: int | None = None


def confidences(table: Mapping[int, float], default: float = 0.99) -> Callable[[int], float]:
    return lambda key: table.get(key, default)


@dataclass(eq=False)
class FakeAgent:
    """One agent behind its handle: answers the Work its outbox holds, notes each Cancel."""

    registry: FleetRegistry
    clock: Clock
    handle: AgentHandle
    behaviour: Behaviour
    works: list[fpb.Work] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    _answering: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read(), name=f"fake-agent-{self.handle.id}")

    @property
    def keys_seen(self) -> list[list[int]]:
        """The item keys of each classifier Work, in the order they came."""
        return [[int(row[0]) for row in codec.decode_request_inputs(w.request)[INPUT]] for w in self.works]

    def heartbeat(self, mean_ms: float) -> None:
        """Report a service time, as a heartbeat does, for the policy's predictions."""
        variant = next(iter(self.handle.variants))
        estimate = fpb.LatencyEstimate(variant=variant, mean_ms=mean_ms, count=10)
        self.registry.heartbeat(self.handle, heartbeat_from_wire(fpb.Heartbeat(latency=[estimate])))

    async def _read(self) -> None:
        while (message := await self.handle.work.outbox.get()) is not None:
            kind = message.WhichOneof("kind")
            if kind == "work":
                self.works.append(message.work)
                task = asyncio.create_task(self._answer(message.work), name="fake-agent-work")
                self._answering[message.work.request_id] = task
            elif kind == "cancel":
                self.cancels.append(message.cancel.request_id)
                answering = self._answering.get(message.cancel.request_id)
                if answering is not None:
                    answering.cancel()

    async def _answer(self, work: fpb.Work) -> None:
        behaviour = self.behaviour
        if behaviour.drop:
            self.registry.lose(self.handle, "link broke")
            return
        if behaviour.error is None and work.request.inputs[0].name == TEXT_INPUT:
            await self._generate(work)
        elif behaviour.hold_after is not None:
            await asyncio.Event().wait()
        self.clock.advance(behaviour.latency_ms)
        self.registry.result(self.handle, result_from_wire(self._result(work), f"agent {self.handle.id}"))  # as a link reads it

    async def _generate(self, work: fpb.Work) -> None:
        for sent, tokens in enumerate(self.behaviour.chunks):
            if sent == self.behaviour.hold_after:
                await asyncio.Event().wait()
            text = "".join(t for t, _ in tokens)
            message = fpb.Chunk(request_id=work.request_id, text=text, logprobs=[lp for _, lp in tokens])
            message.margins.extend([math.nan] * len(tokens))
            self.registry.chunk(self.handle, work.request_id, chunk_from_wire(message))
            await asyncio.sleep(0)  # as a link would: the router reads each chunk apart

    def _result(self, work: fpb.Work) -> fpb.Result:
        result = fpb.Result(request_id=work.request_id, variant=work.request.model_name)
        result.service_ms = self.behaviour.latency_ms
        if self.behaviour.error is not None:
            result.error.code = self.behaviour.error.value[0]
            result.error.message = f"{self.handle.id} failed as told"
            return result
        if work.request.inputs[0].name == TEXT_INPUT:
            set_parameter(result.response.parameters, FINISH_REASON, "stop")
            return result
        keys = [int(row[0]) for row in codec.decode_request_inputs(work.request)[INPUT]]
        scores = np.array([[MARK[self.handle.tier] + key] for key in keys], dtype=np.float32)
        codec.encode_response_outputs(result.response, {OUTPUT: scores})
        result.confidences.extend(self.behaviour.confidence(key) for key in keys)
        result.confidence = min(result.confidences)
        result.batch_size = len(keys)
        return result

    async def stop(self) -> None:
        self.registry.lose(self.handle, "test over")  # ends the outbox, as a closed link does
        tasks = [task for task in (self._reader, *self._answering.values()) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(kw_only=True)
class CloudBehaviour:
    """How the fake cloud answers: one confidence per escalation (as a cloud says it), or
    ``error`` raised; generations stream ``chunks`` and end with ``finish_reason``."""

    confidence: float = 0.99
    error: StratusError | None = None
    chunks: Sequence[Tokens] = ((("four", -0.01),),)
    finish_reason: str = "stop"
    latency_ms: float = 5.0


class FakeCloud(CloudLink):
    """A cloud link that is connected (or ``down``) and answers from canned values, through
    the link's public calls: ``infer`` for escalations, ``generate`` for text."""

    def __init__(
        self,
        clock: Clock,
        *,
        serves: Sequence[str] = (FAMILY,),
        up: bool = True,
        behaviour: CloudBehaviour | None = None,
    ) -> None:
        super().__init__("cloud.test:8001")
        self.clock = clock
        self.state = "connected" if up else "down"
        self.models = dict.fromkeys(serves, True)
        self.behaviour = behaviour or CloudBehaviour()
        self.asked: list[pb.ModelInferRequest] = []

    @property
    def keys_seen(self) -> list[list[int]]:
        return [[int(row[0]) for row in codec.decode_request_inputs(r)[INPUT]] for r in self.asked]

    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        self._called(request)
        keys = [int(row[0]) for row in codec.decode_request_inputs(request)[INPUT]]
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        scores = np.array([[MARK[Tier.CLOUD] + key] for key in keys], dtype=np.float32)
        codec.encode_response_outputs(response, {OUTPUT: scores})
        set_parameter(response.parameters, CONFIDENCE, self.behaviour.confidence)
        set_parameter(response.parameters, VARIANT, f"{request.model_name}-large")
        return response

    async def generate(
        self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        self._called(request)
        for tokens in self.behaviour.chunks:
            await on_chunk(Chunk(tokens=tuple(Token(text=t, logprob=lp) for t, lp in tokens)))
        response = text_result(InferRequest.from_wire(request), "").to_wire()
        set_parameter(response.parameters, FINISH_REASON, self.behaviour.finish_reason)
        set_parameter(response.parameters, VARIANT, f"{request.model_name}-large")
        set_parameter(response.parameters, FINAL, True)
        return response

    def _called(self, request: pb.ModelInferRequest) -> None:
        self.asked.append(request)
        self.clock.advance(self.behaviour.latency_ms)
        if self.behaviour.error is not None:
            raise self.behaviour.error


class Fleet:
    """A real registry and data plane, with fake agents and perhaps a fake cloud."""

    def __init__(
        self,
        *,
        family: fpb.FamilyInfo | None = None,
        fail_without_cloud: bool = False,
        max_requests: int = 4096,
    ) -> None:
        self.family = family or classifier_family()  # what agents serve unless told otherwise
        self.clock = Clock()
        self.metrics = RouterMetrics(Metrics())
        self.registry = FleetRegistry(clock=self.clock, metrics=self.metrics)
        self.cloud: FakeCloud | None = None
        self.agents: list[FakeAgent] = []
        self._fail_without_cloud = fail_without_cloud
        self._max_requests = max_requests
        self._plane: RouterDataPlane | None = None

    @property
    def plane(self) -> RouterDataPlane:
        """Built on first use, once the test has said whether there is a cloud."""
        if self._plane is None:
            self._plane = RouterDataPlane(
                self.registry,
                self.cloud,
                rng=random.Random(19),
                clock=self.clock,
                fail_without_cloud=self._fail_without_cloud,
                max_requests=self._max_requests,
                metrics=self.metrics,
            )
        return self._plane

    def agent(
        self,
        agent_id: str,
        tier: Tier,
        *,
        family: fpb.FamilyInfo | None = None,
        capacity: int = 2,
        queue_limit: int = 8,
        max_batch: int = 8,
        **behaviour: object,
    ) -> FakeAgent:
        """Join an agent as its Hello would: one variant of the family on its tier."""
        info = family or self.family
        hello = fpb.Hello(
            agent_id=agent_id,
            tier=_WIRE_TIER[tier],
            capacity=capacity,
            queue_limit=queue_limit,
            variants=[fpb.VariantInfo(name=variant_name(info, tier), family=info.name, max_batch=max_batch)],
            families=[info],
        )
        handle = self.registry.register(hello_from_wire(hello), peer="fake")
        fake = FakeAgent(self.registry, self.clock, handle, Behaviour(**behaviour))  # type: ignore[arg-type]
        fake.start()
        self.agents.append(fake)
        return fake

    def with_cloud(
        self, *, serves: Sequence[str] = (FAMILY,), up: bool = True, **behaviour: object
    ) -> FakeCloud:
        self.cloud = FakeCloud(self.clock, serves=serves, up=up, behaviour=CloudBehaviour(**behaviour))  # type: ignore[arg-type]
        return self.cloud

    def count(self, name: str, **labels: str) -> float:
        """A counter's value in the router's metrics (0 where never counted)."""
        value = self.metrics.metrics.registry.get_sample_value(f"stratus_router_{name}_total", labels)
        return value or 0.0

    def climbs(self, lower: Tier, higher: Tier, reason: str, *, family: str = FAMILY) -> float:
        """Escalations counted from ``lower`` to ``higher`` for ``reason``."""
        labels = {"from_tier": lower.label, "to_tier": higher.label, "reason": reason}
        return self.count("escalations", family=family, **labels)

    async def close(self) -> None:
        for fake in self.agents:
            await fake.stop()


async def fill(agent: FakeAgent, ask: Awaitable[object]) -> asyncio.Task[object]:
    """Run ``ask`` (a request pinned to ``agent``, which holds it) until the agent is full;
    the task is the caller's to cancel."""
    task: asyncio.Task[object] = asyncio.ensure_future(ask)
    for _ in range(100):
        if agent.handle.in_flight >= agent.handle.limit:
            return task
        await asyncio.sleep(0)
    raise AssertionError(f"{agent.handle.id} holds {agent.handle.in_flight} of {agent.handle.limit} items")


async def release(task: asyncio.Task[object]) -> None:
    """Cancel a request left holding an agent, and wait for it to end."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


@contextlib.asynccontextmanager
async def fleet(**settings: object) -> AsyncIterator[Fleet]:
    built = Fleet(**settings)  # type: ignore[arg-type]
    try:
        yield built
    finally:
        await built.close()


def classify(keys: Sequence[int], *, model: str = FAMILY, **options: object) -> InferRequest:
    """A request of one item per key, with ``stratus.*`` options (``max_tier=Tier.EDGE``)."""
    request = pb.ModelInferRequest(model_name=model, id="req-1")
    rows = np.array([[key, 0.0] for key in keys], dtype=np.float32)
    codec.encode_request_inputs(request, {INPUT: rows})
    RequestOptions(**options).write(request.parameters)  # type: ignore[arg-type]
    return InferRequest.from_wire(request)


def prompt(*, model: str = TEXT_FAMILY, **options: object) -> TextRequest:
    """A generative request as the cascade takes it (the OpenAI API builds these)."""
    params = GenerationParams(max_tokens=8)
    return TextRequest(model_name=model, id="gen-1", prompt="2+2=", params=params, options=RequestOptions(**options))  # type: ignore[arg-type]


def oip_prompt(*, model: str = TEXT_FAMILY, **options: object) -> InferRequest:
    """The same request as an Open Inference Protocol client sends it."""
    request = prompt_request(model, "gen-1", "2+2=", GenerationParams(max_tokens=8))
    RequestOptions(**options).write(request.parameters)  # type: ignore[arg-type]
    return InferRequest.from_wire(request)


def _wire(answer: InferResult | pb.ModelInferResponse) -> pb.ModelInferResponse:
    return answer.to_wire() if isinstance(answer, InferResult) else answer


def scores(response: InferResult | pb.ModelInferResponse) -> list[int]:
    """Which tier answered each item, as ``MARK[tier] + key``, in the request's order."""
    return [int(v) for v in codec.decode_response_outputs(_wire(response))[OUTPUT].reshape(-1)]


def text_of(response: InferResult | pb.ModelInferResponse) -> str:
    (value,) = codec.decode_response_outputs(_wire(response))[TEXT_OUTPUT].reshape(-1)
    return bytes(value).decode("utf-8")


def served(response: InferResult | pb.ModelInferResponse) -> Served:
    return Served.read(_wire(response).parameters)


@dataclass(eq=False)
class ReportingAgent(FakeAgent):
    """A fake agent whose Results also say what a real agent's may: the time its Work waited
    for a slot (``queue_ms``), a generation's own confidence (``text_confidence``) and its
    token counts (``usage``: prompt, completion); with ``fail_after_chunks`` (and an
    ``error``) a generation streams its chunks and then fails; ``flat_variant`` answers
    with scores of one dimension (no per-class axis, so no top-1 to compare)."""

    queue_ms: float = 0.0
    text_confidence: float | None = None
    usage: tuple[int, int] | None = None
    fail_after_chunks: bool = False  # a generation's chunks are sent before its error
    flat_variant: str = ""  # this variant's scores come back one number per item: shape [n]

    async def _answer(self, work: fpb.Work) -> None:
        if self.fail_after_chunks and work.request.inputs[0].name == TEXT_INPUT:
            await self._generate(work)
        await super()._answer(work)

    def _result(self, work: fpb.Work) -> fpb.Result:
        result = super()._result(work)
        result.queue_ms = self.queue_ms
        flat = self.flat_variant and work.request.model_name == self.flat_variant
        if flat and work.request.inputs[0].name == INPUT and self.behaviour.error is None:
            keys = [int(row[0]) for row in codec.decode_request_inputs(work.request)[INPUT]]
            del result.response.outputs[:]
            del result.response.raw_output_contents[:]
            flat_scores = np.array([MARK[self.handle.tier] + key for key in keys], dtype=np.float32)
            codec.encode_response_outputs(result.response, {OUTPUT: flat_scores})
        if work.request.inputs[0].name == TEXT_INPUT and self.behaviour.error is None:
            if self.text_confidence is not None:
                result.confidences.append(self.text_confidence)
                result.confidence = self.text_confidence
            if self.usage is not None:
                set_parameter(result.response.parameters, PROMPT_TOKENS, self.usage[0])
                set_parameter(result.response.parameters, COMPLETION_TOKENS, self.usage[1])
        return result


def line_agent(
    built: Fleet,
    agent_id: str,
    tier: Tier,
    *,
    candidate: str | None = None,
    precision: str = "",
    compute: str = "",
    queue_ms: float = 0.0,
    text_confidence: float | None = None,
    usage: tuple[int, int] | None = None,
    fail_after_chunks: bool = False,
    flat_variant: str = "",
    **behaviour: object,
) -> ReportingAgent:
    """Join a :class:`ReportingAgent` that serves the family's current variant and, where
    given, a rollout's ``candidate`` line beside it (not current); ``precision`` and
    ``compute`` are what its Hello says of both."""
    info = built.family
    current = variant_name(info, tier)
    names = (current,) if candidate is None else (current, candidate)
    variants = [
        fpb.VariantInfo(
            name=name,
            family=info.name,
            max_batch=8,
            line=name,
            current=name == current,
            precision=precision,
            compute=compute,
        )
        for name in names
    ]
    hello = fpb.Hello(
        agent_id=agent_id,
        tier=_WIRE_TIER[tier],
        capacity=2,
        queue_limit=8,
        variants=variants,
        families=[info],
    )
    handle = built.registry.register(hello_from_wire(hello), peer="fake")
    fake = ReportingAgent(
        built.registry,
        built.clock,
        handle,
        Behaviour(**behaviour),  # type: ignore[arg-type]
        queue_ms=queue_ms,
        text_confidence=text_confidence,
        usage=usage,
        fail_after_chunks=fail_after_chunks,
        flat_variant=flat_variant,
    )
    fake.start()
    built.agents.append(fake)
    return fake


def heartbeat_variant(agent: FakeAgent, variant: str, mean_ms: float) -> None:
    """Report a service time for one of the agent's variants (a rollout's candidate, say)."""
    estimate = fpb.LatencyEstimate(variant=variant, mean_ms=mean_ms, count=10)
    agent.registry.heartbeat(agent.handle, heartbeat_from_wire(fpb.Heartbeat(latency=[estimate])))


class ReportingCloud(FakeCloud):
    """A fake cloud whose answers carry ``extra`` parameters besides the canned ones (its
    precision, queue and compute times, a generation's confidence or token counts)."""

    def __init__(
        self,
        clock: Clock,
        *,
        extra: Mapping[str, object],
        serves: Sequence[str] = (FAMILY,),
        up: bool = True,
        **behaviour: object,
    ) -> None:
        super().__init__(clock, serves=serves, up=up, behaviour=CloudBehaviour(**behaviour))  # type: ignore[arg-type]
        self.extra = dict(extra)

    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        response = await super().infer(request, timeout_s=timeout_s)
        for key, value in self.extra.items():
            set_parameter(response.parameters, key, value)  # type: ignore[arg-type]
        return response

    async def generate(
        self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        response = await super().generate(request, on_chunk, timeout_s=timeout_s)
        for key, value in self.extra.items():
            set_parameter(response.parameters, key, value)  # type: ignore[arg-type]
        return response


@dataclass
class AuditRecorder:
    """Stands in for the router's auditor: keeps what each answered request handed it."""

    classified_cascades: list[ClassifyCascade] = field(default_factory=list)
    generations: list[tuple[Generation, list[Generation]]] = field(default_factory=list)

    def classified(self, cascade: ClassifyCascade) -> None:
        self.classified_cascades.append(cascade)

    def generated(
        self, info: object, request: object, result: Generation, climbed: Sequence[Generation]
    ) -> None:
        self.generations.append((result, list(climbed)))
