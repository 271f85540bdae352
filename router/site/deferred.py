"""A site's deferred requests and corrections in NATS JetStream (``--site-state nats://``).

Every router of a site keeps what it defers in the site's NATS, so any router can judge it,
and a router that dies with a backlog leaves it to the others:

* **Deferred requests**: one stream per family, ``STRATUS_DEFERRED_<family>`` (subject
  ``stratus.deferred.<family>``), made from the family's ``[offline]`` bounds: work-queue
  retention (a request leaves once judged), ``max_msgs`` = ``max_items`` and ``max_bytes``
  with ``discard: new`` (past either the server refuses the *new* request, which the router
  counts, as a lone router's store does), and ``max_age`` = ``max_age_s`` (the server drops
  what is older; counted by the stream, not by the routers). At a site ``max_items`` bounds
  requests, each of one or more unsure items. A request is acknowledged (its answer sent
  provisional) once the stream stored it (JetStream's publish acknowledgement: on disk on the
  server, replicated as the stream is). Judges share one durable pull consumer per stream,
  ``stratus-judges``: each request goes to one router at a time; one not acknowledged within
  ``ACK_WAIT_S`` (its judge died) goes to another; one the cloud failed is handed back with a
  delay.
* **Corrections**: one stream, ``STRATUS_CORRECTIONS`` (subject ``stratus.corrections``),
  kept ``CORRECTIONS_MAX_AGE_S`` and at most ``CORRECTIONS_MAX_BYTES``; every router reads
  it from the start into its CorrectionLog, so an application reading corrections from any
  router of the site gets every router's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable
from typing import Final

import nats.errors
import nats.js.errors
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from router.offline.corrections import CorrectionSink
from router.offline.store import FULL_BYTES, FULL_ITEMS, STORE_FAILED, DeferredStore, Kept
from router.site.nats import NatsSiteState
from router.site.nats_watch import FAILURES
from stratus.cancellation import CancelWatch
from stratus.families.offline import OfflineSpec
from stratus.wire import fleet_pb2 as fpb

log = logging.getLogger("stratus.router.offline")

STREAM_PREFIX: Final = "STRATUS_DEFERRED_"
SUBJECT_PREFIX: Final = "stratus.deferred."
JUDGES: Final = "stratus-judges"
ACK_WAIT_S: Final = 60.0  # a judging call takes at most 10 s: past this, its judge is gone
RETRY_DELAY_S: Final = 1.0
REFRESH_S: Final = 2.0  # how often the backlog's size and age are read from the streams
CORRECTIONS_STREAM: Final = "STRATUS_CORRECTIONS"
CORRECTIONS_SUBJECT: Final = "stratus.corrections"
CORRECTIONS_MAX_AGE_S: Final = 7 * 86_400.0
CORRECTIONS_MAX_BYTES: Final = 256 << 20
MAXIMUM_MESSAGES: Final = re.compile(r"maximum messages", re.IGNORECASE)
MAXIMUM_BYTES: Final = re.compile(r"maximum bytes|insufficient resources", re.IGNORECASE)


def stream_token(family: str) -> str:
    """A family name as stream and subject names take it: letters, digits and ``-`` stay, any
    other character is ``_`` and its code (so two names never meet)."""
    return re.sub(r"[^A-Za-z0-9-]", lambda m: f"_{ord(m.group()):02x}", family)


class NatsDeferredStore(DeferredStore):
    """Deferred requests in the site's JetStream (see the module's docstring)."""

    def __init__(self, site: NatsSiteState, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.site = site
        self._clock = clock
        self._bounds: dict[str, OfflineSpec] = {}  # the config each family's stream was made with here
        self._subscriptions: dict[str, JetStreamContext.PullSubscription] = {}
        self._messages: dict[str, Msg] = {}  # claimed key -> its message, to acknowledge
        self._levels: dict[str, tuple[int, float | None]] = {}  # family -> (requests, oldest created)
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._refresher = asyncio.create_task(self._refresh_forever(), name="stratus-deferred-levels")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        for subscription in self._subscriptions.values():
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    def families(self) -> set[str]:
        return set(self._levels)

    def outstanding(self) -> dict[str, tuple[int, float | None]]:
        return dict(self._levels)

    def expired(self, now: float, ages: object) -> list[Kept]:
        return []  # the stream's max_age drops them

    async def keep(self, record: fpb.DeferredRequest, bounds: OfflineSpec) -> str | None:
        js = self.site.jetstream
        if js is None:
            return STORE_FAILED
        family = record.family
        try:
            await self._stream(js, family, bounds)
            await js.publish(
                SUBJECT_PREFIX + stream_token(family),
                record.SerializeToString(),
                timeout=self.site.op_timeout_s,
                stream=STREAM_PREFIX + stream_token(family),
                headers={"Nats-Msg-Id": record.key},
            )
        except nats.js.errors.APIError as exc:
            text = str(exc.description or exc)
            refused = (
                FULL_ITEMS
                if MAXIMUM_MESSAGES.search(text)
                else FULL_BYTES
                if MAXIMUM_BYTES.search(text)
                else None
            )
            if refused is None:
                log.warning("could not keep deferred request %s in %s: %s", record.key, self.site.url, text)
            return refused or STORE_FAILED
        except FAILURES as exc:
            log.warning("could not keep deferred request %s in %s: %s", record.key, self.site.url, exc)
            return STORE_FAILED
        count, oldest = self._levels.get(family, (0, None))
        self._levels[family] = (count + 1, oldest if oldest is not None else record.created_unix)
        return None

    async def _stream(self, js: JetStreamContext, family: str, bounds: OfflineSpec) -> None:
        """The family's stream, made (or its limits brought to ``bounds``) the first time here."""
        if self._bounds.get(family) == bounds:
            return
        config = api.StreamConfig(
            name=STREAM_PREFIX + stream_token(family),
            description=family,
            subjects=[SUBJECT_PREFIX + stream_token(family)],
            retention=api.RetentionPolicy.WORK_QUEUE,
            max_msgs=bounds.max_items,
            max_bytes=bounds.max_bytes,
            max_age=bounds.max_age_s,
            discard=api.DiscardPolicy.NEW,
            storage=api.StorageType.FILE,
        )
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:  # made before with other limits: take this family's now
            await js.update_stream(config)
        self._bounds[family] = bounds

    async def claim(self, limit: int, families: frozenset[str]) -> list[fpb.DeferredRequest]:
        js = self.site.jetstream
        if js is None:
            return []
        claimed: list[fpb.DeferredRequest] = []
        by_age = sorted(families, key=lambda f: self._levels.get(f, (0, None))[1] or float("inf"))
        for family in by_age:
            if len(claimed) >= limit:
                break
            claimed += await self._fetch(js, family, limit - len(claimed))
        return claimed

    async def _fetch(self, js: JetStreamContext, family: str, count: int) -> list[fpb.DeferredRequest]:
        try:
            subscription = await self._subscription(js, family)
            messages = await subscription.fetch(batch=count, timeout=0.05)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        except FAILURES as exc:
            log.debug("no deferred requests of %s fetched: %s", family, exc)
            return []
        fetched = []
        for message in messages:
            record = fpb.DeferredRequest()
            try:
                record.ParseFromString(message.data)
            except DecodeError:
                record.Clear()
            if not record.key or record.family != family:
                log.warning("a message of %s's deferred stream does not read: dropped", family)
                with contextlib.suppress(Exception):
                    await message.term()
                continue
            self._messages[record.key] = message
            fetched.append(record)
        return fetched

    async def _subscription(self, js: JetStreamContext, family: str) -> JetStreamContext.PullSubscription:
        found = self._subscriptions.get(family)
        if found is None:
            config = api.ConsumerConfig(
                durable_name=JUDGES, ack_wait=ACK_WAIT_S, ack_policy=api.AckPolicy.EXPLICIT, max_deliver=-1
            )
            found = await js.pull_subscribe(
                SUBJECT_PREFIX + stream_token(family), durable=JUDGES, stream=STREAM_PREFIX + stream_token(family),
                config=config,
            )  # fmt: skip
            self._subscriptions[family] = found
        return found

    async def remove(self, key: str) -> None:
        message = self._messages.pop(key, None)
        if message is not None:
            with contextlib.suppress(Exception):  # not acknowledged: judged again, same verdict
                await message.ack()

    async def release(self, key: str) -> None:
        message = self._messages.pop(key, None)
        if message is not None:
            with contextlib.suppress(Exception):  # not handed back: redelivered after ACK_WAIT_S
                await message.nak(delay=RETRY_DELAY_S)

    async def _refresh_forever(self) -> None:
        cancels = CancelWatch()  # nats-py may swallow the cancel of close()
        while True:
            cancels.check()
            with contextlib.suppress(*FAILURES):
                await self._refresh()
            await asyncio.sleep(REFRESH_S)

    async def _refresh(self) -> None:
        """Each family's stream: requests waiting, and when the oldest was deferred."""
        js = self.site.jetstream
        if js is None:
            return
        levels: dict[str, tuple[int, float | None]] = {}
        for info in await js.streams_info():
            name, family = info.config.name or "", info.config.description or ""
            if not name.startswith(STREAM_PREFIX) or not family:
                continue
            state = info.state
            oldest = await self._created(js, name, state.first_seq) if state.messages else None
            levels[family] = (state.messages, oldest)
        self._levels = levels

    async def _created(self, js: JetStreamContext, stream: str, sequence: int) -> float | None:
        with contextlib.suppress(*FAILURES):
            raw = await js.get_msg(stream, seq=sequence)
            record = fpb.DeferredRequest()
            with contextlib.suppress(DecodeError):
                record.ParseFromString(raw.data or b"")
                return record.created_unix
        return None


class NatsCorrections(CorrectionSink):
    """Corrections in the site's stream: each router publishes its own and reads everyone's."""

    delivers_own = True

    def __init__(self, site: NatsSiteState) -> None:
        self.site = site
        self._reader: asyncio.Task[None] | None = None

    async def start(self, deliver: Callable[[fpb.Correction], None]) -> None:
        self._reader = asyncio.create_task(self._read(deliver), name="stratus-corrections-reader")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    async def append(self, corrections: list[fpb.Correction]) -> None:
        """Published and stored by the stream before the judged request is acknowledged."""
        js = await self._ready()
        for correction in corrections:
            await js.publish(CORRECTIONS_SUBJECT, correction.SerializeToString(), timeout=self.site.op_timeout_s,
                             stream=CORRECTIONS_STREAM)  # fmt: skip

    async def _ready(self) -> JetStreamContext:
        js = self.site.jetstream
        if js is None:
            raise ConnectionError(f"the site's store {self.site.url} cannot be reached")
        config = api.StreamConfig(
            name=CORRECTIONS_STREAM,
            subjects=[CORRECTIONS_SUBJECT],
            retention=api.RetentionPolicy.LIMITS,
            max_age=CORRECTIONS_MAX_AGE_S,
            max_bytes=CORRECTIONS_MAX_BYTES,
            discard=api.DiscardPolicy.OLD,
            storage=api.StorageType.FILE,
        )
        with contextlib.suppress(nats.js.errors.BadRequestError):  # it exists
            await js.add_stream(config)
        return js

    async def _read(self, deliver: Callable[[fpb.Correction], None]) -> None:
        """Every correction in the stream, then each new one, across reconnects."""
        last, cancels = 0, CancelWatch()  # nats-py may swallow the cancel of close()
        while True:
            cancels.check()
            try:
                js = await self._ready()
                subscription = await js.subscribe(
                    CORRECTIONS_SUBJECT, stream=CORRECTIONS_STREAM, ordered_consumer=True,
                    config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=last + 1),
                )  # fmt: skip
                try:
                    async for message in subscription.messages:
                        last = self._deliver(message, last, deliver)
                finally:  # its flow-control and heartbeat tasks end with it
                    with contextlib.suppress(Exception):
                        await subscription.unsubscribe()
            except (*FAILURES, ConnectionError) as exc:
                log.debug("corrections stream: %s; reading again", exc)
                await asyncio.sleep(RETRY_DELAY_S)

    @staticmethod
    def _deliver(message: Msg, last: int, deliver: Callable[[fpb.Correction], None]) -> int:
        """One message handed over, unless it was already (after a resubscription); the last sequence."""
        sequence = message.metadata.sequence.stream
        if sequence <= last:
            return last
        correction = fpb.Correction()
        with contextlib.suppress(DecodeError):
            correction.ParseFromString(message.data)
            deliver(correction)
        return sequence
