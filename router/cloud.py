"""The router's link to the cloud gateway: one long-lived ModelStreamInfer stream.

Escalations are multiplexed over the stream by request id; a stream that breaks fails
every escalation on it (the data plane then answers with the best lower-tier result,
marked degraded) and is re-opened with backoff. Which models the cloud serves is read
with RepositoryIndex each time the stream opens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Callable

import grpc

from stratus.errors import DeadlineExceeded, Overloaded, StratusError, Unavailable
from stratus.serving import NO_TLS, TlsSettings, open_channel
from stratus.stats import LatencyWindow
from stratus.status import error_from_status
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.cloud-link")

# How fast the channel to the cloud redials after losing it: gRPC's defaults (1 s, growing
# to 120 s) would keep escalations degraded long after the gateway is back.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


class CircuitBreaker:
    """Fail fast while the cloud keeps failing; probe it now and then to see it recover.

    Closed: calls flow. After ``threshold`` consecutive failures (errors or timeouts) it
    opens: calls are refused at once, so escalations answer degraded instead of piling up
    behind a cloud that is away. After a cooldown (doubling, capped) it is half-open: one
    probe call may pass; its success closes the breaker, its failure opens it again.
    """

    def __init__(
        self,
        *,
        threshold: int = 5,
        cooldown_s: float = 1.0,
        max_cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self._base_cooldown = cooldown_s
        self._max_cooldown = max_cooldown_s
        self._cooldown = cooldown_s
        self._clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self.probing = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        if self._clock() - self.opened_at < self._cooldown:
            return "open"
        return "half-open"

    def allows(self) -> bool:
        state = self.state
        return state == "closed" or (state == "half-open" and not self.probing)

    def before_call(self) -> None:
        if self.state == "half-open":
            self.probing = True

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.probing = False
        self._cooldown = self._base_cooldown

    def failure(self) -> None:
        self.failures += 1
        if self.state == "half-open" or self.failures >= self.threshold:
            if self.opened_at is not None:
                self._cooldown = min(self._cooldown * 2, self._max_cooldown)
            self.opened_at = self._clock()
            self.probing = False


class CloudLink:
    def __init__(
        self,
        address: str,
        *,
        tls: TlsSettings = NO_TLS,
        rng: random.Random | None = None,
        max_pending: int = 512,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.address = address
        self._tls = tls
        self.max_pending = max_pending
        self.breaker = breaker or CircuitBreaker()
        self.state = "connecting"
        self.latency = LatencyWindow()
        self._rng = rng or random.Random()
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[pb.ModelStreamInferResponse]] = {}
        self._outbox: asyncio.Queue[pb.ModelInferRequest | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self.models: dict[str, bool] = {}

    @property
    def available(self) -> bool:
        return self.state == "connected" and self.breaker.allows() and len(self._pending) < self.max_pending

    @property
    def status(self) -> str:
        """What `stratus fleet status` shows: the stream's state, or the breaker's when open."""
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
        """Keep the stream open; after a break, re-open it as soon as the cloud is back.

        The channel reconnects on its own with a short backoff (RECONNECT_*), and the link
        waits for it to turn READY rather than sleeping a growing delay of its own, so a
        returning cloud gateway serves escalations within a second of listening again.
        """
        self._channel = open_channel(self.address, self._tls, extra_options=RECONNECT_OPTIONS)
        delay = 0.05
        while True:
            try:
                await self._channel.channel_ready()
                await self._connect_and_pump(self._channel)
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cloud link to %s: %s", self.address, exc)
            self.state = "down"
            self._fail_pending("the cloud stream broke")
            # Only a cloud that answers yet refuses the stream gets here twice in a row.
            await asyncio.sleep(self._rng.uniform(delay / 2, delay))
            delay = min(delay * 2, 1.0)

    async def _connect_and_pump(self, channel: grpc.aio.Channel) -> None:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await stub.ServerLive(pb.ServerLiveRequest(), timeout=2.0)
        await self._learn_models(stub)
        self._outbox = asyncio.Queue()
        call = stub.ModelStreamInfer(self._outgoing(self._outbox))
        self.state = "connected"
        self.breaker.success()  # a fresh stream to a live gateway: stop failing fast
        log.info("cloud link to %s connected", self.address)
        try:
            async for message in call:
                future = self._pending.pop(message.infer_response.id, None)
                if future is not None and not future.done():
                    future.set_result(message)
        finally:
            self._outbox.put_nowait(None)
        raise Unavailable("the cloud gateway ended the stream")

    async def _learn_models(self, stub: pb_grpc.GRPCInferenceServiceAsyncStub) -> None:
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=2.0)
        self.models = {model.name: model.state == "READY" for model in index.models}

    @staticmethod
    async def _outgoing(
        outbox: asyncio.Queue[pb.ModelInferRequest | None],
    ) -> AsyncIterator[pb.ModelInferRequest]:
        while (request := await outbox.get()) is not None:
            yield request

    def _fail_pending(self, reason: str) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable(f"cloud {self.address}: {reason}"))
        self._pending.clear()

    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        if self.state != "connected" or not self.breaker.allows():
            raise Unavailable(f"cloud {self.address} is {self.status}")
        if len(self._pending) >= self.max_pending:
            raise Overloaded(f"cloud link queue is full ({self.max_pending} escalations in flight)")
        self.breaker.before_call()
        try:
            response = await self._exchange(request, timeout_s)
        except (Unavailable, DeadlineExceeded):
            self.breaker.failure()
            raise
        except StratusError:
            self.breaker.success()  # the cloud answered; the request itself was bad
            raise
        self.breaker.success()
        return response

    async def _exchange(
        self, request: pb.ModelInferRequest, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        wire_id = f"c{next(self._ids)}"
        original_id = request.id
        forwarded = pb.ModelInferRequest()
        forwarded.CopyFrom(request)
        forwarded.id = wire_id
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
            code_name, _, text = message.error_message.partition(": ")
            code = getattr(grpc.StatusCode, code_name, grpc.StatusCode.UNKNOWN)
            raise error_from_status(code, f"cloud: {text or message.error_message}")
        response = message.infer_response
        response.id = original_id
        return response
