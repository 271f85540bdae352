"""A bounded executor for blocking runtime calls, so they never run on the event loop.

Model runtimes block (and release the GIL while they compute). Work goes to a fixed
number of named threads; at most ``queue_limit`` more calls may wait for a thread, and
past that a call fails at once with :class:`~stratus.errors.Overloaded` instead of piling
up memory and latency behind a queue nobody can see.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from stratus.errors import Overloaded

P = ParamSpec("P")
T = TypeVar("T")


class BoundedExecutor:
    def __init__(self, *, name: str, workers: int, queue_limit: int) -> None:
        if workers < 1 or queue_limit < 0:
            raise ValueError("workers must be >= 1 and queue_limit >= 0")
        self.name = name
        self.workers = workers
        self.queue_limit = queue_limit
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._admitted = 0

    @property
    def in_flight(self) -> int:
        """Calls running or waiting for a thread."""
        return self._admitted

    @property
    def queued(self) -> int:
        return max(0, self._admitted - self.workers)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` on a worker thread; Overloaded when the queue is already full."""
        if self._admitted >= self.workers + self.queue_limit:
            raise Overloaded(
                f"{self.name} queue is full: {self.workers} running and {self.queue_limit} waiting"
            )
        self._admitted += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        finally:
            self._admitted -= 1

    def shutdown(self, *, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
