"""The router's link to the cloud: a Stratus cloud gateway, or any OIP server (Triton,
KServe, MLServer).

Escalations are multiplexed by request id over one long-lived ModelStreamInfer stream
where the cloud has the protocol's stream; where it has none (KServe answers UNIMPLEMENTED)
or another one (MLServer's answers ModelInferResponse, one model per stream), each
escalation is a unary ModelInfer. A stream that breaks, or a connection that closes, fails
every escalation on it (the data plane then answers with the best lower-tier result,
marked degraded) and is re-opened with backoff. What the cloud serves is learnt each time
the link opens, and again whenever agents bring new families: from RepositoryIndex where
the cloud allows it, and from ModelReady/ModelMetadata for the names the families and the
operator give (see :mod:`router.cloud.models`). Every call carries the operator's headers
(``--cloud-header``: Triton's access token, an ingress's bearer token).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import grpc

from router.cloud.breaker import CircuitBreaker
from router.cloud.catalog import CloudCatalog, Families, Headers
from router.cloud.models import NamedModel
from router.cloud.replies import (
    call_error,
    chunk_of,
    described,
    is_final,
    judged,
    on_the_wire,
    refused_at_once,
    server_of,
)
from stratus.convert.errors import error_from_stream
from stratus.errors import ConfigError, DeadlineExceeded, Overloaded, StratusError, Unavailable
from stratus.families.description import FamilyDescription
from stratus.families.generation import STREAM as STREAM_PARAMETER
from stratus.families.generation import Chunk
from stratus.obs.stats import LatencyWindow
from stratus.sched.streams import until_none
from stratus.serving.channels import NO_TLS, TlsSettings, check_fits, open_channel, server_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.cloud-link")

OnChunk = Callable[[Chunk], Awaitable[None]]
STREAM = "stream"
UNARY = "unary"
# Servers whose ModelStreamInfer is not the protocol's: MLServer's answers ModelInferResponse
# (read as ModelStreamInferResponse, its model name lands in error_message) and binds the
# stream to the first request's model.
OWN_STREAM = frozenset({"mlserver"})
UNMEASURED_MS = 5.0  # a cloud not measured yet is taken to be as cheap as a near one

# How fast the channel to the cloud redials after losing it: gRPC's defaults (1 s, growing
# to 120 s) would keep escalations degraded long after the gateway is back.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


class CloudLink(CloudCatalog):
    def __init__(
        self,
        address: str,
        *,
        tls: TlsSettings = NO_TLS,
        rng: random.Random | None = None,
        max_pending: int = 512,
        breaker: CircuitBreaker | None = None,
        headers: Sequence[tuple[str, str]] = (),
        named: Sequence[NamedModel] = (),
        families: Families = dict,
        server_name: str | None = None,
    ) -> None:
        self.address = address
        self._server_name = server_name  # what a TLS certificate must name, if not the address
        self._tls = tls
        self.max_pending = max_pending
        self.breaker = breaker or CircuitBreaker()
        self.state = "connecting"
        self.transport = STREAM
        self.latency = LatencyWindow()
        self._rng = rng or random.Random()
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[pb.ModelStreamInferResponse]] = {}
        self._outbox: asyncio.Queue[pb.ModelInferRequest | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._headers: Headers = tuple(headers)
        self._named = tuple(named)
        self._families = families
        self._learnt_for: frozenset[str] | None = None
        self._no_stream: str | None = None  # the server (name version) that refused the stream
        self.server = ""  # "name version", as its ServerMetadata said when the link last opened
        self.models: dict[str, bool] = {}
        self.wire_names: dict[str, str] = {}  # a request's model -> the name the cloud serves it under
        self.variants: dict[str, str] = {}  # a request's model -> what answers it there (fleet status)
        self.generative: dict[str, FamilyDescription] = {}  # the cloud's text models, as families
        # Each name in ``models`` as the cloud's own metadata describes it (cloud_models.descriptions).
        self.described: dict[str, FamilyDescription] = {}
        self._generating = 0

    @property
    def named(self) -> tuple[NamedModel, ...]:
        """The models ``--cloud-models`` named, with the family each answers where it says."""
        return self._named

    @property
    def available(self) -> bool:
        return self.state == "connected" and self.breaker.allows() and self.in_flight < self.max_pending

    @property
    def in_flight(self) -> int:
        """Escalations waiting on the shared stream or a unary call, and generations streaming."""
        return len(self._pending) + self._generating

    @property
    def capacity(self) -> int:
        return self.max_pending

    @property
    def predicted_ms(self) -> float:
        """What the next call should take: the measured mean, or a near cloud's until measured."""
        return self.latency.mean_ms or UNMEASURED_MS

    @property
    def circuit(self) -> str:
        """The breaker's state; a link that is down refuses at once, as an open breaker does."""
        return self.breaker.state if self.state == "connected" else "open"

    @property
    def status(self) -> str:
        """What `stratus fleet status` shows: the link's state, or the breaker's when open."""
        if self.state == "connected" and self.breaker.state != "closed":
            return f"circuit {self.breaker.state}"
        return self.state

    def start(self) -> None:
        self._task = asyncio.create_task(self._maintain(), name="stratus-cloud-link")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()

    async def _maintain(self) -> None:
        """Keep the link open; after a break, re-open it as soon as the cloud is back.

        The channel reconnects on its own with a short backoff (RECONNECT_*), and the link
        waits for it to turn READY rather than sleeping a growing delay of its own, so a
        returning cloud serves escalations within a second of listening again.
        """
        options = [*RECONNECT_OPTIONS, *server_options("cloud", self._tls, self._server_name)]
        self._channel = open_channel(self.address, self._tls, extra_options=options)
        delay = 0.05
        while True:
            try:
                await self._channel.channel_ready()
                await self._connect_and_serve(self._channel)
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cloud link to %s: %s", self.address, described(exc))
            self.state = "down"
            self._fail_pending("the cloud link broke")
            # Only a cloud that answers yet refuses the link gets here twice in a row.
            await asyncio.sleep(self._rng.uniform(delay / 2, delay))
            delay = min(delay * 2, 1.0)

    async def _connect_and_serve(self, channel: grpc.aio.Channel) -> None:
        """Learn what the cloud serves, then carry escalations until the link breaks, while
        following the families that agents bring."""
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await stub.ServerLive(pb.ServerLiveRequest(), timeout=2.0, metadata=self._headers)
        server = self.server = await server_of(stub, self._headers)
        self._learnt_for = None
        await self._learn_models(stub)
        following = asyncio.create_task(self._follow_families(stub), name="stratus-cloud-families")
        try:
            if server.split()[0] in OWN_STREAM or server == self._no_stream:
                await self._serve_unary(channel)
            else:
                await self._serve_stream(stub, channel, server)
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)

    def _connected(self, transport: str) -> None:
        self.transport = transport
        self.state = "connected"
        self.breaker.success()  # a fresh link to a live cloud: stop failing fast
        log.info("cloud link to %s connected (%s)", self.address, transport)

    async def reload(self, *, timeout_s: float) -> fpb.ReloadResponse:
        """Ask a Stratus cloud gateway to reload its models folder, with the link's credential."""
        if self._channel is None:
            raise Unavailable(f"cloud {self.address} is {self.status}")
        stub = fpb_grpc.CloudGatewayStub(self._channel)
        try:
            return await stub.Reload(fpb.GatewayReloadRequest(), timeout=timeout_s, metadata=self._headers)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise ConfigError(
                    f"cloud {self.address} ({self.server or 'unknown server'}) is not a Stratus cloud "
                    "gateway: it has no Reload; load new models its own way"
                ) from None
            raise call_error(exc, timeout_s) from None

    async def learn_now(self) -> None:
        """Learn what the cloud serves now (after it reloaded), where the link is up."""
        if self._channel is None or self.state != "connected":
            raise Unavailable(
                f"cloud {self.address} is {self.status}: what it serves is learnt when it is back"
            )
        await self._learn_models(pb_grpc.GRPCInferenceServiceStub(self._channel))

    # -- transports ------------------------------------------------------------------------
    async def _serve_stream(
        self, stub: pb_grpc.GRPCInferenceServiceAsyncStub, channel: grpc.aio.Channel, server: str
    ) -> None:
        """Escalations over one ModelStreamInfer stream; a cloud that has none gets unary calls."""
        self._outbox = asyncio.Queue()
        call = stub.ModelStreamInfer(until_none(self._outbox), metadata=self._headers)
        try:
            if await refused_at_once(call):
                log.info("cloud %s (%s) has no ModelStreamInfer: unary ModelInfer", self.address, server)
                self._no_stream = server
                await self._serve_unary(channel)
                return
            self._connected(STREAM)
            async for message in call:
                future = self._pending.pop(message.infer_response.id, None)
                if future is not None and not future.done():
                    future.set_result(message)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # refused late: unary from the next connect
                self._no_stream = server
            raise
        finally:
            self._outbox.put_nowait(None)
        raise Unavailable("the cloud ended the stream")

    async def _serve_unary(self, channel: grpc.aio.Channel) -> None:
        """Unary calls need no stream; the link is up while the channel's connection is."""
        self._connected(UNARY)
        state = channel.get_state()
        while state == grpc.ChannelConnectivity.READY:
            await channel.wait_for_state_change(state)
            state = channel.get_state()
        raise Unavailable(f"the connection to the cloud closed ({state.name})")

    def _fail_pending(self, reason: str) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable(f"cloud {self.address}: {reason}"))
        self._pending.clear()

    # -- escalations -----------------------------------------------------------------------
    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        asked = on_the_wire(request, self.wire_names)
        exchange = self._exchange if self.transport == STREAM else self._call
        response = await self._guarded(exchange(asked, timeout_s))
        response.id = request.id
        families = self._families()
        judged(response, families.get(request.model_name) or families.get(response.model_name), asked.model_name)
        return response

    async def _call(self, request: pb.ModelInferRequest, timeout_s: float | None) -> pb.ModelInferResponse:
        """One escalation as a unary ModelInfer (a cloud with no stream of the protocol's)."""
        assert self._channel is not None
        stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        started = time.perf_counter()
        self._generating += 1  # counts toward max_pending, like an escalation on the stream
        try:
            response = await stub.ModelInfer(request, timeout=timeout_s, metadata=self._headers)
        except grpc.aio.AioRpcError as exc:
            raise call_error(exc, timeout_s) from None
        finally:
            self._generating -= 1
        self.latency.add((time.perf_counter() - started) * 1000.0)
        return response

    async def generate(
        self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        """A generation streamed back as the cloud makes it: each chunk to ``on_chunk`` as
        it arrives, then the final response (finish reason, confidence, variant).

        Each generation has a ModelStreamInfer call of its own on the link's channel (not
        the shared stream), so that cancelling it (a client gone, a budget spent) ends the
        cloud's generation at once: the call's cancellation reaches the gateway's handler.
        A cloud with no stream answers the generation whole, as one chunk.
        """
        asked = on_the_wire(request, self.wire_names)
        if self.transport == UNARY:
            return await self._guarded(self._whole(asked, on_chunk, timeout_s))
        return await self._guarded(self._stream(asked, on_chunk, timeout_s))

    async def _whole(
        self, request: pb.ModelInferRequest, on_chunk: OnChunk, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        response = await self._call(request, timeout_s)
        chunk = chunk_of(response)
        if chunk.tokens:
            await on_chunk(chunk)
        response.id = request.id
        return response

    async def _guarded(self, call: Coroutine[Any, Any, pb.ModelInferResponse]) -> pb.ModelInferResponse:
        """Refuse at once while the link is down, full or its breaker open; feed the breaker."""
        try:
            if self.state != "connected" or not self.breaker.allows():
                raise Unavailable(f"cloud {self.address} is {self.status}")
            if self.in_flight >= self.max_pending:
                raise Overloaded(f"cloud link queue is full ({self.max_pending} escalations in flight)")
        except StratusError:
            call.close()
            raise
        self.breaker.before_call()
        try:
            response = await call
        except (Unavailable, DeadlineExceeded):
            self.breaker.failure()
            raise
        except StratusError:
            self.breaker.success()  # the cloud answered; the request itself was bad
            raise
        self.breaker.success()
        return response

    async def _stream(
        self, request: pb.ModelInferRequest, on_chunk: OnChunk, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        assert self._channel is not None
        stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        asked = pb.ModelInferRequest()
        asked.CopyFrom(request)
        asked.parameters[STREAM_PARAMETER].bool_param = True
        started = time.perf_counter()
        call = stub.ModelStreamInfer(iter([asked]), timeout=timeout_s, metadata=self._headers)
        self._generating += 1  # counts toward max_pending, like an escalation on the stream
        try:
            async for message in call:
                if message.error_message:
                    raise error_from_stream(message, "cloud")
                response = message.infer_response
                chunk = chunk_of(response)
                if chunk.tokens:  # the final message may carry the last tokens, or none
                    await on_chunk(chunk)
                if is_final(response):
                    self.latency.add((time.perf_counter() - started) * 1000.0)
                    response.id = request.id
                    return response
        except grpc.aio.AioRpcError as exc:
            raise call_error(exc, timeout_s) from None
        finally:
            call.cancel()  # a no-op once the call ended; otherwise the gateway stops generating
            self._generating -= 1
        raise Unavailable("the cloud gateway ended a generation without its final response")

    async def _exchange(
        self, request: pb.ModelInferRequest, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        wire_id = f"c{next(self._ids)}"
        forwarded = pb.ModelInferRequest()
        forwarded.CopyFrom(request)
        forwarded.id = wire_id
        check_fits(forwarded.ByteSize(), "this escalation")  # over the limit, it would end the shared stream
        future: asyncio.Future[pb.ModelStreamInferResponse] = asyncio.get_running_loop().create_future()
        self._pending[wire_id] = future
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._outbox.put_nowait(forwarded)
        try:
            async with asyncio.timeout(timeout_s):
                message = await future
        except TimeoutError:
            raise DeadlineExceeded(f"cloud did not answer within {(timeout_s or 0) * 1000:.1f} ms") from None
        finally:
            self._pending.pop(wire_id, None)
        self.latency.add((loop.time() - started) * 1000.0)
        if message.error_message:
            raise error_from_stream(message, "cloud")
        return message.infer_response
