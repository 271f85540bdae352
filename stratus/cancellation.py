"""Cancels that a library swallowed, raised again.

Python 3.11's ``asyncio.wait_for`` returns the awaited result instead of raising when a cancel
meets that result's arrival (gh-86296; 3.12 rebuilt ``wait_for`` on ``asyncio.timeout`` and
fixed it). nats-py awaits every request that way, so a task cancelled at that moment runs on
as if it had never been: a loop then outlives the ``close()`` that cancelled it, and the
``close()``, waiting for it, never returns (CI hung five minutes in a lease test so). The
task still counts the request (``Task.cancelling()``), so the loss can be seen and undone.
Stratus's own code uses ``asyncio.timeout`` instead (ruff's banned-api rule refuses
``asyncio.wait_for``); what calls into a library that may still use it goes through here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class CancelWatch:
    """Notes the current task's cancel requests now; :meth:`check` raises one made since and lost.

    A cancel that reached the task as ``CancelledError`` ends the awaits it passes through, so
    a request counted but not raised at a :meth:`check` is one something swallowed. Take the
    watch before the awaits it covers: a task already cleaning up after a cancel (its count
    already up) raises only for a new one."""

    __slots__ = ("_seen", "_task")

    def __init__(self) -> None:
        self._task = asyncio.current_task()
        self._seen = self._task.cancelling() if self._task is not None else 0

    def check(self) -> None:
        if self._task is not None and self._task.cancelling() > self._seen:
            raise asyncio.CancelledError("cancelled (the cancel was swallowed by a library's wait_for)")


async def keeping_cancel(awaitable: Awaitable[T]) -> T:
    """``await awaitable``, raising the cancel it may have swallowed instead of returning."""
    watch = CancelWatch()
    result = await awaitable
    watch.check()
    return result
