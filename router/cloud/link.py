"""The router's link to the cloud: a Stratus cloud gateway, or any OIP server (Triton,
KServe, MLServer).

Escalations are multiplexed by request id over one long-lived ModelStreamInfer stream
where the cloud has the protocol's stream; where it has none (KServe answers UNIMPLEMENTED)
or another one (MLServer's answers ModelInferResponse, one model per stream), each
escalation is a unary ModelInfer (the calls themselves, and what is in flight on them:
:mod:`router.cloud.calls`). A stream that breaks, or a connection that closes, fails
every escalation on it (the data plane then answers with the best lower-tier result,
marked degraded) and is re-opened with backoff. What the cloud serves is learnt each time
the link opens, and again whenever agents bring new families: from RepositoryIndex where
the cloud allows it, and from ModelReady/ModelMetadata for the names the families and the
operator give (see :mod:`router.cloud.models`). Every call carries the operator's headers
(``--cloud-header``: Triton's access token, an ingress's bearer token).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Coroutine, Sequence
from enum import StrEnum
from typing import Any

import grpc

from router.cloud.breaker import CircuitBreaker
from router.cloud.calls import CloudCalls, OnChunk
from router.cloud.catalog import CloudCatalog, Families, Headers
from router.cloud.models import NamedModel
from router.cloud.replies import call_error, described, judged, on_the_wire, refused_at_once, server_of
from stratus.convert.work import Reloaded, reloaded_from_wire
from stratus.errors import ConfigError, DeadlineExceeded, Overloaded, StratusError, Unavailable
from stratus.families.description import FamilyDescription
from stratus.obs.stats import LatencyWindow
from stratus.serving.channels import NO_TLS, TlsSettings, open_channel, server_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.cloud-link")

# OnChunk is the calls' (router.cloud.calls), named here too for those who take the link's.
__all__ = ["RECONNECT_OPTIONS", "UNMEASURED_MS", "CloudLink", "LinkState", "OnChunk"]
STREAM = "stream"
UNARY = "unary"


class LinkState(StrEnum):
    CONNECTING = "connecting"  # not connected yet since the router started
    CONNECTED = "connected"
    DOWN = "down"  # was connected, or was refused; redialling with backoff


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
        self.state = LinkState.CONNECTING
        self.transport = STREAM
        self.latency = LatencyWindow()
        self._rng = rng or random.Random()
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._headers: Headers = tuple(headers)
        self._calls = CloudCalls(address, self._headers, self.latency, channel=lambda: self._channel)
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

    @property
    def named(self) -> tuple[NamedModel, ...]:
        """The models ``--cloud-models`` named, with the family each answers where it says."""
        return self._named

    @property
    def available(self) -> bool:
        return self.state == LinkState.CONNECTED and self.breaker.allows() and self.in_flight < self.max_pending

    @property
    def in_flight(self) -> int:
        """Escalations waiting on the shared stream or a unary call, and generations streaming."""
        return self._calls.in_flight

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
        return self.breaker.state if self.state == LinkState.CONNECTED else "open"

    @property
    def status(self) -> str:
        """What `stratus fleet status` shows: the link's state, or the breaker's when open."""
        if self.state == LinkState.CONNECTED and self.breaker.state != "closed":
            return f"circuit {self.breaker.state}"
        return self.state

    def gateways(self) -> tuple[CloudLink, ...]:
        """A link is a cloud tier of one gateway: itself."""
        return (self,)

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
            self.state = LinkState.DOWN
            self._calls.fail_waiting("the cloud link broke")
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
        self.state = LinkState.CONNECTED
        self.breaker.success()  # a fresh link to a live cloud: stop failing fast
        log.info("cloud link to %s connected (%s)", self.address, transport)

    async def reload(self, *, timeout_s: float) -> Reloaded:
        """Ask a Stratus cloud gateway to reload its models folder, with the link's credential."""
        if self._channel is None:
            raise Unavailable(f"cloud {self.address} is {self.status}")
        stub = fpb_grpc.CloudGatewayStub(self._channel)
        try:
            answer = await stub.Reload(fpb.GatewayReloadRequest(), timeout=timeout_s, metadata=self._headers)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise ConfigError(
                    f"cloud {self.address} ({self.server or 'unknown server'}) is not a Stratus cloud "
                    "gateway: it has no Reload; load new models its own way"
                ) from None
            raise call_error(exc, timeout_s) from None
        return reloaded_from_wire(answer)

    async def learn_now(self) -> None:
        """Learn what the cloud serves now (after it reloaded), where the link is up."""
        if self._channel is None or self.state != LinkState.CONNECTED:
            raise Unavailable(
                f"cloud {self.address} is {self.status}: what it serves is learnt when it is back"
            )
        await self._learn_models(pb_grpc.GRPCInferenceServiceStub(self._channel))

    # -- transports ------------------------------------------------------------------------
    async def _serve_stream(
        self, stub: pb_grpc.GRPCInferenceServiceAsyncStub, channel: grpc.aio.Channel, server: str
    ) -> None:
        """Escalations over one ModelStreamInfer stream; a cloud that has none gets unary calls."""
        call = self._calls.open_stream(stub)
        try:
            if await refused_at_once(call):
                log.info("cloud %s (%s) has no ModelStreamInfer: unary ModelInfer", self.address, server)
                self._no_stream = server
                await self._serve_unary(channel)
                return
            self._connected(STREAM)
            await self._calls.answer_from(call)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # refused late: unary from the next connect
                self._no_stream = server
            raise
        finally:
            self._calls.end_stream()
        raise Unavailable("the cloud ended the stream")

    async def _serve_unary(self, channel: grpc.aio.Channel) -> None:
        """Unary calls need no stream; the link is up while the channel's connection is."""
        self._connected(UNARY)
        state = channel.get_state()
        while state == grpc.ChannelConnectivity.READY:
            await channel.wait_for_state_change(state)
            state = channel.get_state()
        raise Unavailable(f"the connection to the cloud closed ({state.name})")

    # -- escalations -----------------------------------------------------------------------
    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        asked = on_the_wire(request, self.wire_names)
        exchange = self._calls.exchange if self.transport == STREAM else self._calls.unary
        response = await self._guarded(exchange(asked, timeout_s))
        response.id = request.id
        families = self._families()
        judged(response, families.get(request.model_name) or families.get(response.model_name), asked.model_name)
        return response

    async def generate(
        self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        """A generation streamed back as the cloud makes it: each chunk to ``on_chunk`` as
        it arrives, then the final response (finish reason, confidence, variant). It has a
        call of its own (:meth:`CloudCalls.generation`); a cloud with no stream answers it whole.
        """
        asked = on_the_wire(request, self.wire_names)
        generation = self._calls.whole if self.transport == UNARY else self._calls.generation
        return await self._guarded(generation(asked, on_chunk, timeout_s))

    async def _guarded(self, call: Coroutine[Any, Any, pb.ModelInferResponse]) -> pb.ModelInferResponse:
        """Refuse at once while the link is down, full or its breaker open; feed the breaker."""
        try:
            if self.state != LinkState.CONNECTED or not self.breaker.allows():
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
