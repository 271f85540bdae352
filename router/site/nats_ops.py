"""A NATS site state's operations on one key, each as the JetStream requests it takes.

:class:`~router.site.nats.NatsSiteState` owns the connection: it connects, binds the bucket
again after each reconnect, keeps why the store is down, and runs each operation within the
operation timeout, refusing it at once while the bucket does not answer. What an operation
asks is apart from all that, and here: it is handed the live JetStream context and bucket,
and reads the bucket's stream directly (a key's last message by subject, a revision by
sequence), so that a revision, a tombstone and the server's time of a put are what the
stream says, and a compare-and-swap that loses names the revision it lost to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from router.site import Entry
from router.site.common import conflict
from router.site.nats_watch import FAILURES, entry_of_raw, seconds

WRONG_LAST_SEQUENCE: Final = (10071, 10164)  # JetStream's "wrong last sequence" error codes
MAX_HISTORY: Final = 64  # NATS KV keeps at most 64 revisions per key


class BucketOperations:
    """Get, put, delete and history on the bucket whose stream is ``stream`` (its keys the
    subjects under ``subjects``); ``clock`` dates a put whose server time cannot be read."""

    def __init__(self, stream: str, subjects: str, *, clock: Callable[[], float]) -> None:
        self._stream, self._subjects, self._clock = stream, subjects, clock

    async def latest(self, js: JetStreamContext, key: str) -> Entry | None:
        """The key's live revision; None where it has none (never written, or deleted)."""
        try:
            raw = await js.get_msg(self._stream, subject=self._subjects + key)
        except nats.js.errors.NotFoundError:
            return None
        entry = entry_of_raw(key, raw)
        return None if entry.deleted else entry

    async def _live_revision(self, js: JetStreamContext, key: str) -> int:
        entry = await self.latest(js, key)
        return entry.revision if entry else 0

    async def put(
        self, js: JetStreamContext, kv: KeyValue, key: str, value: bytes, expected: int | None
    ) -> Entry:
        try:
            if expected is None:
                revision = await kv.put(key, value)
            elif expected == 0:
                revision = await kv.create(key, value)  # over a tombstone too: nats-py reads it first
            else:
                revision = await kv.update(key, value, last=expected)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise conflict(key, expected or 0, await self._live_revision(js, key)) from None
        return Entry(key=key, value=bytes(value), revision=revision, at=await self._taken_at(js, revision))

    async def _taken_at(self, js: JetStreamContext, revision: int) -> float:
        """The server's time for a revision (the ack has none), so that the entry a put returns
        is the one a read or a watch gives; this router's clock if the server cannot say now:
        the put is made, and must not be reported as lost."""
        try:
            raw = await js.get_msg(self._stream, seq=revision)
        except FAILURES:
            return self._clock()
        return seconds(raw.time) if raw.time is not None else self._clock()

    async def delete(self, js: JetStreamContext, kv: KeyValue, key: str, expected: int | None) -> None:
        """The revision checked here first (a key with none left as it is), then by the server."""
        current = await self._live_revision(js, key)
        if expected is not None and expected != current:
            raise conflict(key, expected, current)
        if not current:
            return
        try:
            await kv.delete(key, last=expected)  # the server checks the revision again
        except nats.js.errors.APIError as exc:
            if exc.err_code not in WRONG_LAST_SEQUENCE:
                raise
            raise conflict(key, expected or 0, await self._live_revision(js, key)) from None

    async def history(self, js: JetStreamContext, key: str) -> list[Entry]:
        """Each kept message of the key, by "next message of this subject from sequence N": one
        request a revision, no consumer to make and clean up."""
        found: list[Entry] = []
        sequence = 1
        while len(found) <= MAX_HISTORY:
            try:
                raw = await js.get_msg(self._stream, seq=sequence, subject=self._subjects + key, next=True)
            except nats.js.errors.NotFoundError:
                break
            found.append(entry_of_raw(key, raw))
            sequence = (raw.seq or sequence) + 1
        return found
