"""Where deferred requests wait for the cloud: durable, bounded, oldest judged first.

:class:`DeferredStore` is the contract; :class:`LocalDeferredStore` keeps a lone router's
under ``--state-dir`` (``deferred/``, one file per request). A request is acknowledged (its
provisional answer sent) only after its file is written whole, synced and renamed into
place (:func:`stratus.durable.write_atomically`), so a router killed with SIGKILL, or a power
cut, loses nothing it answered provisionally; a half-written file is a scratch file that the
next start deletes.

Bounds are each family's ``[offline]``: items and bytes kept at once (past either, a new
request is *refused*: its answer is still given, degraded and not provisional, and the refusal
is counted), and the age past which an item not judged yet is dropped (*expired*, counted).
Refusing the new rather than dropping the old keeps what a caller was promised: every
provisional answer it holds will be judged or expire, never vanish for a newer one.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from google.protobuf.message import DecodeError

from stratus.durable import write_atomically
from stratus.families.offline import OfflineSpec
from stratus.wire import fleet_pb2 as fpb

log = logging.getLogger("stratus.router.offline")

SUFFIX: Final = ".deferred"
FULL_ITEMS: Final = "full_items"
FULL_BYTES: Final = "full_bytes"
STORE_FAILED: Final = "store_failed"


@dataclass(frozen=True)
class Kept:
    """What the store's index holds of one deferred request (its body stays on disk)."""

    key: str
    family: str
    items: int
    size: int
    created: float  # seconds since the epoch


@dataclass
class FamilyBacklog:
    items: int = 0
    size: int = 0
    requests: dict[str, Kept] = field(default_factory=dict)  # key -> kept, oldest first

    @property
    def oldest(self) -> float | None:
        return next(iter(self.requests.values())).created if self.requests else None


def new_key(created: float) -> str:
    """Sorts by time (nanoseconds), unique by a random tail."""
    return f"{int(created * 1e9):020d}-{uuid.uuid4().hex[:12]}"


class DeferredStore(abc.ABC):
    """Deferred requests, by family, oldest first."""

    def __init__(self) -> None:
        self.backlogs: dict[str, FamilyBacklog] = {}
        self.claimed: set[str] = set()  # keys handed to the judge and not removed or released yet

    @abc.abstractmethod
    async def start(self) -> None:
        """Read what an earlier run kept."""

    async def close(self) -> None:
        return None

    @abc.abstractmethod
    async def keep(self, record: fpb.DeferredRequest, bounds: OfflineSpec) -> str | None:
        """Keep ``record`` durably; None once kept, else why not (``full_items``,
        ``full_bytes``, ``store_failed``)."""

    @abc.abstractmethod
    async def claim(self, limit: int, families: frozenset[str]) -> list[fpb.DeferredRequest]:
        """Up to ``limit`` kept requests of ``families`` to judge now, oldest first, none
        claimed already (by this router, or, at a site, by another)."""

    @abc.abstractmethod
    async def remove(self, key: str) -> None:
        """Forget a claimed request: judged, or dropped."""

    @abc.abstractmethod
    async def release(self, key: str) -> None:
        """A claimed request not judged now (the cloud failed it): claimable again later."""

    def families(self) -> set[str]:
        """The families with requests kept."""
        return set(self.backlogs)

    def outstanding(self) -> dict[str, tuple[int, float | None]]:
        """Per family: items kept and when the oldest was deferred."""
        return {family: (b.items, b.oldest) for family, b in self.backlogs.items()}

    def expired(self, now: float, ages: Mapping[str, float]) -> list[Kept]:
        """Every kept request older than its family's ``max_age_s`` (``ages``), unclaimed; at a
        site the stream drops them itself, and this finds none."""
        late = []
        for family, backlog in self.backlogs.items():
            age = ages.get(family)
            if age is None:
                continue
            for kept in backlog.requests.values():
                if now - kept.created <= age:
                    break  # oldest first: the rest are younger
                if kept.key not in self.claimed:
                    late.append(kept)
        return late

    # -- the index, for the backends ---------------------------------------------------------
    def _room(self, family: str, items: int, size: int, bounds: OfflineSpec) -> str | None:
        backlog = self.backlogs.get(family, FamilyBacklog())
        if backlog.items + items > bounds.max_items:
            return FULL_ITEMS
        if backlog.size + size > bounds.max_bytes:
            return FULL_BYTES
        return None

    def _index(self, kept: Kept) -> None:
        backlog = self.backlogs.setdefault(kept.family, FamilyBacklog())
        backlog.requests[kept.key] = kept
        backlog.items += kept.items
        backlog.size += kept.size

    def _unindex(self, key: str) -> Kept | None:
        for family, backlog in self.backlogs.items():
            kept = backlog.requests.pop(key, None)
            if kept is not None:
                backlog.items -= kept.items
                backlog.size -= kept.size
                if not backlog.requests:
                    del self.backlogs[family]
                return kept
        return None


class LocalDeferredStore(DeferredStore):
    """One file per deferred request in ``folder`` (``--state-dir``'s ``deferred/``)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    async def start(self) -> None:
        await asyncio.to_thread(self._scan)

    def _scan(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for scratch in self.folder.glob(f".*{SUFFIX}.*.tmp"):  # a write cut short: never acknowledged
            scratch.unlink(missing_ok=True)
        found: list[Kept] = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            record = _read(path)
            if record is None:
                continue
            found.append(Kept(key=record.key, family=record.family, items=len(record.items),
                              size=path.stat().st_size, created=record.created_unix))  # fmt: skip
        for kept in sorted(found, key=lambda k: k.key):
            self._index(kept)
        if found:
            log.info("%d deferred request(s) kept by an earlier run, to be judged", len(found))

    async def keep(self, record: fpb.DeferredRequest, bounds: OfflineSpec) -> str | None:
        body = record.SerializeToString()
        kept = Kept(key=record.key, family=record.family, items=len(record.items), size=len(body),
                    created=record.created_unix)  # fmt: skip
        refused = self._room(kept.family, kept.items, kept.size, bounds)
        if refused is not None:
            return refused
        self._index(kept)  # counted at once: requests deferred meanwhile see the room it takes
        try:
            await asyncio.to_thread(write_atomically, self._path(kept.key), body)
        except OSError as exc:
            self._unindex(kept.key)
            log.warning("could not keep deferred request %s in %s: %s", kept.key, self.folder, exc)
            return STORE_FAILED
        return None

    async def claim(self, limit: int, families: frozenset[str]) -> list[fpb.DeferredRequest]:
        everything = [
            k
            for f in families
            if (b := self.backlogs.get(f))
            for k in b.requests.values()
            if k.key not in self.claimed
        ]
        everything.sort(key=lambda k: k.key)
        claimed = []
        for kept in everything[:limit]:
            record = await asyncio.to_thread(_read, self._path(kept.key))
            if record is None:  # gone, or set aside as unreadable
                self._unindex(kept.key)
                continue
            self.claimed.add(kept.key)
            claimed.append(record)
        return claimed

    async def remove(self, key: str) -> None:
        self.claimed.discard(key)
        if self._unindex(key) is not None:
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(os.unlink, self._path(key))

    async def release(self, key: str) -> None:
        self.claimed.discard(key)

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"


def _read(path: Path) -> fpb.DeferredRequest | None:
    """A kept request, or None: gone, or unreadable (set aside as ``.bad``, and logged)."""
    try:
        body = path.read_bytes()
    except FileNotFoundError:
        return None
    record = fpb.DeferredRequest()
    try:
        record.ParseFromString(body)
    except DecodeError:
        record.Clear()
    if not record.key or not record.family or f"{record.key}{SUFFIX}" != path.name:
        bad = path.with_suffix(".bad")
        with contextlib.suppress(OSError):
            os.replace(path, bad)
        log.warning("deferred request file %s does not read; set aside as %s", path, bad.name)
        return None
    return record
