"""The one inference servicer, and how every Stratus gRPC server and channel is built.

``InferenceServicer`` speaks the Open Inference Protocol and does nothing but convert and
delegate to a :class:`DataPlane`: the router's (which routes across the fleet), the cloud
gateway's and an agent's local endpoint (which run models here). Errors are raised as
:mod:`stratus.errors` and mapped to statuses once, by :class:`~stratus.status.ErrorInterceptor`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

from stratus import __version__, codec
from stratus.convert.errors import stream_error
from stratus.errors import ConfigError, InvalidInput, NotFound, Overloaded, StratusError
from stratus.protocol import COMPUTE_MS, MODEL_VERSION, QUEUE_MS, reported_ms
from stratus.status import ErrorInterceptor
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.serving")

# Every server and channel refuses messages past this size (a digits batch of 64 is 16 KiB).
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
# What one message on a shared stream (an AgentLink, the cloud link) may carry: a message over
# MAX_MESSAGE_BYTES ends the whole stream and every call on it, so a request that would
# build one is refused alone, before it is sent.
MAX_WORK_BYTES: Final = MAX_MESSAGE_BYTES - 64 * 1024


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``localhost``, or an address, brackets allowed) is this machine's loopback."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_fits(size: int, what: str) -> None:
    """Refuse (INVALID_ARGUMENT) a message of ``size`` bytes that a shared stream cannot carry."""
    if size > MAX_WORK_BYTES:
        raise InvalidInput(
            f"{what} would be {size} bytes, over the {MAX_WORK_BYTES}-byte limit of a link; "
            "send fewer items per request"
        )


# Requests one ModelStreamInfer stream may have in flight before its reader waits.
STREAM_WINDOW: Final = 256
# ... and bytes of requests (two full-size messages), whichever runs out first.
STREAM_WINDOW_BYTES: Final = 2 * MAX_MESSAGE_BYTES
EXTENSIONS: Final = ("model_configuration", "stratus_tiers")


def grpc_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES, *, keepalive_s: float = 10.0, keepalive_timeout_s: float = 5.0
) -> list[tuple[str, Any]]:
    """Options for every server and channel: ping a quiet peer every ``keepalive_s`` and
    close the connection when a ping goes unanswered for ``keepalive_timeout_s``. A router
    pings its agents often, so a frozen or unplugged agent is lost within seconds; each
    ping costs gRPC's core, not Python, about 0.1 ms here."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        # gRPC's core times a keepalive ping out by this one (default 60 s), not the above.
        ("grpc.http2.ping_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


@dataclass(frozen=True, kw_only=True)
class TlsSettings:
    """TLS for every link a process has, as server and as client.

    ``cert`` and ``key`` are this process's identity (served to peers, and presented to
    servers that ask for a client certificate); ``ca`` verifies peers. On a server, a
    ``ca`` means mutual TLS: a client without a certificate from that CA is refused.
    """

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        for path in (self.cert, self.key, self.ca):
            if path is not None and not path.is_file():
                raise ConfigError(f"TLS file {path} does not exist")

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    @property
    def mutual(self) -> bool:
        """As a server: callers must present a certificate from ``ca``."""
        return self.cert is not None and self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ConfigError("serving TLS needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes() if self.ca else None,
            require_client_auth=self.ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


NO_TLS: Final = TlsSettings()


# Streams one client connection may hold open at once, and calls a server runs at once: a
# client opening thousands of silent streams is refused past these (an AgentLink is one
# stream on its own connection, so a router of 2,000 agents holds 2,000 calls). Generous per
# connection: a client that opens many calls at once on a new channel, before the server's
# SETTINGS reach it, gets REFUSED_STREAM (UNAVAILABLE) past the cap; 300 at once were seen.
MAX_STREAMS_PER_CONNECTION: Final = 1024
MAX_CONCURRENT_RPCS: Final = 16_384


def create_server(
    *, keepalive_s: float = 10.0, keepalive_timeout_s: float = 5.0, client_token: str = ""
) -> grpc.aio.Server:
    """A server with Stratus's limits; with ``client_token``, inference calls need it as
    ``authorization: Bearer TOKEN`` (the other services check their own credentials)."""
    from stratus.auth import BearerTokenInterceptor

    guards: list[grpc.aio.ServerInterceptor] = [BearerTokenInterceptor(client_token)] if client_token else []
    options = [
        *grpc_options(keepalive_s=keepalive_s, keepalive_timeout_s=keepalive_timeout_s),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ]
    return grpc.aio.server(
        interceptors=[*guards, ErrorInterceptor()],
        options=options,
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )


def bind(server: grpc.aio.Server, address: str, tls: TlsSettings = NO_TLS) -> int:
    """Bind ``host:port`` (port 0 picks a free one) and return the port actually bound."""
    try:
        if tls.enabled:
            port = server.add_secure_port(address, tls.server_credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # gRPC's "Failed to bind": say what it usually means
        port = 0
    if port == 0:
        raise ConfigError(
            f"cannot listen on {address}: the port is in use (another process, or another "
            "Stratus server), or the host is not an address of this machine"
        )
    return port


def open_channel(
    address: str, tls: TlsSettings = NO_TLS, *, extra_options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to a Stratus server, over TLS when the settings say so.

    Each channel keeps its own connection (a local subchannel pool): gRPC would otherwise
    share one connection between every channel to the same address in a process, and
    agents simulated in one process must each hold their own link, as real ones do.
    """
    options = [*grpc_options(), ("grpc.use_local_subchannel_pool", 1), *extra_options]
    if tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def server_name_options(name: str | None, tls: TlsSettings) -> list[tuple[str, Any]]:
    """Check a TLS server's certificate against ``name`` rather than the address dialled."""
    return [("grpc.ssl_target_name_override", name)] if name and tls.enabled else []


def open_sync_channel(address: str, tls: TlsSettings = NO_TLS) -> grpc.Channel:
    """A blocking channel (CLI, SDK's synchronous path)."""
    if tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=grpc_options())
    return grpc.insecure_channel(address, options=grpc_options())


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
    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        """Answer one request or raise a StratusError; ``timeout_s`` is the caller's deadline."""

    def generate(
        self, request: pb.ModelInferRequest, *, timeout_s: float | None
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """A generative request answered as it is produced (see :mod:`stratus.generation`):
        one response per chunk of tokens, the last with ``triton_final_response`` true.

        A ModelStreamInfer request whose ``stream`` parameter is true comes here; a data
        plane with no generative model refuses it."""
        raise InvalidInput(f"model '{request.model_name}' does not generate text here")


# Requests one client (one peer address) may have in flight on a server at once, so that no
# single client takes every slot (a router's cloud link holds at most 512 at the cloud).
MAX_REQUESTS_PER_CLIENT: Final = 1024


def client_of(peer: str) -> str:
    """A gRPC peer without its port: ``ipv4:10.0.0.7:51234`` is client ``ipv4:10.0.0.7``."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


class ClientLimits:
    """Requests in flight per client; past ``per_client`` a client's new ones are refused
    with RESOURCE_EXHAUSTED while everyone else's go on. 0 turns the limit off."""

    def __init__(self, per_client: int = MAX_REQUESTS_PER_CLIENT) -> None:
        self.per_client = per_client
        self.held: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, peer: str) -> Iterator[None]:
        if self.per_client <= 0:
            yield
            return
        client = client_of(peer)
        count = self.held.get(client, 0)
        if count >= self.per_client:
            raise Overloaded(
                f"this client has {count} requests in flight here, the most one client may; "
                "wait for answers before sending more"
            )
        self.held[client] = count + 1
        try:
            yield
        finally:
            left = self.held[client] - 1
            if left:
                self.held[client] = left
            else:
                del self.held[client]


def check_version(name: str, version: str) -> None:
    """NOT_FOUND for a version other than the one every model has, naming it."""
    if version not in ("", MODEL_VERSION):
        raise NotFound(
            f"model '{name[:128]}' has no version {version[:32]!r}: every model here has one version, "
            f"'{MODEL_VERSION}' (a family's variants are models of their own, by name)"
        )


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

    def succeed(self, elapsed_ns: int, items: int, response: pb.ModelInferResponse) -> None:
        self.succeeded += 1
        self.succeeded_ns += elapsed_ns
        self.items += items
        self.last_ms = int(time.time() * 1000)
        queue_ms = reported_ms(response.parameters, QUEUE_MS)
        if queue_ms is not None:
            self.queued += 1
            self.queue_ns += int(queue_ms * 1e6)
        compute_ms = reported_ms(response.parameters, COMPUTE_MS)
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

    def record(self, request: pb.ModelInferRequest, started_ns: int, response: pb.ModelInferResponse | None) -> None:
        """One request's outcome: ``response`` is its (last) answer, None when it failed."""
        name = request.model_name
        counts = self._counts.get(name)
        if counts is None:
            if not self._plane.knows(name):
                return
            counts = self._counts[name] = _ModelCounts()
        elapsed = time.perf_counter_ns() - started_ns
        if response is None:
            counts.failed += 1
            counts.failed_ns += elapsed
            return
        shape = request.inputs[0].shape if request.inputs else ()
        counts.succeed(elapsed, int(shape[0]) if shape else 1, response)

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

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        started, response = time.perf_counter_ns(), None
        try:
            check_version(request.model_name, request.model_version)
            with self._limits.hold(context.peer()):
                response = await self._plane.infer(request, timeout_s=context.time_remaining())
            return response
        finally:
            self.statistics.record(request, started, response)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Any
    ) -> pb.ModelStatisticsResponse:
        return self.statistics.response(request.name, request.version)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests on one stream run concurrently; each answer carries its request's id."""
        hold = functools.partial(self._limits.hold, context.peer())
        async with _StreamSession(self._plane, request_iterator, hold, self.statistics.record) as session:
            async for response in session.responses():
                yield response


@dataclass(frozen=True)
class _Answered:
    """An outbox entry after a request's last response: its window slot (and its bytes) are
    free once every response before it has been written."""

    size: int


class ByteWindow:
    """Bytes of requests one stream may have read and not yet answered: the count window alone
    let 256 requests of 1 MiB each (a client that never reads) hold 256 MiB per stream."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._freed = asyncio.Event()

    async def acquire(self, size: int) -> None:
        while self.held and self.held + size > self.limit:  # one request always fits alone
            self._freed.clear()
            await self._freed.wait()
        self.held += size

    def release(self, size: int) -> None:
        self.held -= size
        self._freed.set()


class _StreamSession:
    """One ModelStreamInfer stream: a reader task, one task per request, an ordered outbox.

    At most STREAM_WINDOW requests are read ahead of what has been written back: a slot is
    freed only when its answer has gone out, so a client that sends and never reads holds
    STREAM_WINDOW answers in memory at most, not every answer it asked for."""

    _DONE: Final = None

    def __init__(
        self,
        plane: DataPlane,
        requests: AsyncIterator[pb.ModelInferRequest],
        hold: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        record: Callable[[pb.ModelInferRequest, int, pb.ModelInferResponse | None], None] | None = None,
    ) -> None:
        self._plane = plane
        self._requests = requests
        self._hold = hold  # the client's share of the server (ClientLimits)
        self._record = record  # Statistics.record
        self._outbox: asyncio.Queue[pb.ModelStreamInferResponse | _Answered | None] = asyncio.Queue()
        self._window = asyncio.Semaphore(STREAM_WINDOW)
        self._bytes = ByteWindow(STREAM_WINDOW_BYTES)
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _StreamSession:
        self._reader = asyncio.create_task(self._read(), name="stratus-stream-reader")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in [*self._tasks, *([self._reader] if self._reader else [])]:
            task.cancel()
        await asyncio.gather(*self._tasks, *([self._reader] if self._reader else []), return_exceptions=True)

    async def responses(self) -> AsyncIterator[pb.ModelStreamInferResponse]:
        while (item := await self._outbox.get()) is not self._DONE:
            if isinstance(item, _Answered):
                self._window.release()  # every response of that request has been written
                self._bytes.release(item.size)
                continue
            assert item is not None
            yield item
        if self._reader is not None:
            await self._reader  # re-raise a broken request stream

    async def _read(self) -> None:
        try:
            async for request in self._requests:
                await self._window.acquire()
                size = request.ByteSize()
                await self._bytes.acquire(size)
                task = asyncio.create_task(self._answer(request, size))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            self._outbox.put_nowait(self._DONE)

    async def _answer(self, request: pb.ModelInferRequest, size: int) -> None:
        started, answered = time.perf_counter_ns(), None
        try:
            check_version(request.model_name, request.model_version)
            with self._hold():
                if _streams(request):  # decoupled: many responses, the last marked final
                    last = None
                    async for chunk in self._plane.generate(request, timeout_s=None):
                        self._outbox.put_nowait(pb.ModelStreamInferResponse(infer_response=chunk))
                        last = chunk
                    answered = last if last is not None else pb.ModelInferResponse()
                    return
                response = await self._plane.infer(request, timeout_s=None)
                self._outbox.put_nowait(pb.ModelStreamInferResponse(infer_response=response))
            answered = response
        except StratusError as exc:
            self._outbox.put_nowait(stream_error(request, exc))
        except Exception as exc:  # one bad request must not end the stream for the others
            log.exception("unexpected error in a streamed request")
            self._outbox.put_nowait(stream_error(request, exc))
        finally:
            if self._record is not None:
                self._record(request, started, answered)
            self._outbox.put_nowait(_Answered(size))


def _streams(request: pb.ModelInferRequest) -> bool:
    """Triton's convention: a ``stream`` parameter (or BOOL input, typed or raw, as
    tritonclient sends it) true asks for chunks."""
    parameter = request.parameters.get("stream")
    if parameter is not None and parameter.WhichOneof("parameter_choice") == "bool_param":
        return bool(parameter.bool_param)
    if not any(t.name == "stream" and t.datatype == "BOOL" for t in request.inputs):
        return False
    return bool(codec.decode_request_inputs(request)["stream"].all())


def tensor_metadata(specs: Sequence[Any]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
    return [
        pb.ModelMetadataResponse.TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape)
        for s in specs
    ]


class Health:
    """The standard ``grpc.health.v1.Health`` service, so Kubernetes ``grpc`` probes work.

    Service ``""`` follows the data plane's readiness (checked every ``interval_s``);
    ``"liveness"`` is SERVING for as long as the process serves at all. On shutdown both
    turn NOT_SERVING at once, before in-flight work is finished.
    """

    LIVENESS: Final = "liveness"

    def __init__(
        self, server: grpc.aio.Server, ready: Callable[[], bool], *, interval_s: float = 0.5
    ) -> None:
        from grpc_health.v1 import health, health_pb2_grpc

        self._servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self._ready = ready
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._set(self.LIVENESS, serving=True)
        await self._set("", serving=self._ready())
        self._task = asyncio.create_task(self._follow(), name="stratus-health")

    async def _follow(self) -> None:
        current = self._ready()
        while True:
            await asyncio.sleep(self._interval_s)
            now = self._ready()
            if now != current:
                await self._set("", serving=now)
                current = now

    async def _set(self, service: str, *, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._servicer.set(service, status)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._servicer.enter_graceful_shutdown()
