"""The calls that carry a cloud link's escalations and generations, once the link is up.

:class:`~router.cloud.link.CloudLink` keeps the link open, picks its transport and decides
whether a call may go at all (its state, its breaker, its queue); :class:`CloudCalls` carries
the call that it lets go. Escalations share one ModelStreamInfer stream, each answer matched
to its request by an id of the link's own, or are one unary ModelInfer each; a generation has
a ModelStreamInfer call of its own. Apart from the link's life, the carrying keeps what the
link's load and its cost are read from: what is in flight and how long each round trip took.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable

import grpc

from router.cloud.catalog import Headers
from router.cloud.replies import call_error, chunk_of, is_final
from stratus.convert.errors import error_from_stream
from stratus.errors import DeadlineExceeded, Unavailable
from stratus.families.generation import STREAM as STREAM_PARAMETER
from stratus.families.generation import Chunk
from stratus.obs.stats import LatencyWindow
from stratus.sched.streams import until_none
from stratus.serving.channels import check_fits
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

OnChunk = Callable[[Chunk], Awaitable[None]]
SharedStream = grpc.aio.StreamStreamCall[pb.ModelInferRequest, pb.ModelStreamInferResponse]


class CloudCalls:
    """The calls in flight to one cloud over the channel ``channel()`` gives while the link
    holds one: escalations waiting on the shared stream, and the calls of their own (unary
    escalations, generations). Each round trip is added to ``latency``; ``address`` and
    ``headers`` name the cloud and go with every call."""

    def __init__(
        self,
        address: str,
        headers: Headers,
        latency: LatencyWindow,
        *,
        channel: Callable[[], grpc.aio.Channel | None],
    ) -> None:
        self._address, self._headers, self._latency, self._channel = address, headers, latency, channel
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[pb.ModelStreamInferResponse]] = {}  # by the id sent
        self._outbox: asyncio.Queue[pb.ModelInferRequest | None] = asyncio.Queue()
        self._own = 0  # calls of their own running: unary escalations and generations

    @property
    def in_flight(self) -> int:
        """Escalations waiting on the shared stream, and the calls of their own running."""
        return len(self._pending) + self._own

    # -- the shared stream -------------------------------------------------------------------
    def open_stream(self, stub: pb_grpc.GRPCInferenceServiceAsyncStub) -> SharedStream:
        """The shared stream, sending what :meth:`exchange` queues until :meth:`end_stream`."""
        self._outbox = asyncio.Queue()
        return stub.ModelStreamInfer(until_none(self._outbox), metadata=self._headers)

    async def answer_from(self, call: SharedStream) -> None:
        """Each answer on the shared stream to the escalation waiting on its id, until it ends."""
        async for message in call:
            future = self._pending.pop(message.infer_response.id, None)
            if future is not None and not future.done():
                future.set_result(message)

    def end_stream(self) -> None:
        self._outbox.put_nowait(None)

    def fail_waiting(self, reason: str) -> None:
        """Every escalation still waiting on the shared stream fails: the stream is gone."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable(f"cloud {self._address}: {reason}"))
        self._pending.clear()

    async def exchange(self, request: pb.ModelInferRequest, timeout_s: float | None) -> pb.ModelInferResponse:
        """One escalation on the shared stream, under an id of the link's own."""
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
        self._latency.add((loop.time() - started) * 1000.0)
        if message.error_message:
            raise error_from_stream(message, "cloud")
        return message.infer_response

    # -- calls of their own ------------------------------------------------------------------
    def _stub(self) -> pb_grpc.GRPCInferenceServiceAsyncStub:
        channel = self._channel()
        assert channel is not None
        return pb_grpc.GRPCInferenceServiceStub(channel)

    async def unary(self, request: pb.ModelInferRequest, timeout_s: float | None) -> pb.ModelInferResponse:
        """One escalation as a unary ModelInfer (a cloud with no stream of the protocol's)."""
        stub = self._stub()
        started = time.perf_counter()
        self._own += 1  # counts toward max_pending, like an escalation on the stream
        try:
            response = await stub.ModelInfer(request, timeout=timeout_s, metadata=self._headers)
        except grpc.aio.AioRpcError as exc:
            raise call_error(exc, timeout_s) from None
        finally:
            self._own -= 1
        self._latency.add((time.perf_counter() - started) * 1000.0)
        return response

    async def whole(
        self, request: pb.ModelInferRequest, on_chunk: OnChunk, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        """A generation from a cloud with no stream: answered whole, as one chunk."""
        response = await self.unary(request, timeout_s)
        chunk = chunk_of(response)
        if chunk.tokens:
            await on_chunk(chunk)
        response.id = request.id
        return response

    async def generation(
        self, request: pb.ModelInferRequest, on_chunk: OnChunk, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        """A generation on a ModelStreamInfer call of its own (not the shared stream), so that
        cancelling it (a client gone, a budget spent) ends the cloud's generation at once: the
        call's cancellation reaches the gateway's handler."""
        stub = self._stub()
        asked = pb.ModelInferRequest()
        asked.CopyFrom(request)
        asked.parameters[STREAM_PARAMETER].bool_param = True
        started = time.perf_counter()
        call = stub.ModelStreamInfer(iter([asked]), timeout=timeout_s, metadata=self._headers)
        self._own += 1  # counts toward max_pending, like an escalation on the stream
        try:
            async for message in call:
                if message.error_message:
                    raise error_from_stream(message, "cloud")
                response = message.infer_response
                chunk = chunk_of(response)
                if chunk.tokens:  # the final message may carry the last tokens, or none
                    await on_chunk(chunk)
                if is_final(response):
                    self._latency.add((time.perf_counter() - started) * 1000.0)
                    response.id = request.id
                    return response
        except grpc.aio.AioRpcError as exc:
            raise call_error(exc, timeout_s) from None
        finally:
            call.cancel()  # a no-op once the call ended; otherwise the gateway stops generating
            self._own -= 1
        raise Unavailable("the cloud gateway ended a generation without its final response")
