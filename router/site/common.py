"""What both backends of :class:`~router.site.SiteState` do alike: the checks on what a caller
passes, the conflict's message, and the cursor that keeps a watch's promise (each revision
once, in order; a delete only of an entry the watcher was given)."""

from __future__ import annotations

import re
from typing import Final

from router.site import MAX_VALUE_BYTES, Entry, StoreConflict, check_key

# A prefix is a key's start: a whole word or part of one, so no NATS wildcard can hide in it.
PREFIX_PATTERN: Final = re.compile(r"[A-Za-z0-9_.-]*")


def check_value(key: str, value: bytes) -> bytes:
    """Refuse an entry no backend may hold, before anything is sent: one size bound for both,
    so a value the file takes is never refused later by NATS."""
    check_key(key)
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(
            f"{key}: a value of {len(value)} bytes is over the {MAX_VALUE_BYTES} a site entry may hold"
        )
    return value


def check_prefix(prefix: str) -> str:
    if not PREFIX_PATTERN.fullmatch(prefix) or len(prefix) > 256:
        raise ValueError(f"{prefix!r} is not a site-state prefix (the start of a key, or '')")
    return prefix


def conflict(key: str, expected: int, current: int) -> StoreConflict:
    """The lost compare-and-swap, worded for the operator who retries it: ``current`` (0 for
    none) is what the next try must read."""
    now = f"it is at revision {current}" if current else "it has no live revision now"
    read = f"this change read {expected}" if expected else "this change expected none"
    return StoreConflict(f"{key} changed first: {now}, {read}", key=key, expected=expected, current=current)


class WatchCursor:
    """A watch's position: the last revision it handled and the keys it has given alive.

    A revision at or below the last one is dropped (a resumed subscription starts again at
    the last one plus one, and a subscription cut off may still hand over what it had), and a
    delete of a key never given is dropped too: a watcher only hears of the end of what it saw.
    """

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.last = 0
        self._live: set[str] = set()

    def accept(self, entry: Entry) -> Entry | None:
        """``entry`` if the watcher is to be given it; the position moves on either way (a
        subscription may deliver keys beyond the prefix: NATS filters whole words only)."""
        if entry.revision <= self.last:
            return None
        self.last = entry.revision
        if not entry.key.startswith(self.prefix):
            return None
        if not entry.deleted:
            self._live.add(entry.key)
            return entry
        if entry.key in self._live:
            self._live.discard(entry.key)
            return entry
        return None
