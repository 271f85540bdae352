"""This router's changes written to the site's store, each by compare-and-swap on the revision
this router last saw of its key.

:class:`~router.site.mirror.SiteMirror` follows the store and applies what it says; a
:class:`SiteWriter` is its other half, how a change made here gets there, kept apart because
the two kinds of change fail differently. An operator's change is written at once: where the
store cannot be reached, or another router changed the key first, it is undone here and the
operator told why (after a lost race the winner's record is taken). A change made here on its
own (the rollout judge's, --auto-thresholds') has nobody to tell: it is written in the
background, retried while the store is away, and where it loses the store's record is taken,
since the store's order is the site's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final, TypeVar

from router.site import Entry, SiteState, StoreConflict, StoreUnavailable

log = logging.getLogger("stratus.site")

T = TypeVar("T")
RETRY_S: Final = 1.0


class SiteWriter:
    """Writes to ``state`` on the revisions in ``revisions`` (per key, the one last applied or
    written here: the mirror's, shared), and hands a record it had to take back to ``apply``."""

    def __init__(
        self, state: SiteState, revisions: dict[str, int], *, apply: Callable[[Entry], None]
    ) -> None:
        self._state, self._revisions, self._apply = state, revisions, apply
        # Changes made here on their own, not yet written: per key, how to encode it now.
        self._pending: dict[str, Callable[[], bytes]] = {}
        self._wake = asyncio.Event()
        self._operator_change = False  # set while an operator's change is made (not the judge's)

    async def change(
        self, key: str, make: Callable[[], T], encode: Callable[[T], bytes], undo: Callable[[], None]
    ) -> T:
        """An operator's change: made here, written, and undone here when the write fails."""
        expected = self._revisions.get(key, 0)  # what the change is made on: read before it is made
        self._operator_change = True
        try:
            made = make()
        finally:
            self._operator_change = False
        try:
            await self.put(key, encode(made), expected)
        except StoreUnavailable:
            undo()
            raise
        except StoreConflict:  # undone, then the winner taken (its echo may have come meanwhile)
            undo()
            with contextlib.suppress(StoreUnavailable):
                await self._take(key)
            raise
        self._pending.pop(key, None)
        return made

    async def put(self, key: str, value: bytes, expected: int | None = None) -> Entry:
        """A compare-and-swap write on the revision the change was made on (by default, the
        last this router saw)."""
        expected = self._revisions.get(key, 0) if expected is None else expected
        try:
            entry = await self._state.put(key, value, expected=expected)
        except StoreConflict as lost:
            raise StoreConflict(
                f"{key} was changed first elsewhere in the site (it is at revision {lost.current}; this "
                f"router had read revision {expected}): read it again (`stratus fleet status`), then retry",
                key=key,
                expected=expected,
                current=lost.current,
            ) from None
        self._revisions[key] = max(entry.revision, self._revisions.get(key, 0))
        return entry

    # -- changes made here on their own, written in the background ------------------------------
    def later(self, key: str, value: Callable[[], bytes]) -> None:
        """A change made here on its own, written by :meth:`run`; one made while an operator's
        change is made is that change's, which :meth:`change` writes."""
        if not self._operator_change:
            self._pending[key] = value
            self._wake.set()

    async def run(self) -> None:
        """Write what :meth:`later` was given, for as long as the mirror runs."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            for key, value in list(self._pending.items()):
                try:
                    await self.put(key, value())
                except StoreConflict:  # another router's record came first: the store's is the site's
                    log.info("%s: another router's change came first; taking the store's", key)
                    await self._take(key)
                except StoreUnavailable as exc:
                    log.warning("%s not written yet: %s; retrying in %.0f s", key, exc, RETRY_S)
                    await asyncio.sleep(RETRY_S)
                    self._wake.set()
                    break
                if self._pending.get(key) is value:
                    del self._pending[key]

    async def _take(self, key: str) -> None:
        entry = await self._state.get(key)
        if entry is not None:
            self._revisions.pop(key, None)
            self._apply(entry)
