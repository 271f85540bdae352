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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import grpc

from stratus import codec
from stratus.errors import DeadlineExceeded, Overloaded, StratusError, Unavailable
from stratus.generation import FINAL, MAX_TOKENS, STREAM, TEXT_INPUT, TEXT_OUTPUT, Chunk
from stratus.serving import NO_TLS, TlsSettings, check_fits, open_channel
from stratus.stats import LatencyWindow
from stratus.status import error_from_status
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.cloud-link")

OnChunk = Callable[[Chunk], Awaitable[None]]
UNDECLARED_MAX_TOKENS = 16  # a text model whose config names no max_tokens: OpenAI's default

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
        self.generative: dict[str, fpb.FamilyInfo] = {}  # the cloud's text models, as families
        self._generating = 0

    @property
    def available(self) -> bool:
        return self.state == "connected" and self.breaker.allows() and self.in_flight < self.max_pending

    @property
    def in_flight(self) -> int:
        """Escalations waiting on the shared stream, and generations streaming on calls of their own."""
        return len(self._pending) + self._generating

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
        """What the cloud serves, and which of it generates text (so that a router with no
        agent for a generative family still serves it, the OpenAI API included)."""
        index = await stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=2.0)
        self.models = {model.name: model.state == "READY" for model in index.models}
        ready = [name for name, ok in self.models.items() if ok]
        # All at once: over a slow link to the cloud, one round trip per model in turn adds up.
        described = await asyncio.gather(*(self._describe(stub, name) for name in ready))
        self.generative = {info.name: info for info in described if info is not None}

    async def _describe(self, stub: pb_grpc.GRPCInferenceServiceAsyncStub, name: str) -> fpb.FamilyInfo | None:
        """A text model's description (its tensors and max_tokens); None for any other."""
        try:
            metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name=name), timeout=2.0)
            if not _generates(metadata):
                return None
            config = await stub.ModelConfig(pb.ModelConfigRequest(name=name), timeout=2.0)
        except grpc.aio.AioRpcError as exc:  # a server that will not describe a model: not a text one
            log.info("cloud %s: no description of %s (%s)", self.address, name, exc.code().name)
            return None
        return fpb.FamilyInfo(
            name=name,
            inputs=metadata.inputs,
            outputs=metadata.outputs,
            kind="generative",
            max_tokens=_max_tokens(config.config),
        )

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
        return await self._guarded(self._exchange(request, timeout_s))

    async def generate(
        self, request: pb.ModelInferRequest, on_chunk: OnChunk, *, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        """A generation streamed back as the cloud makes it: each chunk to ``on_chunk`` as
        it arrives, then the final response (finish reason, confidence, variant).

        Each generation has a ModelStreamInfer call of its own on the link's channel (not
        the shared stream), so that cancelling it (a client gone, a budget spent) ends the
        cloud's generation at once: the call's cancellation reaches the gateway's handler.
        """
        return await self._guarded(self._stream(request, on_chunk, timeout_s))

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
        asked.parameters[STREAM].bool_param = True
        started = time.perf_counter()
        call = stub.ModelStreamInfer(iter([asked]), timeout=timeout_s)
        self._generating += 1  # counts toward max_pending, like an escalation on the stream
        try:
            async for message in call:
                if message.error_message:
                    raise _stream_error(message.error_message)
                response = message.infer_response
                params = {k: v.string_param for k, v in response.parameters.items() if v.string_param}
                chunk = Chunk.from_parts(_text_output(response), params, final=False)
                if chunk.tokens:  # the final message may carry the last tokens, or none
                    await on_chunk(chunk)
                if _is_final(response):
                    self.latency.add((time.perf_counter() - started) * 1000.0)
                    response.id = request.id
                    return response
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(
                    f"cloud did not finish within {(timeout_s or 0) * 1000:.1f} ms"
                ) from None
            raise error_from_status(exc.code(), f"cloud: {exc.details()}") from None
        finally:
            call.cancel()  # a no-op once the call ended; otherwise the gateway stops generating
            self._generating -= 1
        raise Unavailable("the cloud gateway ended a generation without its final response")

    async def _exchange(
        self, request: pb.ModelInferRequest, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        wire_id = f"c{next(self._ids)}"
        original_id = request.id
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
            raise _stream_error(message.error_message)
        response = message.infer_response
        response.id = original_id
        return response


def _stream_error(message: str) -> StratusError:
    """A streamed error ("CODE: text", as the gateway writes it) as the error it names."""
    code_name, _, text = message.partition(": ")
    code = getattr(grpc.StatusCode, code_name, grpc.StatusCode.UNKNOWN)
    return error_from_status(code, f"cloud: {text or message}")


def _generates(metadata: pb.ModelMetadataResponse) -> bool:
    """A model that takes one prompt and gives text, as Triton's vLLM backend lays it out."""
    inputs = [(t.name, t.datatype) for t in metadata.inputs]
    outputs = [(t.name, t.datatype) for t in metadata.outputs]
    return inputs == [(TEXT_INPUT, "BYTES")] and outputs == [(TEXT_OUTPUT, "BYTES")]


def _max_tokens(config: pb.ModelConfig) -> int:
    """The ``max_tokens`` a generative model's config declares (a Stratus cloud gateway
    does); otherwise OpenAI's default for completions, 16."""
    parameter = config.parameters.get(MAX_TOKENS)
    try:
        declared = int(parameter.string_value) if parameter is not None else 0
    except ValueError:
        declared = 0
    return declared if declared > 0 else UNDECLARED_MAX_TOKENS


def _is_final(response: pb.ModelInferResponse) -> bool:
    parameter = response.parameters.get(FINAL)
    return parameter is not None and parameter.bool_param


def _text_output(response: pb.ModelInferResponse) -> str:
    """The response's ``text_output`` (one UTF-8 string), or "" when it has none."""
    outputs = codec.decode_response_outputs(response)
    values = outputs.get(TEXT_OUTPUT)
    if values is None or values.size == 0:
        return ""
    first = values.reshape(-1)[0]
    return first.decode("utf-8", "replace") if isinstance(first, bytes) else str(first)
