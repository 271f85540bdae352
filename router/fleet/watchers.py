"""Fleet.Watch's side of the registry: a queue per open Watch call, told of each change.

A queue holds at most one notice: a watcher that has not read the last change yet is sent
the fleet's status as it is when it reads, not every change in between, so a slow reader
costs the router nothing more than its queue.
"""

from __future__ import annotations

import asyncio

from stratus.errors import Overloaded

# Fleet.Watch calls open at once (each holds a stream and is sent the fleet's status).
MAX_WATCHERS = 64
# ... beyond which only operators may open more, up to this many in all (strangers filling the
# 64 once locked the operator out of Watch, security2 N16), and what one address may hold.
MAX_OPERATOR_WATCHERS = 80
MAX_WATCHERS_PER_ADDRESS = 16


class Watchers:
    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[None]] = set()
        self._address: dict[int, str] = {}  # each watcher's client address, by id(queue)

    def watch(self, *, address: str = "", operator: bool = False) -> asyncio.Queue[None]:
        """A queue told of each change; RESOURCE_EXHAUSTED past MAX_WATCHERS at once (an
        operator's past MAX_OPERATOR_WATCHERS), or past MAX_WATCHERS_PER_ADDRESS from one address
        that is not an operator's."""
        most = MAX_OPERATOR_WATCHERS if operator else MAX_WATCHERS
        if len(self._queues) >= most:
            raise Overloaded(f"{len(self._queues)} Watch calls are open, the most this router serves")
        held = sum(1 for a in self._address.values() if a == address)
        if not operator and held >= MAX_WATCHERS_PER_ADDRESS:
            raise Overloaded(f"this address holds {held} Watch calls, the most one may")
        queue: asyncio.Queue[None] = asyncio.Queue(maxsize=1)
        self._queues.add(queue)
        self._address[id(queue)] = address
        return queue

    def unwatch(self, queue: asyncio.Queue[None]) -> None:
        self._queues.discard(queue)
        self._address.pop(id(queue), None)

    def changed(self) -> None:
        for queue in self._queues:
            if queue.empty():
                queue.put_nowait(None)
