"""One holder at a time for work a site must do once (the rollout judge), through the store.

The lease is an entry ``{holder, until}`` written by compare-and-swap: the holder renews it
every ttl/3; another router takes it only once ``until`` has passed by its own clock, with the
revision it read, so of two takers one wins and the other's put is refused. A holder that
cannot reach the store keeps the lease only until its own ``until``, so two routers hold it at
once only by as much as their clocks disagree. A holder that stops cleanly deletes its entry
(with its revision: never a successor's), and a router following the key takes over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Final

from router.site import Entry, SiteState, StoreConflict, StoreUnavailable, check_key
from stratus.errors import ConfigError, StratusError

log = logging.getLogger("stratus.site-lease")
# After a lost compare-and-swap, read again soon (as a share of the ttl): someone just wrote.
RETRY_SHARE: Final = 0.1


@dataclass(frozen=True, kw_only=True)
class LeaseRecord:
    holder: str
    until: float  # seconds since the epoch, by the holder's clock

    def encode(self) -> bytes:
        return json.dumps({"holder": self.holder, "until": self.until}).encode()

    @classmethod
    def decode(cls, value: bytes) -> LeaseRecord:
        """A record nobody could have written for a lease reads as expired: it is taken (by
        compare-and-swap, so only once) instead of blocking the lease for good."""
        try:
            document = json.loads(value)
            return cls(holder=str(document["holder"]), until=float(document["until"]))
        except (ValueError, KeyError, TypeError):
            return cls(holder="", until=0.0)


class Lease:
    """``holder``'s claim on ``key``; :meth:`run` keeps it, or takes it when it is free."""

    def __init__(
        self,
        state: SiteState,
        key: str,
        holder: str,
        *,
        ttl_s: float = 15.0,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        if ttl_s <= 0 or not holder:
            raise ConfigError(f"lease {key}: a holder's name and a ttl above 0 s (not {holder!r}, {ttl_s})")
        self.key, self.holder, self.ttl_s = check_key(key), holder, ttl_s
        self._state, self._clock, self._on_change = state, clock, on_change
        self._held = False
        self._until = 0.0  # of the record this holder last wrote
        self._revision = 0  # that record's revision: what a renewal or a release expects

    @property
    def held(self) -> bool:
        """By this holder's clock: false from its ``until`` on, whether it could renew or not."""
        return self._held and self._clock() < self._until

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    async def step(self) -> float:
        """One look at the lease: renew it, take it, or leave it to its holder; the seconds until
        the next look."""
        now = self._clock()
        try:
            return await self._attempt(await self._state.get(self.key), now)
        except StoreConflict:
            self._set(False)
            return self.ttl_s * RETRY_SHARE
        except StoreUnavailable as exc:
            self._set(self.held)
            log.warning("lease %s: %s", self.key, exc)
            return min(self.renew_every_s, max(self._until - now, 0.0)) if self.held else self.renew_every_s

    async def _attempt(self, entry: Entry | None, now: float) -> float:
        record = LeaseRecord.decode(entry.value) if entry else None
        if record is None or record.holder == self.holder or record.until <= now:
            until = now + self.ttl_s  # the clock read before the store was: never later than it wrote
            written = await self._state.put(
                self.key,
                LeaseRecord(holder=self.holder, until=until).encode(),
                expected=entry.revision if entry else 0,
            )
            self._revision, self._until = written.revision, until
            self._set(True)
            return self.renew_every_s
        self._set(False)
        return min(self.renew_every_s, record.until - now + self.ttl_s * RETRY_SHARE / 10)

    async def release(self) -> None:
        """Give the lease up now, so that a successor need not wait for the ttl."""
        if not self._held:
            return
        self._set(False)
        try:
            await self._state.delete(self.key, expected=self._revision)
        except (StoreConflict, StoreUnavailable) as exc:  # taken already, or the ttl frees it
            log.info("lease %s: not released (%s)", self.key, exc)

    async def run(self) -> None:
        """Keep the lease (or wait for it) until cancelled; then release it. A change of the key
        by another holder (a release above all) cuts the wait short."""
        poke = asyncio.Event()
        follower = asyncio.create_task(self._follow(poke), name=f"lease {self.key} follower")
        try:
            while True:
                poke.clear()
                delay = await self.step()
                with contextlib.suppress(TimeoutError):
                    # asyncio.timeout, not wait_for: 3.11's wait_for may swallow a cancel that
                    # meets a poke, and the loop then outlives its router's shutdown
                    async with asyncio.timeout(delay):
                        await poke.wait()
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await self.release()

    async def _follow(self, poke: asyncio.Event) -> None:
        """Wake the loop on another holder's write or a delete; this holder's own renewals, which
        may arrive before their put returns, must not (each would set off another)."""
        changes = self._state.watch(self.key)
        try:
            async for entry in changes:
                if entry.key == self.key and (
                    entry.deleted or LeaseRecord.decode(entry.value).holder != self.holder
                ):
                    poke.set()
        except StratusError as exc:  # the loop still looks every ttl/3
            log.warning("lease %s: cannot follow the key (%s)", self.key, exc)
        finally:
            if isinstance(changes, AsyncGenerator):  # ends its subscription now, not at a collection
                await changes.aclose()

    def _set(self, held: bool) -> None:
        if held != self._held:
            self._held = held
            log.info("lease %s: %s %s", self.key, self.holder, "holds it" if held else "does not hold it")
            if self._on_change is not None:
                self._on_change(held)
