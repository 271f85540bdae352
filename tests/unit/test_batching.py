"""The dynamic batcher: its pure plan with an injected clock, and its event-loop shell."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from stratus.errors import DeadlineExceeded, InvalidInput, Overloaded, StratusError
from stratus.sched.batching import Batch, Batcher, BatchKey, Member, plan, split_counts

KEY = BatchKey(variant="v", inputs=(("x", "FP32", (4,)),))
OTHER_SHAPE = BatchKey(variant="v", inputs=(("x", "FP32", (8,)),))
OTHER_OUTPUTS = BatchKey(variant="v", inputs=(("x", "FP32", (4,)),), outputs=("logits",))
ALONE = BatchKey(variant="v", inputs=(("s", "BYTES", ()),), batchable=False)


def member(
    key: BatchKey = KEY, *, size: int = 1, at: float = 0.0, slack: float | None = None
) -> Member[str, str]:
    loop = asyncio.new_event_loop()
    try:
        future: asyncio.Future[str] = loop.create_future()
    finally:
        loop.close()
    return Member(key=key, payload="p", size=size, enqueued=at, latest_start=slack, future=future)


def decide(
    queue: Sequence[Member[str, str]],
    *,
    now: float,
    outstanding: int = 0,
    slots: int = 1,
    depth: int = 1,
    max_batch: int = 8,
    delay: float = 0.0005,
) -> tuple[list[list[Member[str, str]]], list[Member[str, str]], float | None]:
    result = plan(
        queue,
        outstanding=outstanding,
        slots=slots,
        depth=depth,
        now=now,
        max_batch=lambda _key: max_batch,
        max_delay_s=delay,
    )
    return result.send, result.expire, result.wake_at


def test_a_free_slot_sends_at_once_even_a_batch_of_one() -> None:
    first = member(at=10.0)
    send, expire, wake = decide([first], now=10.0)
    assert send == [[first]] and not expire and wake is None


def test_a_busy_target_holds_the_batch_until_a_slot_frees_without_room_beyond() -> None:
    queue = [member(at=10.0), member(at=10.0001)]
    send, _, wake = decide(queue, now=10.001, outstanding=1, slots=1, depth=1)
    assert send == [] and wake is None  # nothing to wait for: the slot's end wakes it
    send, _, _ = decide(queue, now=10.002, outstanding=0)
    assert send == [queue]  # the whole waiting batch, in order


def test_with_room_beyond_the_slots_a_batch_leaves_after_the_delay_not_before() -> None:
    queue = [member(at=10.0), member(at=10.0002)]
    send, _, wake = decide(queue, now=10.0003, outstanding=2, slots=2, depth=4)
    assert send == [] and wake == pytest.approx(10.0005)
    send, _, _ = decide(queue, now=10.0005, outstanding=2, slots=2, depth=4)
    assert send == [queue]


def test_a_full_batch_leaves_at_once_and_the_rest_waits() -> None:
    queue = [member(at=10.0) for _ in range(5)]
    send, _, wake = decide(queue, now=10.0001, outstanding=1, slots=1, depth=3, max_batch=4)
    assert send == [queue[:4]] and wake == pytest.approx(10.0005)


def test_no_batch_waits_past_its_tightest_members_slack() -> None:
    queue = [member(at=10.0), member(at=10.0001, slack=10.0002)]
    send, _, wake = decide(queue, now=10.00015, outstanding=1, slots=1, depth=2)
    assert send == [] and wake == pytest.approx(10.0002)
    send, _, _ = decide(queue, now=10.0002, outstanding=1, slots=1, depth=2)
    assert send == [queue]


def test_a_member_whose_slack_passes_with_no_room_anywhere_expires() -> None:
    hopeless, patient = member(at=10.0, slack=10.001), member(at=10.0)
    send, expire, wake = decide([hopeless, patient], now=10.0009, outstanding=1)
    assert not send and not expire and wake == pytest.approx(10.001)
    send, expire, _ = decide([hopeless, patient], now=10.001, outstanding=1)
    assert not send and expire == [hopeless]


def test_incompatible_requests_are_never_merged_and_keep_their_order() -> None:
    a, b, c, d = member(KEY), member(OTHER_SHAPE), member(OTHER_OUTPUTS), member(KEY)
    send, _, _ = decide([a, b, c, d], now=0.0, slots=3, depth=3)
    assert send == [[a, d], [b], [c]]


def test_an_unbatchable_request_runs_alone_and_an_oversized_one_is_not_split() -> None:
    text, small = member(ALONE), member(ALONE)
    big, after = member(size=20), member(size=1)
    send, _, _ = decide([text, small], now=0.0, slots=2, depth=2)
    assert send == [[text], [small]]
    send, _, _ = decide([big, after], now=0.0, slots=1, depth=1, max_batch=8)
    assert send == [[big]]


def test_split_counts_cover_the_batch_exactly() -> None:
    assert split_counts(6, [1, 3, 2]) == [(0, 1), (1, 4), (4, 6)]
    with pytest.raises(ValueError, match=r"batch of 5 items cannot split into \[1, 3\]"):
        split_counts(5, [1, 3])


async def _echo(batch: Batch[np.ndarray, np.ndarray]) -> list[np.ndarray | StratusError]:
    """Joins, 'runs' (doubles) and splits, failing only the member that carries a NaN."""
    joined = np.concatenate(batch.payloads)
    await asyncio.sleep(0.02)
    answers: list[np.ndarray | StratusError] = []
    for (start, stop), payload in zip(split_counts(len(joined), batch.sizes), batch.payloads, strict=True):
        bad = np.isnan(payload).any()
        answers.append(InvalidInput("a NaN") if bad else joined[start:stop] * 2)
    return answers


def test_the_batcher_merges_while_busy_and_answers_each_member_its_own_rows() -> None:
    async def scenario() -> tuple[list[object], int, int]:
        batcher: Batcher[np.ndarray, np.ndarray] = Batcher(_echo, slots=1, max_batch=16)
        payloads = [np.full((n, 4), i, np.float32) for i, n in enumerate([1, 2, 3, 1])]
        payloads[2][0, 0] = np.nan
        results = await asyncio.gather(
            *(batcher.submit(KEY, p, size=len(p)) for p in payloads), return_exceptions=True
        )
        return results, batcher.batches, batcher.items

    results, batches, left = asyncio.run(scenario())
    assert batches == 2  # the first alone (idle target), the other three merged while it ran
    assert np.array_equal(results[0], np.full((1, 4), 0.0) * 2)
    assert np.array_equal(results[1], np.full((2, 4), 1.0) * 2)
    assert isinstance(results[2], InvalidInput)  # the malformed member, and only it
    assert np.array_equal(results[3], np.full((1, 4), 3.0) * 2)
    assert left == 0


def test_a_cancelled_member_leaves_the_queue_and_a_batch_nobody_awaits_is_cancelled() -> None:
    started: list[int] = []
    cancelled: list[int] = []

    async def slow(batch: Batch[str, str]) -> list[str | StratusError]:
        started.append(batch.size)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(batch.size)
            raise
        return ["x"] * len(batch.members)

    async def scenario() -> int:
        batcher: Batcher[str, str] = Batcher(slow, slots=1)
        running = asyncio.create_task(batcher.submit(KEY, "a", size=1))
        waiting = asyncio.create_task(batcher.submit(KEY, "b", size=1))
        await asyncio.sleep(0.01)
        assert batcher.waiting_items == 1  # "b" waits behind "a" for the one slot
        waiting.cancel()
        await asyncio.sleep(0.01)
        queued = batcher.waiting_items
        running.cancel()
        await asyncio.sleep(0.01)
        return queued

    assert asyncio.run(scenario()) == 0
    assert started == [1] and cancelled == [1]


def test_the_queue_limit_refuses_with_overloaded_and_slack_expiry_says_why() -> None:
    async def never(batch: Batch[str, str]) -> list[str | StratusError]:
        await asyncio.sleep(10)
        return []

    async def scenario() -> None:
        batcher: Batcher[str, str] = Batcher(never, slots=1, queue_limit=1)
        running = asyncio.create_task(batcher.submit(KEY, "a", size=1))
        await asyncio.sleep(0)
        soon = asyncio.get_running_loop().time() + 0.01
        doomed = asyncio.create_task(batcher.submit(KEY, "b", size=1, latest_start=soon))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="already wait"):
            await batcher.submit(KEY, "c", size=1)
        with pytest.raises(DeadlineExceeded, match="slack"):
            await doomed
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    asyncio.run(scenario())


def test_failing_what_waits_fails_the_queued_members_at_once_and_leaves_the_running_batch() -> None:
    """A target that let a Work run out of patience: the members queued behind it try elsewhere
    now, with what is left of their budgets, instead of waiting on it (security2 N3)."""

    async def scenario() -> tuple[str, list[BaseException | str]]:
        release = asyncio.Event()

        async def run(batch: Batch[str, str]) -> list[str | StratusError]:
            await release.wait()
            return ["done"] * len(batch.members)

        batcher: Batcher[str, str] = Batcher(run, slots=1, depth=1)
        running = asyncio.ensure_future(batcher.submit(KEY, "first", size=1))
        await asyncio.sleep(0)
        waiting = [asyncio.ensure_future(batcher.submit(KEY, f"w{i}", size=1, timeout_s=30)) for i in range(3)]
        await asyncio.sleep(0)
        batcher.fail_waiting(DeadlineExceeded("the target ran out of patience"))
        failed = await asyncio.gather(*waiting, return_exceptions=True)
        assert batcher.waiting_items == 0
        release.set()
        return await running, failed

    first, failed = asyncio.run(scenario())
    assert first == "done"
    assert all(isinstance(f, DeadlineExceeded) for f in failed), failed
