"""``nats://HOST:PORT[,HOST:PORT]``: a site's shared state in a JetStream key-value bucket.

One task of the store's own (started by :meth:`NatsSiteState.start`, ended by ``close``)
connects, binds the bucket (creating it if missing) and binds it again after every reconnect;
nats-py reconnects forever in the background. Until the bucket answers, ``connected`` is false
and every operation fails at once with StoreUnavailable naming the URL: an operator's change is
refused, never left waiting, and the request path never calls the store.

A watch is an ephemeral push consumer of the watch's own, made again after each reconnect from
the last revision the watch handled plus one (the first one delivers each key's last revision,
as NATS's KV watchers do), so what changed meanwhile comes first and nothing is given twice.
Revisions are the stream's sequence numbers: one order for the whole bucket, as the contract has it.
Watches and the entries messages are read as: :mod:`router.site.nats_watch`; the requests each
operation makes: :mod:`router.site.nats_ops`.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Final, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from router.site import MAX_VALUE_BYTES, Entry, SiteState, check_key, unavailable
from router.site.common import check_prefix, check_value
from router.site.nats_config import client_context, credentials_of, servers_of
from router.site.nats_ops import MAX_HISTORY, BucketOperations
from router.site.nats_watch import FAILURES, Consumers, Signal, Watch
from stratus.cancellation import CancelWatch, keeping_cancel
from stratus.errors import ConfigError
from stratus.serving.channels import TlsSettings

log = logging.getLogger("stratus.site-state")
T = TypeVar("T")
# What a failed call to the server raises: nats-py's errors (KV ones included), the socket's, a timeout.
# What a closed connection raises, whatever closed it.
BARE_FAILURES: Final = (ConnectionResetError, BrokenPipeError, nats.errors.UnexpectedEOF)


class NatsSiteState(SiteState):
    """The bucket ``bucket`` on the servers of ``url``, keeping ``history`` revisions per key."""

    shared = True

    def __init__(
        self,
        url: str,
        *,
        bucket: str = "stratus-site",
        tls: ssl.SSLContext | TlsSettings | None = None,
        creds: Path | str | None = None,
        history: int = 16,
        connect_timeout_s: float = 2.0,
        op_timeout_s: float = 2.0,
        reconnect_wait_s: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 1 <= history <= MAX_HISTORY:
            raise ConfigError(
                f"{url}: a NATS bucket keeps 1 to {MAX_HISTORY} revisions per key, not {history}"
            )
        self.url, self.bucket = url, bucket
        self._servers = servers_of(url)
        self._tls = client_context(tls)
        self._credentials = credentials_of(creds)
        self._history, self._clock = history, clock
        self._connect_timeout_s, self._op_timeout_s = connect_timeout_s, op_timeout_s
        self._reconnect_wait_s = reconnect_wait_s
        stream, subjects = f"KV_{bucket}", f"$KV.{bucket}."
        self._ops = BucketOperations(stream, subjects, clock=clock)
        self._client = Client()
        self._js: JetStreamContext | None = None
        self._kv: KeyValue | None = None  # set while the bucket answers
        self._keeper: asyncio.Task[None] | None = None
        self._reconnected = asyncio.Event()
        self._watches: set[Watch] = set()
        self._consumers = Consumers(
            url,
            stream,
            subjects,
            jetstream=lambda: self._js,
            connected=lambda: self.connected,
            retry_s=reconnect_wait_s,
        )
        self._closed = False
        self._down_since: float | None = None
        self._why, self._why_tells = "not started", False

    # -- connection ------------------------------------------------------------------------

    async def start(self) -> None:
        """Returns at once: the store's task connects, and keeps connecting while it cannot."""
        if self._keeper is None and not self._closed:
            self._down_since, self._why = self._clock(), "connecting"
            self._keeper = asyncio.create_task(self._keep(), name=f"site state {self.url}")

    async def close(self) -> None:
        self._closed, self._kv = True, None
        for watch in self._watches:
            watch.queue.put_nowait(Signal.CLOSED)
        if self._keeper is not None:  # a client never started has nothing to close
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            await self._client.close()

    @property
    def connected(self) -> bool:
        return self._kv is not None and self._client.is_connected

    @property
    def jetstream(self) -> JetStreamContext | None:
        """The connection's JetStream, while the store answers: what else the site keeps in
        NATS (router/site/deferred.py: deferred requests and corrections) uses it."""
        return self._js if self.connected else None

    @property
    def client(self) -> Client:
        return self._client

    @property
    def op_timeout_s(self) -> float:
        return self._op_timeout_s

    def describe(self) -> str:
        where = f"{self.url} (bucket {self.bucket})"
        if self._closed:
            return f"{where}: closed"
        if self.connected:
            return f"{where}: connected"
        since = datetime.datetime.fromtimestamp(self._down_since or self._clock(), datetime.UTC)
        return f"{where}: unreachable since {since:%Y-%m-%d %H:%M:%S} UTC ({self._why})"

    async def _keep(self) -> None:
        try:
            await keeping_cancel(self._connect())  # nats-py tries again until it connects
        except Exception as exc:  # not a server's answer (those it retries): say so, keep `connected` false
            log.exception("site state %s: cannot connect", self.url)
            self._why = f"cannot connect: {exc}"
            return
        while True:
            await self._bind()
            for watch in self._watches:
                watch.queue.put_nowait(Signal.RESET)
            await self._reconnected.wait()
            self._reconnected.clear()

    async def _connect(self) -> None:
        credentials = self._credentials
        await self._client.connect(
            servers=self._servers,
            tls=self._tls,
            # nats-py annotates these seconds as int; it hands them to asyncio, which takes floats
            connect_timeout=self._connect_timeout_s,  # type: ignore[arg-type]
            reconnect_time_wait=self._reconnect_wait_s,  # type: ignore[arg-type]
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            ping_interval=5,  # a silent peer is found within three pings, not nats-py's 4 minutes
            max_outstanding_pings=2,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            name="stratus-router",
            user=credentials.user,
            password=credentials.password,
            token=credentials.token,
            user_credentials=credentials.creds_file,
        )

    async def _bind(self) -> None:
        """Bind the bucket (make it if it is missing), trying again while JetStream cannot answer
        (it is still recovering its streams for a moment after a server restarts)."""
        cancels = CancelWatch()
        while True:
            try:
                async with asyncio.timeout(self._op_timeout_s):
                    self._kv = await self._bucket()
            except FAILURES as exc:
                cancels.check()
                self._note_down(exc)
                await asyncio.sleep(self._reconnect_wait_s)
                continue
            cancels.check()
            log.info("site state %s: connected", self.url)
            self._down_since, self._why_tells = None, False
            return

    async def _bucket(self) -> KeyValue:
        self._js = self._client.jetstream(timeout=self._op_timeout_s)
        try:
            return await self._js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            return await self._js.create_key_value(
                bucket=self.bucket, history=self._history, max_value_size=MAX_VALUE_BYTES
            )

    def _note_down(self, why: object) -> None:
        self._kv = None
        self._note_why(why)
        if self._down_since is None:
            self._down_since = self._clock()
            log.warning("site state %s: unreachable (%s)", self.url, self._why)

    def _note_why(self, why: object) -> None:
        """Keep the telling reason of an outage: a refused certificate or password shows up as a
        TLS alert or an authorization error, then again as the connection it closed, which says nothing."""
        bare = isinstance(why, BARE_FAILURES) or why == "disconnected"
        if not (bare and self._why_tells):
            self._why, self._why_tells = (str(why) or type(why).__name__), not bare

    async def _on_error(self, error: Exception) -> None:
        self._note_why(error)

    async def _on_disconnected(self) -> None:
        if not self._closed:
            self._note_down(self._client.last_error or "disconnected")

    async def _on_reconnected(self) -> None:
        self._reconnected.set()

    async def _call(self, what: str, call: Callable[[JetStreamContext, KeyValue], Awaitable[T]]) -> T:
        """``call`` on the bucket within the operation timeout; the store unreachable or slow
        becomes StoreUnavailable at once (nats-py would buffer while it reconnects)."""
        js, kv = self._js, self._kv
        if js is None or kv is None or not self._client.is_connected:
            raise unavailable(self.url, what, self._why)
        cancels = CancelWatch()  # outside the timeout: its own cancel, swallowed, is no caller's
        try:
            async with asyncio.timeout(self._op_timeout_s):
                done = await call(js, kv)
        except FAILURES as exc:
            cancels.check()
            raise unavailable(self.url, what, str(exc) or type(exc).__name__) from exc
        cancels.check()
        return done

    # -- the contract ----------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        check_key(key)
        return await self._call(f"the read of {key}", lambda js, _: self._ops.latest(js, key))

    async def put(self, key: str, value: bytes, *, expected: int | None = None) -> Entry:
        check_value(key, value)
        return await self._call(
            f"the put of {key}", lambda js, kv: self._ops.put(js, kv, key, value, expected)
        )

    async def delete(self, key: str, *, expected: int | None = None) -> None:
        """A key with no live revision stays as it is (no tombstone), as the file backend does."""
        check_key(key)
        await self._call(f"the delete of {key}", lambda js, kv: self._ops.delete(js, kv, key, expected))

    async def history(self, key: str) -> list[Entry]:
        check_key(key)
        return await self._call(f"the history of {key}", lambda js, _: self._ops.history(js, key))

    async def entries(self, prefix: str) -> list[Entry]:
        check_prefix(prefix)
        return await self._call(f"the listing of {prefix or 'every key'}", lambda *_: self._consumers.snapshot(prefix))

    async def watch(self, prefix: str) -> AsyncIterator[Entry]:
        """Waits while the store is unreachable (a router watches from its start, whatever the store)."""
        check_prefix(prefix)
        watch = Watch(prefix)
        if self._closed:
            return
        self._watches.add(watch)
        try:
            while (entry := await self._consumers.next(watch)) is not None:
                yield entry
        finally:
            self._watches.discard(watch)
            await self._consumers.unsubscribe(watch)
