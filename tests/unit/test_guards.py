"""The leak guards in tests/conftest.py notice what they guard against."""

from __future__ import annotations

import asyncio
import threading

from tests.conftest import leaked_threads


def test_the_task_guard_records_a_task_left_pending(no_leaked_tasks: list[str]) -> None:
    async def forgotten() -> None:
        await asyncio.sleep(60)

    async def main() -> None:
        asyncio.get_running_loop().create_task(forgotten())
        await asyncio.sleep(0)

    asyncio.run(main())
    assert len(no_leaked_tasks) == 1 and "forgotten" in no_leaked_tasks[0], no_leaked_tasks
    no_leaked_tasks.clear()  # seen; this test's own leak is not a failure


def test_the_task_guard_lets_finished_tasks_be(no_leaked_tasks: list[str]) -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_task(asyncio.sleep(0))

    asyncio.run(main())
    assert no_leaked_tasks == []


def test_the_task_guard_records_a_task_left_on_a_loop_closed_by_hand(no_leaked_tasks: list[str]) -> None:
    async def forgotten() -> None:
        await asyncio.sleep(60)

    loop = asyncio.new_event_loop()
    task = loop.create_task(forgotten())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    assert len(no_leaked_tasks) == 1 and "forgotten" in no_leaked_tasks[0], no_leaked_tasks
    no_leaked_tasks.clear()
    task._log_destroy_pending = False  # type: ignore[attr-defined]  # seen; no warning when collected


def test_the_thread_guard_names_a_thread_still_running() -> None:
    before = set(threading.enumerate())
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="forgotten-thread")
    thread.start()
    try:
        assert leaked_threads(before, wait_s=0.01) == ["forgotten-thread"]
    finally:
        stop.set()
        thread.join()
    assert leaked_threads(before, wait_s=0.01) == []
