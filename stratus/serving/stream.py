"""One ModelStreamInfer stream, served: a reader task, a task per request, an ordered outbox,
and the windows that bound what a client that sends and never reads can make the server hold.
:class:`~stratus.serving.servicer.InferenceServicer` opens one per stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Final, Protocol

from stratus.convert.errors import stream_error
from stratus.convert.inference import InferRequest, InferResult
from stratus.convert.parameters import check_version
from stratus.convert.wire_scan import read_infer_request, request_header
from stratus.errors import DeadlineExceeded, InvalidInput, StratusError, drop_frames
from stratus.serving.channels import MAX_MESSAGE_BYTES
from stratus.serving.client_limits import IDLE_STREAMS_PER_CLIENT
from stratus.wire import inference_pb2 as pb

log = logging.getLogger("stratus.serving")


class Answering(Protocol):
    """What a stream's requests are answered by: a DataPlane (stratus.serving.servicer)."""

    async def infer(self, request: InferRequest, *, timeout_s: float | None) -> InferResult: ...

    def generate(self, request: InferRequest, *, timeout_s: float | None) -> AsyncIterator[InferResult]: ...

# Requests one ModelStreamInfer stream may have in flight before its reader waits.
STREAM_WINDOW: Final = 256
# ... and bytes of requests (two full-size messages), whichever runs out first.
STREAM_WINDOW_BYTES: Final = 2 * MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class _Header:
    """Who a request refused from its bytes was, for its error on the stream."""

    id: str
    model_name: str


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


class StreamSession:
    """One ModelStreamInfer stream: a reader task, one task per request, an ordered outbox.

    At most STREAM_WINDOW requests are read ahead of what has been written back: a slot is
    freed only when its answer has gone out, so a client that sends and never reads holds
    STREAM_WINDOW answers in memory at most, not every answer it asked for."""

    _DONE: Final = None

    def __init__(
        self,
        plane: Answering,
        requests: AsyncIterator[bytes],
        hold: Callable[[int], contextlib.AbstractContextManager[None]] = lambda items: contextlib.nullcontext(),
        record: Callable[[InferRequest, int, InferResult | None], None] | None = None,
        *,
        silent_s: float | None = None,
    ) -> None:
        self._plane = plane
        self._requests = requests
        self._silent_s = silent_s  # how long the stream may wait for its first request
        self._hold = hold  # the client's share of the server (ClientLimits)
        self._record = record  # Statistics.record
        self._outbox: asyncio.Queue[pb.ModelStreamInferResponse | _Answered | None] = asyncio.Queue()
        self._window = asyncio.Semaphore(STREAM_WINDOW)
        self._bytes = ByteWindow(STREAM_WINDOW_BYTES)
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StreamSession:
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
            requests = aiter(self._requests)
            first = await self._first(requests)
            if first is not None:
                await self._take(first)
                async for request in requests:
                    await self._take(request)
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            self._outbox.put_nowait(self._DONE)

    async def _first(self, requests: AsyncIterator[bytes]) -> bytes | None:
        """The stream's first request, or None when it ends without one; a stream that may not
        stay silent and sends nothing in time is closed, saying why."""
        if self._silent_s is None:
            return await anext(requests, None)
        try:
            async with asyncio.timeout(self._silent_s):
                return await anext(requests, None)
        except TimeoutError:
            raise DeadlineExceeded(
                f"this stream sent no request in {self._silent_s:g} s; the client holds more streams "
                f"than the {IDLE_STREAMS_PER_CLIENT} that may wait for their first request"
            ) from None

    async def _take(self, raw: bytes) -> None:
        await self._window.acquire()
        try:
            asked = InferRequest.from_wire(read_infer_request(raw))
        except InvalidInput as exc:
            model_name, request_id = request_header(raw)
            self._outbox.put_nowait(stream_error(_Header(id=request_id, model_name=model_name), exc))
            self._outbox.put_nowait(_Answered(0))
            return
        size = len(raw)
        await self._bytes.acquire(size)
        task = asyncio.create_task(self._answer(asked, size), name="stratus-stream-answer")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, request: InferRequest, size: int) -> None:
        started, answered = time.perf_counter_ns(), None
        try:
            check_version(request.model_name, request.model_version)
            with self._hold(request.items):
                if request.streams():  # decoupled: many responses, the last marked final
                    last = None
                    async for chunk in self._plane.generate(request, timeout_s=None):
                        self._outbox.put_nowait(pb.ModelStreamInferResponse(infer_response=chunk.to_wire()))
                        last = chunk
                    answered = last if last is not None else InferResult(model_name="", id="", outputs={})
                    return
                result = await self._plane.infer(request, timeout_s=None)
                self._outbox.put_nowait(pb.ModelStreamInferResponse(infer_response=result.to_wire()))
            answered = result
        except Exception as exc:  # one bad request must not end the stream for the others
            if not isinstance(exc, StratusError):
                log.exception("unexpected error in a streamed request")
            self._outbox.put_nowait(stream_error(request, exc))
            drop_frames(exc)  # a failed generation's task and frames hold each other (and the request)
        finally:
            if self._record is not None:
                self._record(request, started, answered)
            self._outbox.put_nowait(_Answered(size))
