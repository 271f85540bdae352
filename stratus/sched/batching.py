"""Dynamic batching: one object owns the queue in front of each target.

The router keeps one :class:`Batcher` per agent link, and every process that runs models
(an agent, the cloud gateway, the SDK) one per loaded set of runners. Requests that may
share a batch (same variant, same input datatypes and per-item shapes, same requested
outputs: one :class:`BatchKey`) and that wait while their target is busy are concatenated
along dimension 0, run as one batch, and split back per request, in order.

The rules, as Triton's dynamic batcher has them, adapted to a tiered path that must not
spend its latency budget waiting:

* When the target has a free slot, a request goes at once, alone if nothing waits: at low
  load batching adds nothing.
* While every slot is busy, requests wait and their batch grows, up to ``max_batch`` items.
  A target with room beyond its slots (an agent's own queue) is sent a waiting batch
  when it is full, when its oldest member has waited ``max_delay_s``, or when its
  tightest member's slack (``latest_start``) is reached, so the agent never idles
  between batches. Without such room, a batch waits for the next free slot.
* A member whose slack passes while no slot or room is free fails at once with
  :class:`~stratus.errors.DeadlineExceeded`, so its request can still be served elsewhere
  instead of running out its budget in this queue.
* Each member gets its own answer or its own error; a cancelled member leaves the queue,
  and a running batch whose members all left is cancelled.

:func:`plan` is the pure decision (queue state and a clock reading in, what to send and
when to look again out); :class:`Batcher` performs it on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from stratus.errors import DeadlineExceeded, Overloaded, StratusError

log = logging.getLogger("stratus.batching")

P = TypeVar("P")  # what a member carries (arrays, raw tensors)
R = TypeVar("R")  # what a member gets back

# How long a batch may wait for more members while its target is busy (--max-batch-delay-us).
DEFAULT_MAX_DELAY_S = 0.0005
DEFAULT_MAX_BATCH = 32


@dataclass(frozen=True)
class BatchKey:
    """What requests must share to run as one batch."""

    variant: str
    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, datatype, shape without dim 0)
    outputs: tuple[str, ...] = ()  # requested outputs; empty: all
    batchable: bool = True  # False: runs alone (variable-size BYTES tensors)


@dataclass(eq=False, kw_only=True)
class Member(Generic[P, R]):
    """One request waiting in (or running from) a batcher."""

    key: BatchKey
    payload: P
    size: int  # items along dimension 0
    enqueued: float
    latest_start: float | None  # past this, the member cannot meet its budget here
    future: asyncio.Future[R] = field(repr=False)
    batch: Batch[P, R] | None = None


@dataclass(eq=False, kw_only=True)
class Batch(Generic[P, R]):
    key: BatchKey
    members: list[Member[P, R]]
    task: asyncio.Task[None] | None = None

    @property
    def size(self) -> int:
        return sum(m.size for m in self.members)

    @property
    def payloads(self) -> list[P]:
        return [m.payload for m in self.members]

    @property
    def sizes(self) -> list[int]:
        return [m.size for m in self.members]


@dataclass(frozen=True, kw_only=True)
class Plan(Generic[P, R]):
    """What to do now: batches to send, members to fail, and when to look again."""

    send: list[list[Member[P, R]]]
    expire: list[Member[P, R]]
    wake_at: float | None


def plan(
    queue: Sequence[Member[P, R]],
    *,
    outstanding: int,
    slots: int,
    depth: int,
    now: float,
    max_batch: Callable[[BatchKey], int],
    max_delay_s: float,
) -> Plan[P, R]:
    """Decide what leaves the queue now; pure, so it is tested with any clock.

    ``outstanding`` batches are at the target, which runs ``slots`` at once and holds at
    most ``depth`` (``depth > slots``: the target has a queue of its own).
    """
    remaining = list(queue)
    send: list[list[Member[P, R]]] = []
    wake_at: float | None = None
    while remaining and outstanding < depth:
        batch = _gather(remaining, max_batch(remaining[0].key))
        closes_at = _closes_at(batch, max_delay_s)
        full = batch[0].key.batchable is False or sum(m.size for m in batch) >= max_batch(batch[0].key)
        if outstanding < slots or full or now >= closes_at:
            send.append(batch)
            outstanding += 1
            taken = {id(m) for m in batch}
            remaining = [m for m in remaining if id(m) not in taken]
            continue
        wake_at = closes_at
        break
    expire = [m for m in remaining if m.latest_start is not None and m.latest_start <= now]
    later = [m.latest_start for m in remaining if m.latest_start is not None and m.latest_start > now]
    if later:
        wake_at = min([*later, *([wake_at] if wake_at is not None else [])])
    return Plan(send=send, expire=expire, wake_at=wake_at)


def _gather(queue: Sequence[Member[P, R]], limit: int) -> list[Member[P, R]]:
    """The oldest member and the compatible members after it, in order, up to ``limit`` items.

    The oldest always goes, even when it alone is larger than ``limit``: a request is never
    split, and an oversized one simply runs alone.
    """
    head = queue[0]
    batch, items = [head], head.size
    if not head.key.batchable:
        return batch
    for member in queue[1:]:
        if member.key == head.key and items + member.size <= limit:
            batch.append(member)
            items += member.size
    return batch


def _closes_at(batch: Sequence[Member[P, R]], max_delay_s: float) -> float:
    """When a waiting batch must leave: its oldest member's delay, or its tightest slack."""
    closes = batch[0].enqueued + max_delay_s
    slack = [m.latest_start for m in batch if m.latest_start is not None]
    return min([closes, *slack])


RunBatch = Callable[["Batch[P, R]"], Awaitable[Sequence["R | StratusError"]]]


class Batcher(Generic[P, R]):
    """Owns one target's queue: admits, batches, runs and answers each member.

    ``run`` performs one batch (send a Work, call a runtime) and returns one answer or
    one error per member, in order; if it raises, every member gets that error.
    """

    def __init__(
        self,
        run: RunBatch[P, R],
        *,
        slots: int,
        depth: int | None = None,
        max_batch: Callable[[BatchKey], int] | int = DEFAULT_MAX_BATCH,
        max_delay_s: float = DEFAULT_MAX_DELAY_S,
        queue_limit: int = 4096,
        name: str = "batcher",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if slots < 1 or (depth is not None and depth < slots) or max_delay_s < 0 or queue_limit < 0:
            raise ValueError("slots >= 1, depth >= slots, max_delay_s >= 0 and queue_limit >= 0")
        self._run = run
        self.slots = slots
        self.depth = depth or slots
        self._max_batch = max_batch if callable(max_batch) else (lambda _key, m=max_batch: m)
        self.max_delay_s = max_delay_s
        self.queue_limit = queue_limit
        self.name = name
        self._clock = clock
        self._queue: list[Member[P, R]] = []
        self._running: set[Batch[P, R]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.waiting_items = 0
        self.running_items = 0
        self.batches = 0
        self._ids = itertools.count()

    @property
    def items(self) -> int:
        """Items waiting here or running at the target."""
        return self.waiting_items + self.running_items

    def max_batch(self, key: BatchKey) -> int:
        return max(1, self._max_batch(key))

    @property
    def outstanding(self) -> int:
        """Batches at the target now."""
        return len(self._running)

    def resize(self, *, slots: int, depth: int) -> None:
        """The target's room changed (a router trusts an agent with more, or fewer, calls at
        once): batches already out stay; what waits leaves by the new room."""
        if slots < 1 or depth < slots:
            raise ValueError("slots >= 1 and depth >= slots")
        self.slots, self.depth = slots, depth
        self._pump()

    async def submit(
        self,
        key: BatchKey,
        payload: P,
        *,
        size: int,
        latest_start: float | None = None,
        timeout_s: float | None = None,
    ) -> R:
        """Queue one request and wait for its own answer (or raise its own error).

        ``timeout_s`` bounds the wait of a request that queues (DEADLINE_EXCEEDED past it);
        one that runs at once, alone, is bounded by ``run`` itself, which knows its deadline.
        """
        if self._queue and self.waiting_items + size > self.queue_limit:
            raise Overloaded(
                f"{self.name}: {self.waiting_items} items already wait (limit {self.queue_limit})"
            )
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        member = Member(
            key=key,
            payload=payload,
            size=size,
            enqueued=self._clock(),
            latest_start=latest_start,
            future=future,
        )
        if not self._queue and len(self._running) < self.slots:
            return await self._run_alone(member)
        self._queue.append(member)
        self.waiting_items += size
        self._pump()
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(future)
        except TimeoutError:
            self._withdraw(member)
            raise DeadlineExceeded(
                f"{self.name} did not answer within {(timeout_s or 0) * 1000:.1f} ms"
            ) from None
        except asyncio.CancelledError:
            self._withdraw(member)
            raise

    async def _run_alone(self, member: Member[P, R]) -> R:
        """The idle case: run at once in the caller's own task (no task, no hand-over).

        Nothing can join a batch once it runs, so running it here changes nothing for
        anyone else; if the caller gives up, its batch of one is cancelled with it.
        """
        batch = Batch(key=member.key, members=[member])
        member.batch = batch
        self._running.add(batch)
        self.running_items += member.size
        self.batches += 1
        try:
            (answer,) = await self._run(batch)
        finally:
            self._running.discard(batch)
            self.running_items -= member.size
            self._pump()
        if isinstance(answer, StratusError):
            raise answer
        return answer

    def _withdraw(self, member: Member[P, R]) -> None:
        """A member's caller gave up: leave the queue, or cancel its batch if nobody else waits."""
        if member in self._queue:
            self._queue.remove(member)
            self.waiting_items -= member.size
            self._pump()
            return
        if not member.future.done():
            member.future.cancel()
        batch = member.batch
        if batch is not None and batch.task is not None and all(m.future.done() for m in batch.members):
            batch.task.cancel()

    def _pump(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._queue:
            return
        now = self._clock()
        decision = plan(
            self._queue,
            outstanding=len(self._running),
            slots=self.slots,
            depth=self.depth,
            now=now,
            max_batch=self.max_batch,
            max_delay_s=self.max_delay_s,
        )
        for members in decision.send:
            self._start(members)
        for member in decision.expire:
            self._expire(member)
        if decision.wake_at is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, decision.wake_at - now), self._pump)

    def _start(self, members: list[Member[P, R]]) -> None:
        for member in members:
            self._queue.remove(member)
        size = sum(m.size for m in members)
        self.waiting_items -= size
        self.running_items += size
        self.batches += 1
        batch = Batch(key=members[0].key, members=members)
        for member in members:
            member.batch = batch
        self._running.add(batch)
        batch.task = asyncio.get_running_loop().create_task(
            self._perform(batch), name=f"{self.name}-batch-{next(self._ids)}"
        )

    def _expire(self, member: Member[P, R]) -> None:
        self._queue.remove(member)
        self.waiting_items -= member.size
        if not member.future.done():
            member.future.set_exception(
                DeadlineExceeded(f"{self.name}: waited past its budget's slack for a free slot")
            )

    async def _perform(self, batch: Batch[P, R]) -> None:
        try:
            answers = await self._run(batch)
            if len(answers) != len(batch.members):
                raise RuntimeError(f"{self.name}: {len(answers)} answers for {len(batch.members)} requests")
            for member, answer in zip(batch.members, answers, strict=True):
                _settle(member, answer)
        except asyncio.CancelledError:
            for member in batch.members:
                if not member.future.done():
                    member.future.cancel()
        except Exception as exc:
            if not isinstance(exc, StratusError):
                log.exception("%s: batch of %d failed", self.name, batch.size)
            for member in batch.members:
                if not member.future.done():
                    member.future.set_exception(exc)
        finally:
            self._running.discard(batch)
            self.running_items -= batch.size
            self._pump()

    def fail_waiting(self, error: StratusError) -> None:
        """Fail every member waiting for a slot, now (the target is gone, or a Work ran out of
        patience there): each caller tries elsewhere. Batches running fail through ``run``."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for member in self._queue:
            if not member.future.done():
                member.future.set_exception(error)
        self._queue.clear()
        self.waiting_items = 0


def _settle(member: Member[P, R], answer: R | StratusError) -> None:
    if member.future.done():
        return
    if isinstance(answer, StratusError):
        member.future.set_exception(answer)
    else:
        member.future.set_result(answer)


def split_counts(total: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(start, stop) of each member's items in a batch of ``total`` items."""
    if sum(sizes) != total:
        raise ValueError(f"batch of {total} items cannot split into {list(sizes)}")
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds
