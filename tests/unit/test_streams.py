"""The one bridge from a producer's callback to an async iterator (stratus/sched/streams.py)."""

from __future__ import annotations

import asyncio

import pytest

from stratus.sched.streams import OnItem, relayed


def test_items_come_in_order_then_the_result() -> None:
    async def produce(on_item: OnItem[int]) -> str:
        for n in range(3):
            await on_item(n)
            await asyncio.sleep(0)
        return "done"

    async def scenario() -> tuple[list[int], str]:
        async with relayed(produce) as relay:
            seen = [n async for n in relay.items()]
            return seen, relay.result()

    assert asyncio.run(scenario()) == ([0, 1, 2], "done")


def test_the_producers_error_comes_after_its_items() -> None:
    async def produce(on_item: OnItem[int]) -> str:
        await on_item(1)
        raise ValueError("broke")

    async def scenario() -> list[int]:
        seen: list[int] = []
        async with relayed(produce) as relay:
            seen.extend([n async for n in relay.items()])
            with pytest.raises(ValueError, match="broke"):
                relay.result()
        return seen

    assert asyncio.run(scenario()) == [1]


def test_a_reader_that_leaves_early_stops_the_producer_and_waits_for_it() -> None:
    """The rule both data planes now share: nothing the producer holds outlives the stream."""
    ended: list[str] = []

    async def produce(on_item: OnItem[int]) -> str:
        try:
            for n in range(1000):
                await on_item(n)
                await asyncio.sleep(0.001)
            return "finished"
        finally:
            ended.append("cleaned up")

    async def scenario() -> list[str]:
        async with relayed(produce) as relay:
            async for n in relay.items():
                if n == 2:
                    break
        return list(ended)  # read as the block is left: before any other task could run

    assert asyncio.run(scenario()) == ["cleaned up"]
