"""The SiteState contract as tests, for every backend: a test module subclasses
:class:`SiteStateContract`, says how to make a store (``make``) kept at one place (so that
``make`` again is the same store after a restart), and gets every test below.

Each test runs its own event loop (``asyncio.run``), as the leak guards in tests/conftest.py
expect: a store is started and closed inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import ClassVar

import pytest

from router.site import MAX_VALUE_BYTES, Entry, SiteState, StoreConflict

Body = Callable[[SiteState], Awaitable[None]]
WAIT_S = 5.0  # for what must come: a failing test says so after this, never hangs


async def connected(store: SiteState, within_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + within_s
    while not store.connected:
        assert time.monotonic() < deadline, f"not connected after {within_s} s: {store.describe()}"
        await asyncio.sleep(0.02)


async def next_of(changes: AsyncIterator[Entry], within_s: float = WAIT_S) -> Entry:
    return await asyncio.wait_for(anext(changes), within_s)


async def nothing_more(changes: AsyncIterator[Entry], for_s: float = 0.3) -> None:
    """Nothing comes for ``for_s``: no revision given twice, nothing beyond the prefix."""
    with pytest.raises(TimeoutError):
        extra = await asyncio.wait_for(anext(changes), for_s)
        pytest.fail(f"the watch gave {extra} too")


class SiteStateContract:
    HISTORY: ClassVar[int] = 4  # revisions kept per key by the stores these tests make

    def make(self) -> SiteState:
        raise NotImplementedError

    def run(self, body: Body) -> None:
        asyncio.run(self.with_store(body))

    async def with_store(self, body: Body) -> None:
        store = self.make()
        await store.start()
        try:
            await connected(store)
            await body(store)
        finally:
            await store.close()

    def test_a_put_is_read_back_with_a_revision_and_the_time_it_was_taken(self) -> None:
        async def body(store: SiteState) -> None:
            assert await store.get("rollout.digits.device") is None
            before = time.time()
            written = await store.put("rollout.digits.device", b'{"step": 1}')
            read = await store.get("rollout.digits.device")
            assert read is not None and read.value == b'{"step": 1}' and not read.deleted
            assert read.revision == written.revision > 0
            assert before - 1 <= read.at <= time.time() + 1

        self.run(body)

    def test_expected_zero_creates_only(self) -> None:
        async def body(store: SiteState) -> None:
            first = await store.put("drain.device-1", b"a", expected=0)
            with pytest.raises(StoreConflict) as lost:
                await store.put("drain.device-1", b"b", expected=0)
            assert (lost.value.key, lost.value.expected, lost.value.current) == (
                "drain.device-1",
                0,
                first.revision,
            )
            assert f"drain.device-1 changed first: it is at revision {first.revision}" in str(lost.value)
            assert lost.value.status_name == "FAILED_PRECONDITION"
            assert (await store.get("drain.device-1")) == first

        self.run(body)

    def test_an_update_wins_only_on_the_revision_it_read(self) -> None:
        async def body(store: SiteState) -> None:
            first = await store.put("rollout.digits.device", b"1")
            second = await store.put("rollout.digits.device", b"2", expected=first.revision)
            assert second.revision > first.revision
            with pytest.raises(StoreConflict) as lost:
                await store.put("rollout.digits.device", b"3", expected=first.revision)
            assert lost.value.current == second.revision and lost.value.expected == first.revision
            assert str(lost.value) == (
                f"rollout.digits.device changed first: it is at revision {second.revision}, "
                f"this change read {first.revision}"
            )
            got = await store.get("rollout.digits.device")
            assert got is not None and got.value == b"2"

        self.run(body)

    def test_an_update_of_a_key_that_has_none_is_a_conflict(self) -> None:
        async def body(store: SiteState) -> None:
            with pytest.raises(StoreConflict) as lost:
                await store.put("drain.ghost", b"x", expected=7)
            assert lost.value.current == 0 and "has no live revision" in str(lost.value)
            assert await store.get("drain.ghost") is None

        self.run(body)

    def test_a_delete_leaves_a_tombstone_and_the_key_can_be_made_again(self) -> None:
        async def body(store: SiteState) -> None:
            first = await store.put("drain.device-2", b"on")
            with pytest.raises(StoreConflict):
                await store.delete("drain.device-2", expected=first.revision + 100)
            await store.delete("drain.device-2", expected=first.revision)
            assert await store.get("drain.device-2") is None
            kept = await store.history("drain.device-2")
            assert [e.deleted for e in kept] == [False, True] and kept[1].revision > first.revision
            assert kept[1].value == b""
            again = await store.put("drain.device-2", b"on again", expected=0)  # deleted counts as none
            assert again.revision > kept[1].revision

        self.run(body)

    def test_deleting_what_has_no_live_revision_writes_nothing(self) -> None:
        async def body(store: SiteState) -> None:
            await store.delete("drain.nothing")
            await store.delete("drain.nothing", expected=0)
            assert await store.history("drain.nothing") == []
            live = await store.put("drain.something", b"x")
            with pytest.raises(StoreConflict):
                await store.delete("drain.something", expected=0)
            assert await store.get("drain.something") == live

        self.run(body)

    def test_history_is_oldest_first_and_keeps_the_last_revisions(self) -> None:
        async def body(store: SiteState) -> None:
            count = self.HISTORY + 3
            written = [await store.put("threshold.digits", str(n).encode()) for n in range(count)]
            await store.put("threshold.other", b"elsewhere")
            kept = await store.history("threshold.digits")
            assert [e.revision for e in kept] == [e.revision for e in written[-self.HISTORY :]]
            assert [e.value for e in kept] == [str(n).encode() for n in range(count - self.HISTORY, count)]

        self.run(body)

    @staticmethod
    async def seed(store: SiteState) -> dict[str, Entry]:
        """Two keys under ``rollout.`` (one of them updated), one deleted there, and two beyond it."""
        b = await store.put("rollout.b", b"b")
        a = await store.put("rollout.a", b"a")
        gone = await store.put("rollout.gone", b"x")
        await store.delete("rollout.gone", expected=gone.revision)
        drain = await store.put("drain.x", b"d")
        near = await store.put("rolloutx", b"not under rollout.")
        a2 = await store.put("rollout.a", b"a2", expected=a.revision)
        return {"b": b, "a": a2, "drain": drain, "near": near}

    def test_entries_are_the_live_keys_under_a_prefix_in_revision_order(self) -> None:
        async def body(store: SiteState) -> None:
            seeded = await self.seed(store)
            b, a, drain, near = (seeded[name] for name in ("b", "a", "drain", "near"))
            assert await store.entries("rollout.") == [b, a]
            assert await store.entries("rollout") == [b, near, a]  # a prefix may end mid-word
            assert await store.entries("") == [b, drain, near, a]
            assert await store.entries("nothing.") == []

        self.run(body)

    def test_a_watch_gives_the_live_entries_then_each_change_in_order(self) -> None:
        async def body(store: SiteState) -> None:
            seeded = await self.seed(store)
            two, one = seeded["b"], seeded["a"]  # in revision order
            async with contextlib.aclosing(store.watch("rollout.")) as changes:  # type: ignore[type-var]
                assert [await next_of(changes), await next_of(changes)] == [two, one]
                three = await store.put("rollout.three", b"3")
                await store.put("drain.x", b"y")
                await store.put("rolloutx", b"y")
                await store.delete("rollout.a", expected=one.revision)
                two_again = await store.put("rollout.b", b"22", expected=two.revision)
                given = [await next_of(changes) for _ in range(3)]
                assert given[0] == three and given[2] == two_again
                assert (given[1].key, given[1].deleted) == ("rollout.a", True)
                assert given[0].revision < given[1].revision < given[2].revision
                await nothing_more(changes)

        self.run(body)

    def test_a_watch_ends_when_the_store_closes(self) -> None:
        async def body(store: SiteState) -> None:
            await store.put("drain.a", b"x")
            given: list[Entry] = []

            async def follow() -> None:
                async with contextlib.aclosing(store.watch("")) as changes:  # type: ignore[type-var]
                    given.extend([entry async for entry in changes])

            follower = asyncio.create_task(follow())
            await asyncio.sleep(0.2)
            await store.close()
            await asyncio.wait_for(follower, WAIT_S)
            assert [entry.key for entry in given] == ["drain.a"]

        self.run(body)

    def test_revisions_keep_rising_across_a_restart(self) -> None:
        async def body(store: SiteState) -> None:
            written = await store.put("rollout.digits", b"before")
            await store.delete("rollout.digits", expected=written.revision)
            await store.close()
            again = self.make()
            await again.start()
            try:
                await connected(again)
                assert [e.deleted for e in await again.history("rollout.digits")] == [False, True]
                after = await again.put("rollout.digits", b"after", expected=0)
                assert after.revision > (await again.history("rollout.digits"))[1].revision
            finally:
                await again.close()

        self.run(body)

    def test_keys_and_prefixes_are_checked_before_anything_is_sent(self) -> None:
        async def body(store: SiteState) -> None:
            for bad in ("", "a..b", ".a", "a.", "a b", "a/b", "a=b", "a*", ">", "é", "x" * 257):
                with pytest.raises(ValueError, match="not a site-state key"):
                    await store.put(bad, b"x")
                with pytest.raises(ValueError, match="not a site-state key"):
                    await store.get(bad)
            for bad_prefix in ("a*", "a>", "a b"):
                with pytest.raises(ValueError, match="not a site-state prefix"):
                    await store.entries(bad_prefix)
            assert await store.entries("") == []

        self.run(body)

    def test_a_value_is_bounded(self) -> None:
        async def body(store: SiteState) -> None:
            largest = await store.put("rollout.big", bytes(MAX_VALUE_BYTES))
            with pytest.raises(ValueError, match=f"{MAX_VALUE_BYTES + 1} bytes"):
                await store.put("rollout.big", bytes(MAX_VALUE_BYTES + 1))
            got = await store.get("rollout.big")
            assert got is not None and got.revision == largest.revision and len(got.value) == MAX_VALUE_BYTES

        self.run(body)
