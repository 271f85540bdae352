"""The one inference servicer (how servers and channels are built is ``stratus.serving.channels``;
the health service is ``stratus.serving.health``).

``InferenceServicer`` speaks the Open Inference Protocol and does nothing but convert and
delegate to a :class:`DataPlane`: the router's (which routes across the fleet), the cloud
gateway's and an agent's local endpoint (which run models here). Errors are raised as
:mod:`stratus.errors` and mapped to statuses once, by :class:`~stratus.serving.interceptor.ErrorInterceptor`.
"""

from __future__ import annotations

import abc
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final, cast

import grpc

from stratus import __version__
from stratus.convert.inference import InferRequest, InferResult
from stratus.convert.parameters import MODEL_VERSION, check_version
from stratus.convert.wire_scan import read_infer_request
from stratus.errors import InvalidInput, NotFound
from stratus.serving.client_limits import ClientLimits
from stratus.serving.stream import StreamSession
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.serving")

EXTENSIONS: Final = ("model_configuration", "stratus_tiers")


class DataPlane(abc.ABC):
    """What a server that answers inference requests must provide."""

    @abc.abstractmethod
    def ready(self) -> bool: ...

    @abc.abstractmethod
    def model_ready(self, name: str) -> bool: ...

    @abc.abstractmethod
    def model_metadata(self, name: str) -> pb.ModelMetadataResponse:
        """Raise NotFound for a model nothing here knows."""

    @abc.abstractmethod
    def model_config(self, name: str) -> pb.ModelConfig: ...

    @abc.abstractmethod
    def model_names(self) -> list[str]:
        """Every family and variant served, for RepositoryIndex."""

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a model here, ready now or not (statistics are kept for those)."""
        return self.model_ready(name)

    @abc.abstractmethod
    async def infer(self, request: InferRequest, *, timeout_s: float | None) -> InferResult:
        """Answer one request or raise a StratusError; ``timeout_s`` is the caller's deadline."""

    def generate(self, request: InferRequest, *, timeout_s: float | None) -> AsyncIterator[InferResult]:
        """A generative request answered as it is produced (see :mod:`stratus.families.generation`):
        one response per chunk of tokens, the last with ``triton_final_response`` true.

        A ModelStreamInfer request whose ``stream`` parameter is true comes here; a data
        plane with no generative model refuses it."""
        raise InvalidInput(f"model '{request.model_name}' does not generate text here")


def version_ready(plane: DataPlane, name: str, version: str) -> bool:
    return version in ("", MODEL_VERSION) and plane.model_ready(name)


_UINT64_MAX: Final = 2**64 - 1  # the statistics' fields are uint64


@dataclass
class _ModelCounts:
    succeeded: int = 0
    succeeded_ns: int = 0
    failed: int = 0
    failed_ns: int = 0
    items: int = 0
    last_ms: int = 0
    queued: int = 0  # answers that said how long they waited, and how long that was
    queue_ns: int = 0
    computed: int = 0  # ... and how long they ran
    compute_ns: int = 0

    def succeed(self, elapsed_ns: int, items: int, result: InferResult) -> None:
        self.succeeded += 1
        self.succeeded_ns += elapsed_ns
        self.items += items
        self.last_ms = int(time.time() * 1000)
        queue_ms = result.queue_ms
        if queue_ms is not None:
            self.queued += 1
            self.queue_ns += int(queue_ms * 1e6)
        compute_ms = result.compute_ms
        if compute_ms is not None:
            self.computed += 1
            self.compute_ns += int(compute_ms * 1e6)


class Statistics:
    """Triton's ModelStatistics for every server, per model as the client named it: requests
    answered (``execution_count``, ``success``) and failed (``fail``) with their time from
    arrival to answer, items answered (``inference_count``), and, from what each answer says
    (``stratus.queue_ms``, ``stratus.compute_ms``), time waiting for a slot (``queue``) and
    running (``compute_infer``). Only names the data plane knows are kept, so a client sending
    made-up names grows nothing."""

    def __init__(self, plane: DataPlane) -> None:
        self._plane = plane
        self._counts: dict[str, _ModelCounts] = {}

    def record(self, request: InferRequest, started_ns: int, result: InferResult | None) -> None:
        """One request's outcome: ``result`` is its (last) answer, None when it failed."""
        name = request.model_name
        counts = self._counts.get(name)
        if counts is None:
            if not self._plane.knows(name):
                return
            counts = self._counts[name] = _ModelCounts()
        elapsed = time.perf_counter_ns() - started_ns
        if result is None:
            counts.failed += 1
            counts.failed_ns += elapsed
            return
        counts.succeed(elapsed, request.items, result)

    def response(self, name: str, version: str = "") -> pb.ModelStatisticsResponse:
        if name and name not in self._counts and not self._plane.knows(name):
            raise NotFound(f"no model '{name[:128]}' is served here")
        check_version(name, version)
        names = [name] if name else sorted({*self._counts, *self._plane.model_names()})
        answer = pb.ModelStatisticsResponse()
        for model in names:
            counts = self._counts.get(model, _ModelCounts())
            stats = answer.model_stats.add(
                name=model,
                version=MODEL_VERSION,
                last_inference=counts.last_ms,
                inference_count=counts.items,
                execution_count=counts.succeeded,
            )
            inference = stats.inference_stats
            for duration, count, ns in (
                (inference.success, counts.succeeded, counts.succeeded_ns),
                (inference.fail, counts.failed, counts.failed_ns),
                (inference.queue, counts.queued, counts.queue_ns),
                (inference.compute_infer, counts.computed, counts.compute_ns),
            ):
                duration.count, duration.ns = count, min(ns, _UINT64_MAX)
        return answer


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane, *, limits: ClientLimits | None = None) -> None:
        self._plane = plane
        self._limits = limits or ClientLimits()
        self.statistics = Statistics(plane)

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._plane.ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=version_ready(self._plane, request.name, request.version))

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="stratus", version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        metadata = self._plane.model_metadata(request.name)
        check_version(request.name, request.version)
        return metadata

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        config = self._plane.model_config(request.name)
        check_version(request.name, request.version)
        return pb.ModelConfigResponse(config=config)

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Any
    ) -> pb.RepositoryIndexResponse:
        index = pb.RepositoryIndexResponse()
        for name in self._plane.model_names():
            ready = self._plane.model_ready(name)
            if ready or not request.ready:
                index.models.add(name=name, version=MODEL_VERSION, state="READY" if ready else "UNAVAILABLE")
        return index

    async def ModelInfer(self, request: bytes, context: Any) -> pb.ModelInferResponse:  # type: ignore[override]
        """``request`` comes as its bytes (:func:`add_inference_service`), bounded before it is parsed."""
        return await self.infer(read_infer_request(request), peer=context.peer(), timeout_s=context.time_remaining())

    async def infer(
        self, message: pb.ModelInferRequest, *, peer: str, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        """One request from any front (gRPC's ModelInfer, the REST API), within the client's
        limits and counted in the statistics alike."""
        started, result = time.perf_counter_ns(), None
        asked = InferRequest.from_wire(message)
        try:
            check_version(asked.model_name, asked.model_version)
            with self._limits.hold(peer, asked.items):
                result = await self._plane.infer(asked, timeout_s=timeout_s)
            return result.to_wire()
        finally:
            self.statistics.record(asked, started, result)

    async def generate(
        self, message: pb.ModelInferRequest, *, peer: str, timeout_s: float | None
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """A generative request answered chunk by chunk (the REST API's generate_stream), within
        the client's limits and counted in the statistics as a stream's request is."""
        started, answered = time.perf_counter_ns(), None
        asked = InferRequest.from_wire(message)
        try:
            check_version(asked.model_name, asked.model_version)
            with self._limits.hold(peer, asked.items):
                last = None
                async for chunk in self._plane.generate(asked, timeout_s=timeout_s):
                    last = chunk
                    yield chunk.to_wire()
                answered = last if last is not None else InferResult(model_name="", id="", outputs={})
        finally:
            self.statistics.record(asked, started, answered)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Any
    ) -> pb.ModelStatisticsResponse:
        return self.statistics.response(request.name, request.version)

    async def ModelStreamInfer(  # type: ignore[override]
        self, request_iterator: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests on one stream run concurrently; each answer carries its request's id. A
        request refused from its bytes is answered with an error and the stream goes on."""
        hold = functools.partial(self._limits.hold, context.peer())
        with self._limits.stream(context.peer()) as silent_s:
            session = StreamSession(self._plane, request_iterator, hold, self.statistics.record, silent_s=silent_s)
            async with session:
                async for response in session.responses():
                    yield response


# The calls whose requests come as bytes, so that wire_scan bounds them before they are parsed.
_TAKEN_AS_BYTES: Final = frozenset({"ModelInfer", "ModelStreamInfer"})


class _Collected:
    """Stands in for a server to the generated registration, keeping the handlers it adds."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def add_inference_service(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as the generated code would, except that ModelInfer and
    ModelStreamInfer take their requests as bytes: gRPC's own parse runs before any interceptor
    or handler, and a refusal raised there reaches the client as UNKNOWN, not as what it is."""
    collected = _Collected()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, cast(grpc.aio.Server, collected))
    handlers = {
        name: handler._replace(request_deserializer=None) if name in _TAKEN_AS_BYTES else handler  # type: ignore[attr-defined]
        for name, handler in collected.handlers.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(collected.service, handlers),))
    server.add_registered_method_handlers(collected.service, handlers)

