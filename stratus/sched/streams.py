"""A producer that hands out items through a callback, read as an async iterator.

Generations report their chunks through a callback (``on_chunk``) while they run, and end
with a result; a streamed answer wants to iterate the chunks. The bridge (a task, a queue, a
sentinel) was written once per data plane, and the copies cancelled differently: one let its
cancelled task run on unwatched. Here it is written once, with one rule: a reader that stops
early (cancelled, or gone) cancels the producer and waits for it to end, so nothing it holds
outlives the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

OnItem = Callable[[Item], Awaitable[None]]


class Relay(Generic[Item, Result]):
    """One running producer: its items as they come, then its result (or its error)."""

    def __init__(self, produce: Callable[[OnItem[Item]], Awaitable[Result]]) -> None:
        self._items: asyncio.Queue[Item | None] = asyncio.Queue()

        async def run() -> Result:
            return await produce(self._put)

        self.task: asyncio.Task[Result] = asyncio.create_task(run(), name="stratus-producer")
        self.task.add_done_callback(lambda _: self._items.put_nowait(None))

    async def _put(self, item: Item) -> None:
        self._items.put_nowait(item)

    async def items(self) -> AsyncIterator[Item]:
        """Each item the producer handed out, in order, until it ended."""
        while (item := await self._items.get()) is not None:
            yield item

    def result(self) -> Result:
        """What the producer returned, once :meth:`items` has ended; its error is raised here."""
        return self.task.result()

    async def stop(self) -> None:
        """Cancel a producer still running, and wait until it has ended."""
        if not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


@contextlib.asynccontextmanager
async def relayed(produce: Callable[[OnItem[Item]], Awaitable[Result]]) -> AsyncIterator[Relay[Item, Result]]:
    """Run ``produce(on_item)`` in a task for the block; leaving the block early stops it."""
    relay = Relay(produce)
    try:
        yield relay
    finally:
        await relay.stop()


async def until_none(queue: asyncio.Queue[Item | None]) -> AsyncIterator[Item]:
    """A queue's items as a stream (a gRPC call's requests), ending at the None put to end it."""
    while (item := await queue.get()) is not None:
        yield item
