"""Corrections: the provisional answers the cloud, judging them later, disagreed with.

Each one names the client's request id and the item, the provisional answer and its tier,
the cloud's answer, and both times. :class:`CorrectionLog` keeps them for readers (``stratus
fleet corrections``, the ``Fleet.Corrections`` stream, the SDK's ``Client.corrections()``):
past ones from a time on, and each new one to every follower as it is made.

Where they are kept is a :class:`CorrectionSink`'s: on a lone router a JSON-lines file under
``--state-dir`` (:class:`FileCorrections`: ``corrections.jsonl``, appended and synced before the
deferred request it judges is removed, so a crash between the two judges that request again
rather than losing its correction; rotated once to ``.1`` past ``MAX_FILE_BYTES``); at a site
the site's NATS (router/site/deferred.py), read back by every router. The newest
``MAX_KEPT`` are held in memory for readers.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Final

from google.protobuf import json_format

from stratus.errors import Overloaded
from stratus.wire import fleet_pb2 as fpb

log = logging.getLogger("stratus.router.offline")

MAX_KEPT: Final = 100_000  # corrections held in memory for `--since` readers
MAX_FILE_BYTES: Final = 64 << 20
FOLLOWER_QUEUE: Final = 4096  # corrections a follower may fall behind by before it is cut off
MAX_FOLLOWERS: Final = 64


class CorrectionSink(abc.ABC):
    """Where corrections are kept. ``start`` hands over what is kept already (and, where the
    sink is shared, each one another router adds) through ``deliver``."""

    @abc.abstractmethod
    async def start(self, deliver: Callable[[fpb.Correction], None]) -> None: ...

    async def close(self) -> None:
        return None

    @abc.abstractmethod
    async def append(self, corrections: list[fpb.Correction]) -> None:
        """Kept durably when it returns."""

    # A shared sink delivers what is appended here too (it reads everything back); a local
    # one does not, and the log delivers its own at once.
    delivers_own: bool = False


class FileCorrections(CorrectionSink):
    def __init__(self, path: Path) -> None:
        self.path = path

    async def start(self, deliver: Callable[[fpb.Correction], None]) -> None:
        for correction in await asyncio.to_thread(_read_all, self.path):
            deliver(correction)

    async def append(self, corrections: list[fpb.Correction]) -> None:
        await asyncio.to_thread(_append, self.path, corrections)


class CorrectionLog:
    """Corrections in memory, kept where ``sink`` keeps them; followers get each new one."""

    def __init__(self, sink: CorrectionSink | None = None) -> None:
        self.sink = sink
        self.kept: collections.deque[fpb.Correction] = collections.deque(maxlen=MAX_KEPT)
        self._followers: set[asyncio.Queue[fpb.Correction | None]] = set()
        self.closed = False

    async def start(self) -> None:
        if self.sink is not None:
            await self.sink.start(self._deliver)

    async def add(self, corrections: Iterable[fpb.Correction]) -> None:
        """Keep ``corrections`` where the sink keeps them (durably), then hand each to every follower."""
        made = list(corrections)
        if not made:
            return
        if self.sink is not None:
            await self.sink.append(made)
            if self.sink.delivers_own:
                return
        for correction in made:
            self._deliver(correction)

    def _deliver(self, correction: fpb.Correction) -> None:
        self.kept.append(correction)
        for queue in list(self._followers):
            if queue.qsize() >= FOLLOWER_QUEUE:  # too slow a reader: cut off, not held in memory
                self._followers.discard(queue)
                queue.put_nowait(None)  # the one place kept for the end mark
            else:
                queue.put_nowait(correction)

    def since(self, since_unix: float = 0.0, family: str = "") -> list[fpb.Correction]:
        return [c for c in self.kept if c.judged_unix >= since_unix and (not family or c.family == family)]

    async def read(
        self, *, since_unix: float = 0.0, family: str = "", follow: bool = False
    ) -> AsyncIterator[fpb.Correction]:
        """The corrections kept from ``since_unix`` on, then (``follow``) each new one."""
        if not follow:
            for correction in self.since(since_unix, family):
                yield correction
            return
        if len(self._followers) >= MAX_FOLLOWERS:
            raise Overloaded(f"{MAX_FOLLOWERS} readers already follow the corrections: try again later")
        queue: asyncio.Queue[fpb.Correction | None] = asyncio.Queue(maxsize=FOLLOWER_QUEUE + 1)
        self._followers.add(queue)  # before the past is read: nothing falls between the two
        try:
            for correction in self.since(since_unix, family):
                yield correction
            while (new := await queue.get()) is not None:
                if not family or new.family == family:
                    yield new
            if self.closed:
                return
            raise Overloaded(
                f"this reader fell {FOLLOWER_QUEUE} corrections behind and was cut off: read again "
                "with --since the last one it got"
            )
        finally:
            self._followers.discard(queue)

    async def close(self) -> None:
        if self.sink is not None:
            await self.sink.close()
        self.closed = True
        for queue in list(self._followers):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)
        self._followers.clear()


def _append(path: Path, corrections: list[fpb.Correction]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size >= MAX_FILE_BYTES:
            os.replace(path, path.with_suffix(path.suffix + ".1"))
    lines = "".join(
        json_format.MessageToJson(c, indent=None, preserving_proto_field_name=True) + "\n"
        for c in corrections
    )
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(lines)
        handle.flush()
        os.fsync(handle.fileno())


def _read_all(path: Path) -> list[fpb.Correction]:
    """The rotated file's corrections, then the current one's (the newest MAX_KEPT); a line
    that does not read (a crash mid-write) is skipped."""
    found: list[fpb.Correction] = []
    for part in (path.with_suffix(path.suffix + ".1"), path):
        with contextlib.suppress(FileNotFoundError):
            for line in part.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(json_format.ParseError, ValueError):
                    found.append(json_format.Parse(line, fpb.Correction()))
    return found[-MAX_KEPT:]
