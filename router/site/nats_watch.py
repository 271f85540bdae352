"""A NATS site state's watches: an ephemeral push consumer per watch, made again after each
reconnect from the last revision the watch handled plus one (the first one delivers each
key's last revision, as NATS's KV watchers do), so that what changed meanwhile comes first and
nothing is given twice; and the entries a bucket's messages are read as."""

from __future__ import annotations

import asyncio
import datetime
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE

from router.site import Entry
from router.site.common import WatchCursor
from stratus.cancellation import CancelWatch, keeping_cancel

log = logging.getLogger("stratus.site-state")

FAILURES: Final = (nats.errors.Error, OSError, asyncio.TimeoutError)
ACK_V1_TOKENS: Final = 9  # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<seq>.<time>.<pending>
# A watch's consumer outlives a short disconnect (then it is made again anyway), not a gone client.
CONSUMER_IDLE_S: Final = 30.0


class Signal(enum.Enum):
    RESET = "the store reconnected: subscribe again"
    CLOSED = "the store closed"


@dataclass(frozen=True)
class Delivered:
    generation: int  # the subscription it came on: one cut off may still hand some over
    entry: Entry
    pending: int  # what the consumer had left to deliver: 0, it has caught up


@dataclass(eq=False)
class Watch:
    prefix: str
    queue: asyncio.Queue[Delivered | Signal] = field(default_factory=asyncio.Queue)
    cursor: WatchCursor = field(init=False)
    generation: int = 0
    subscription: JetStreamContext.PushSubscription | None = None
    caught_up: bool = False  # every key's last revision delivered: resume by sequence from now on

    def __post_init__(self) -> None:
        self.cursor = WatchCursor(self.prefix)


class Consumers:
    """The consumers of the watches on ``stream`` (its subjects under ``subjects``), on the
    JetStream context ``jetstream()`` gives while connected; ``url`` names the store in logs."""

    def __init__(
        self,
        url: str,
        stream: str,
        subjects: str,
        *,
        jetstream: Callable[[], JetStreamContext | None],
        connected: Callable[[], bool],
        retry_s: float,
    ) -> None:
        self.url, self._stream, self._subjects = url, stream, subjects
        self._jetstream, self._connected, self._retry_s = jetstream, connected, retry_s

    async def snapshot(self, prefix: str) -> list[Entry]:
        """Each live key's last revision: a watch read until its consumer has caught up."""
        watch = Watch(prefix)
        live: dict[str, Entry] = {}
        try:
            await keeping_cancel(self.subscribe(watch))
            while not watch.caught_up:
                item = await watch.queue.get()
                if not isinstance(item, Delivered) or (entry := self._take(watch, item)) is None:
                    continue
                if entry.deleted:
                    del live[entry.key]  # the cursor gives only the end of a key it gave
                else:
                    live[entry.key] = entry
        finally:
            await self.unsubscribe(watch)
        return sorted(live.values(), key=lambda entry: entry.revision)

    async def next(self, watch: Watch) -> Entry | None:
        """The watch's next entry; None once the store is closed."""
        cancels = CancelWatch()
        while True:
            cancels.check()
            if watch.subscription is None and self._connected():
                try:
                    await self.subscribe(watch)
                except FAILURES as exc:
                    log.debug("site state %s: a watch could not subscribe yet (%s)", self.url, exc)
            item = await self._wait(watch)
            if item is Signal.CLOSED:
                return None
            if item is Signal.RESET:
                await self.unsubscribe(watch)
            elif isinstance(item, Delivered) and (entry := self._take(watch, item)):
                return entry

    async def _wait(self, watch: Watch) -> Delivered | Signal | None:
        """The next item; while not subscribed, None after a moment (to try subscribing again)."""
        if watch.subscription is not None:
            return await watch.queue.get()
        try:
            async with asyncio.timeout(self._retry_s):
                return await watch.queue.get()
        except TimeoutError:
            return None

    @staticmethod
    def _take(watch: Watch, item: Delivered) -> Entry | None:
        if item.generation != watch.generation:
            return None
        if item.pending == 0:
            watch.caught_up = True
        return watch.cursor.accept(item.entry)

    async def subscribe(self, watch: Watch) -> None:
        """A consumer from where the watch is: each key's last revision at first, then every
        message after the last one handled."""
        js = self._jetstream()
        if js is None:
            raise nats.errors.ConnectionClosedError
        watch.generation += 1
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=CONSUMER_IDLE_S,
        )
        before = 0
        if watch.caught_up:
            config.deliver_policy, config.opt_start_seq = (
                api.DeliverPolicy.BY_START_SEQUENCE,
                watch.cursor.last + 1,
            )
        else:
            config.deliver_policy = api.DeliverPolicy.LAST_PER_SUBJECT
            before = (await js.stream_info(self._stream)).state.last_seq
        subscription = await js.subscribe(
            self._subjects + _filter(watch.prefix), stream=self._stream, cb=self._feed(watch), config=config
        )
        watch.subscription = subscription
        if not watch.caught_up:
            info = await subscription.consumer_info()
            if info.num_pending == 0 and (info.delivered is None or not info.delivered.consumer_seq):
                watch.caught_up = True  # nothing under the prefix: the changes start after `before`
                watch.cursor.last = max(watch.cursor.last, before)

    def _feed(self, watch: Watch) -> Callable[[Msg], Awaitable[None]]:
        generation, skip = watch.generation, len(self._subjects)

        async def delivered(msg: Msg) -> None:
            meta = msg.metadata
            entry = _entry(
                msg.subject[skip:], msg.data, meta.sequence.stream, _delivered_at(msg), msg.headers
            )
            watch.queue.put_nowait(Delivered(generation, entry, meta.num_pending))

        return delivered

    async def unsubscribe(self, watch: Watch) -> None:
        subscription, watch.subscription = watch.subscription, None
        watch.generation += 1  # what the old one still hands over is dropped
        if subscription is not None:
            try:
                await subscription.unsubscribe()
            except FAILURES as exc:  # the connection is gone; the server drops the consumer itself
                log.debug("site state %s: a watch's consumer was left to expire (%s)", self.url, exc)


def _filter(prefix: str) -> str:
    """The subject filter for ``prefix``: NATS wildcards match whole words, so a prefix that
    ends mid-word is filtered on the words before it and the rest is left to the cursor."""
    words = prefix.rpartition(".")[0] if not prefix.endswith(".") else prefix[:-1]
    return f"{words}.>" if words else ">"


def entry_of_raw(key: str, raw: api.RawStreamMsg) -> Entry:
    return _entry(key, raw.data, raw.seq or 0, seconds(raw.time) if raw.time else 0.0, raw.headers)


def _entry(key: str, data: bytes | None, revision: int, at: float, headers: dict[str, str] | None) -> Entry:
    headers = headers or {}
    deleted = headers.get(KV_OP) in (KV_DEL, KV_PURGE) or KV_MARKER_REASON in headers
    return Entry(
        key=key, value=b"" if deleted else bytes(data or b""), revision=revision, at=at, deleted=deleted
    )


# Both ways the server tells a message's time end in whole microseconds, made seconds by one
# exact division, so that a read, a watch and a put give one entry the same ``at``: a direct
# read's ISO time is cut to microseconds by nats-py, a delivery's nanoseconds are cut here.
_EPOCH: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_MICROSECOND: Final = datetime.timedelta(microseconds=1)


def seconds(at: datetime.datetime) -> float:
    return ((at - _EPOCH) // _MICROSECOND) / 1_000_000


def _delivered_at(msg: Msg) -> float:
    tokens = Msg.Metadata._get_metadata_fields(msg.reply)
    nanoseconds = int(tokens[7] if len(tokens) == ACK_V1_TOKENS else tokens[Msg.Ack.Timestamp])
    return (nanoseconds // 1000) / 1_000_000
