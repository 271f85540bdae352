"""The leak guards in tests/conftest.py notice what they guard against."""

from __future__ import annotations

import asyncio


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
