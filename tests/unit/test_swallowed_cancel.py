"""A cancel swallowed by 3.11's asyncio.wait_for (stratus/cancellation.py) raised again: by the
helpers, and by the NATS store's operations, whose client awaits every request with wait_for.

The swallow is made for real: a task waits in ``asyncio.wait_for`` on a future, and the
future's result and the task's cancel arrive in the same turn of the loop."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from router.site.nats import NatsSiteState
from stratus.cancellation import CancelWatch, keeping_cancel

Waiter = Callable[["asyncio.Future[str]"], Awaitable[Any]]


async def _cancelled_as_it_completes(waiter: Waiter) -> asyncio.Task[Any]:
    """The task of ``waiter(future)``, cancelled in the turn the future's result arrives, once done."""
    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(waiter(future))
    await asyncio.sleep(0)  # the task now waits inside wait_for
    future.set_result("answer")
    task.cancel()
    async with asyncio.timeout(5):
        await asyncio.gather(task, return_exceptions=True)
    return task


async def _bare(future: asyncio.Future[str]) -> str:
    return await asyncio.wait_for(future, 10)


async def _kept(future: asyncio.Future[str]) -> str:
    return await keeping_cancel(asyncio.wait_for(future, 10))


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for raises the cancel itself")
def test_the_premise_311s_wait_for_returns_the_result_of_a_cancelled_task() -> None:
    task = asyncio.run(_cancelled_as_it_completes(_bare))
    assert not task.cancelled() and task.result() == "answer"
    assert task.cancelling() == 1  # counted, though never raised: what CancelWatch reads


def test_keeping_cancel_raises_the_cancel_instead_of_returning() -> None:
    task = asyncio.run(_cancelled_as_it_completes(_kept))
    assert task.cancelled()


def test_a_loop_with_a_watch_ends_when_a_turn_swallows_its_cancel() -> None:
    turns: list[int] = []

    async def loop(future: asyncio.Future[str]) -> None:
        cancels = CancelWatch()
        while True:
            cancels.check()
            turns.append(len(turns))
            if len(turns) == 1:
                await asyncio.wait_for(future, 10)  # the turn the cancel is swallowed in
            else:
                await asyncio.sleep(0.01)
            assert len(turns) < 100, "the loop outlived its cancel"

    task = asyncio.run(_cancelled_as_it_completes(loop))
    assert task.cancelled() and turns == [0]


def test_cleanup_after_a_cancel_is_not_cancelled_again_by_a_watch_taken_in_it() -> None:
    """A task that caught its cancel to clean up (the count already 1) runs its cleanup's awaits:
    only a cancel made after the watch was taken is raised."""
    cleaned: list[str] = []

    async def cleans_up() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            cleaned.append(await keeping_cancel(asyncio.sleep(0, "first")))
            cleaned.append(await keeping_cancel(asyncio.sleep(0, "second")))

    async def main() -> asyncio.Task[None]:
        task = asyncio.create_task(cleans_up())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return task

    assert asyncio.run(main()).cancelled() and cleaned == ["first", "second"]


def _connected_store() -> NatsSiteState:
    """A store as its operations find it while connected: the real _call, with the bucket and the
    client's state standing in for a server (tests/integration/test_site_store.py has the real one)."""
    store = NatsSiteState("nats://127.0.0.1:4222", op_timeout_s=5.0)
    store._js, store._kv = SimpleNamespace(), SimpleNamespace()  # type: ignore[assignment]
    store._client = SimpleNamespace(is_connected=True)  # type: ignore[assignment]
    return store


def test_a_store_operation_raises_the_cancel_its_client_swallowed() -> None:
    """What hung CI: a lease's renewal loop, cancelled as its read came back, read on forever."""

    async def main() -> asyncio.Task[Any]:
        store = _connected_store()
        return await _cancelled_as_it_completes(
            lambda future: store._call("a read", lambda _js, _kv: asyncio.wait_for(future, 10))
        )

    assert asyncio.run(main()).cancelled()


def test_a_store_operation_not_cancelled_returns_its_result() -> None:
    async def main() -> str:
        store = _connected_store()
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(future.set_result, "answer")
        return await store._call("a read", lambda _js, _kv: asyncio.wait_for(future, 10))

    assert asyncio.run(main()) == "answer"
