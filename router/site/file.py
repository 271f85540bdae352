"""``file:PATH``: a lone router's site state, in one JSON file.

The whole store is rewritten on every change (a scratch file in the same folder, fsync, a
rename over the file, fsync of the folder), so a crash leaves the file before or after the
change, never between; a store of a few rollouts and drains is a few KiB, so writing it whole
costs less than any journal would. The revision counter is in the file, so revisions stay
monotone across restarts. A file that cannot be read back is refused by name at start: an
emptied store would silently undo every rollout and drain it held.

Writes run on the store's own one-thread executor, so the router's event loop never waits on
an fsync; watches are in-process (one queue per watch), as only this process writes the file.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from router.site import Entry, SiteState, check_key, unavailable
from router.site.common import WatchCursor, check_prefix, check_value, conflict
from stratus.durable import write_atomically
from stratus.errors import ConfigError

FORMAT: Final = 1
DEFAULT_HISTORY: Final = 16
T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class _Watcher:
    prefix: str
    queue: asyncio.Queue[Entry | None] = field(default_factory=asyncio.Queue)


class FileSiteState(SiteState):
    """Every key's last ``history`` revisions (deletes as tombstones) in the file at ``path``."""

    def __init__(
        self, path: Path | str, *, history: int = DEFAULT_HISTORY, clock: Callable[[], float] = time.time
    ) -> None:
        if history < 1:
            raise ConfigError(f"file:{path}: history must keep at least one revision per key, not {history}")
        self.path = Path(path)
        self.url = f"file:{path}"
        self._history = history
        self._clock = clock
        self._revision = 0
        self._keys: dict[str, list[Entry]] = {}
        self._watchers: set[_Watcher] = set()
        self._lock = asyncio.Lock()
        self._executor: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        """Load the file (none yet: an empty store); a file that cannot be read is a ConfigError."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="site-file")
        try:
            self._revision, self._keys = await asyncio.get_running_loop().run_in_executor(
                executor, load, self.path
            )
        except BaseException:
            executor.shutdown()
            raise
        self._executor = executor

    async def close(self) -> None:
        async with self._lock:  # a write under way finishes first
            executor, self._executor = self._executor, None
            for watcher in self._watchers:
                watcher.queue.put_nowait(None)
            if executor is not None:
                executor.shutdown()

    @property
    def connected(self) -> bool:
        return self._executor is not None

    def describe(self) -> str:
        if not self.connected:
            return f"{self.url}: not open"
        return f"{self.url}: {len(self._live(''))} live keys, at revision {self._revision}"

    async def get(self, key: str) -> Entry | None:
        check_key(key)
        self._check_open(f"the read of {key}")
        kept = self._keys.get(key)
        return kept[-1] if kept and not kept[-1].deleted else None

    async def put(self, key: str, value: bytes, *, expected: int | None = None) -> Entry:
        check_value(key, value)
        async with self._lock:
            self._check_expected(key, expected, f"the put of {key}")
            entry = Entry(key=key, value=bytes(value), revision=self._revision + 1, at=self._clock())
            await self._commit(entry, f"the put of {key}")
        return entry

    async def delete(self, key: str, *, expected: int | None = None) -> None:
        """A key with no live revision stays as it is: a tombstone would tell no one anything."""
        check_key(key)
        async with self._lock:
            if self._check_expected(key, expected, f"the delete of {key}"):
                tombstone = Entry(
                    key=key, value=b"", revision=self._revision + 1, at=self._clock(), deleted=True
                )
                await self._commit(tombstone, f"the delete of {key}")

    async def history(self, key: str) -> list[Entry]:
        check_key(key)
        self._check_open(f"the history of {key}")
        return list(self._keys.get(key, ()))

    async def entries(self, prefix: str) -> list[Entry]:
        check_prefix(prefix)
        self._check_open(f"the listing of {prefix or 'every key'}")
        return self._live(prefix)

    async def watch(self, prefix: str) -> AsyncIterator[Entry]:
        check_prefix(prefix)
        self._check_open(f"the watch of {prefix or 'every key'}")
        watcher, cursor = _Watcher(prefix), WatchCursor(prefix)
        snapshot = self._live(prefix)  # and registered before any await: no change falls between
        self._watchers.add(watcher)
        try:
            for entry in snapshot:
                if cursor.accept(entry):
                    yield entry
            while (change := await watcher.queue.get()) is not None:
                if cursor.accept(change):
                    yield change
        finally:
            self._watchers.discard(watcher)

    def _live(self, prefix: str) -> list[Entry]:
        latest = (kept[-1] for key, kept in self._keys.items() if key.startswith(prefix))
        return sorted((entry for entry in latest if not entry.deleted), key=lambda entry: entry.revision)

    def _check_open(self, what: str) -> None:
        if self._executor is None:
            raise unavailable(self.url, what, "the store is not open")

    def _check_expected(self, key: str, expected: int | None, what: str) -> int:
        """The key's live revision (0: none), once it is the one the change read."""
        self._check_open(what)
        kept = self._keys.get(key)
        current = kept[-1].revision if kept and not kept[-1].deleted else 0
        if expected is not None and expected != current:
            raise conflict(key, expected, current)
        return current

    async def _commit(self, entry: Entry, what: str) -> None:
        """Write the store with ``entry``, then take it: what a reader or watcher sees is on disk."""
        keys = {**self._keys, entry.key: [*self._keys.get(entry.key, ()), entry][-self._history :]}
        data = encode(entry.revision, keys)
        try:
            await self._in_executor(write_atomically, self.path, data)
        except OSError as exc:
            raise unavailable(self.url, what, exc) from exc
        self._revision, self._keys = entry.revision, keys
        for watcher in self._watchers:
            if entry.key.startswith(watcher.prefix):
                watcher.queue.put_nowait(entry)

    async def _in_executor(self, call: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, call, *args)


def load(path: Path) -> tuple[int, dict[str, list[Entry]]]:
    """The counter and the revisions kept; none for a file not made yet."""
    if not path.parent.is_dir():
        raise ConfigError(f"site state file {path}: the folder {path.parent} does not exist")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return 0, {}
    except OSError as exc:
        raise ConfigError(f"site state file {path} cannot be read ({exc})") from exc
    try:
        return decode(json.loads(raw))
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise ConfigError(
            f"site state file {path} is not a site state this router wrote ({exc}); it is left as it is: "
            "restore it, or move it aside to start with an empty store"
        ) from exc


def decode(document: Any) -> tuple[int, dict[str, list[Entry]]]:
    if document.get("format") != FORMAT:
        raise ValueError(f"format {document.get('format')!r}, not {FORMAT}")
    revision = document["revision"]
    if not isinstance(revision, int) or revision < 0:
        raise ValueError(f"revision {revision!r}")
    keys = {check_key(key): [_entry(key, row) for row in rows] for key, rows in document["keys"].items()}
    for key, kept in keys.items():
        revisions = [entry.revision for entry in kept]
        if not kept or revisions != sorted(set(revisions)) or revisions[-1] > revision:
            raise ValueError(f"{key}'s revisions {revisions} (the store is at {revision})")
    return revision, keys


def _entry(key: str, row: dict[str, Any]) -> Entry:
    revision, at, deleted = row["revision"], row["at"], row["deleted"]
    if not isinstance(revision, int) or not isinstance(at, int | float) or not isinstance(deleted, bool):
        raise ValueError(f"{key}: a revision of the wrong shape: {row!r:.200}")
    value = base64.b64decode(row["value"], validate=True)
    return Entry(key=key, value=value, revision=revision, at=float(at), deleted=deleted)


def encode(revision: int, keys: dict[str, list[Entry]]) -> bytes:
    rows = {key: [_row(entry) for entry in kept] for key, kept in sorted(keys.items())}
    return json.dumps({"format": FORMAT, "revision": revision, "keys": rows}, indent=1).encode()


def _row(entry: Entry) -> dict[str, Any]:
    value = base64.b64encode(entry.value).decode("ascii")
    return {"revision": entry.revision, "at": entry.at, "deleted": entry.deleted, "value": value}
