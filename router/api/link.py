"""The AgentLink service: one bidirectional stream per agent.

The first message must be a Hello; the router answers Welcome, then writes the agent's
outbox (Work, Cancel, Drain) while a reader task takes Heartbeats, Results and Draining.
Whatever ends the stream (the agent closing it, a broken connection, a malformed
message), the agent is marked lost at once and its pending requests fail over.

Hellos pass an admission gate, a token bucket: when a router with a thousand agents
restarts they all come back within seconds, and registering them at a bounded rate keeps
the router answering inference while they arrive. Past ``max_waiting`` Hellos in line the
gate refuses with RESOURCE_EXHAUSTED, and the agent retries after its jittered backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from router.fleet.agent_handle import AgentHandle
from router.fleet.registry import FleetRegistry
from stratus import __version__
from stratus.convert.fleet import chunk_from_wire, heartbeat_from_wire
from stratus.convert.hello import check_hello_bounds, hello_from_wire
from stratus.convert.work import result_from_wire
from stratus.errors import ConfigError, DeadlineExceeded, InvalidInput, Overloaded, StratusError
from stratus.serving.auth import POOL_PREFIX, RouterCredentials
from stratus.serving.client_limits import client_of
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

log = logging.getLogger("stratus.link")

# How long a new AgentLink may stay silent before its Hello (an agent sends it at once).
HELLO_TIMEOUT_S = 10.0


class Refusals:
    """Refused Hellos per client address, over a window: each costs the router a credential
    check and, once, a WARNING line (security2 N11: 7,122 refused Hellos in 5 s took 84% of a
    core and 910 KiB of log). Past ``max_logged`` a window, refusals are counted and summed up
    in one line when the window turns; past ``max_refused`` from one address, its next Hellos
    are refused at once, before any credential is checked, until the window turns."""

    def __init__(
        self,
        *,
        window_s: float = 10.0,
        max_logged: int = 20,
        max_refused: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.max_logged = max_logged
        self.max_refused = max_refused
        self._clock = clock
        self._started = clock()
        self._logged = 0
        self._unlogged = 0
        self._by_address: dict[str, int] = {}

    def _turn(self) -> None:
        now = self._clock()
        if now - self._started < self.window_s:
            return
        if self._unlogged:
            log.warning("%d more agent Hellos refused in the last %.0f s (not logged one by one)",
                        self._unlogged, now - self._started)  # fmt: skip
        self._started, self._logged, self._unlogged = now, 0, 0
        self._by_address.clear()

    def check(self, peer: str) -> None:
        """Refuse at once an address that keeps failing (RESOURCE_EXHAUSTED, not logged each time)."""
        self._turn()
        address = client_of(peer)
        if self._by_address.get(address, 0) >= self.max_refused:
            self._unlogged += 1
            raise Overloaded(
                f"{self.max_refused} Hellos from this address were refused in the last {self.window_s:g} s; "
                "wait before trying again"
            )

    def refused(self, agent_id: str, peer: str, exc: Exception) -> None:
        self._turn()
        address = client_of(peer)
        self._by_address[address] = self._by_address.get(address, 0) + 1
        if len(self._by_address) > 4096:  # bounded, whatever the number of addresses
            self._by_address.pop(next(iter(self._by_address)))
        if self._logged < self.max_logged:
            self._logged += 1
            log.warning("refused agent %r from %s: %s", agent_id[:128], peer, exc)
        else:
            self._unlogged += 1


# Links one agent's identity may open in a window: an agent reconnects after a restart or a lost
# network, a few times a minute at worst; a stolen credential churning its link (each Hello a
# registration, a credential check and a Welcome) is refused past them.
HELLOS_PER_IDENTITY: Final = 6
HELLO_WINDOW_S: Final = 60.0


class HelloRate:
    """New links per agent identity over a window: ``HELLOS_PER_IDENTITY`` for one agent's own
    certificate or token, twice its size for a pool's certificate. A shared token or none binds no
    identity to an agent, so it has no rate of its own here (the admission gate still applies)."""

    def __init__(
        self,
        pools: Mapping[str, int] | None = None,
        *,
        per_identity: int = HELLOS_PER_IDENTITY,
        window_s: float = HELLO_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pools = dict(pools or {})
        self.per_identity = per_identity
        self.window_s = window_s
        self._clock = clock
        self._opened: dict[str, deque[float]] = {}

    def most(self, identity: str) -> int | None:
        """How many links ``identity`` may open a window (None: no rate of its own)."""
        if identity.startswith(POOL_PREFIX):
            return 2 * self._pools.get(identity.removeprefix(POOL_PREFIX), 1) + self.per_identity
        if identity.startswith(("cert:", "token:")):
            return self.per_identity
        return None

    def take(self, identity: str) -> None:
        """Count a new link of ``identity``, or refuse it (RESOURCE_EXHAUSTED) past its rate."""
        most = self.most(identity)
        if most is None:
            return
        now = self._clock()
        opened = self._opened.setdefault(identity, deque())
        while opened and now - opened[0] >= self.window_s:
            opened.popleft()
        if len(opened) >= most:
            raise Overloaded(
                f"{identity} opened {len(opened)} links in the last {self.window_s:g} s, the most one "
                "agent identity may; wait before reconnecting"
            )
        opened.append(now)
        if len(self._opened) > 65_536:  # bounded, whatever the number of identities
            self._opened.pop(next(iter(self._opened)))


class AdmissionGate:
    """Admit at most ``rate_per_s`` (bursts of ``burst``), in arrival order."""

    def __init__(
        self,
        *,
        rate_per_s: float = 500.0,
        burst: int = 50,
        max_waiting: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_per_s <= 0 or burst < 1 or max_waiting < 0:
            raise ConfigError("rate_per_s and burst must be positive, max_waiting >= 0")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_waiting = max_waiting
        self._clock = clock
        self._tokens = float(burst)
        self._refilled = clock()
        self._lock = asyncio.Lock()
        self.waiting = 0

    def take(self) -> float:
        """Take a token (going into debt if there is none): seconds to wait before entering."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._refilled) * self.rate_per_s)
        self._refilled = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate_per_s

    async def admit(self, who: str) -> None:
        if self.waiting >= self.max_waiting:
            raise Overloaded(f"the router is admitting {self.waiting} other agents; {who} should retry later")
        self.waiting += 1
        try:
            async with self._lock:  # first come, first admitted
                delay = self.take()
                if delay > 0:
                    await asyncio.sleep(delay)
        finally:
            self.waiting -= 1


class AgentLinkServicer(fpb_grpc.AgentLinkServicer):
    def __init__(
        self,
        registry: FleetRegistry,
        *,
        credentials: RouterCredentials | None = None,
        gate: AdmissionGate | None = None,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        workers: Sequence[str] = (),
    ) -> None:
        """``workers``: every worker's own address, where this router is one of several
        (router/workers.py), named in each Welcome so that an agent links to every one."""
        self._registry = registry
        self._workers = list(workers)
        self._credentials = credentials or RouterCredentials()
        self._gate = gate or AdmissionGate()
        self._hello_timeout_s = hello_timeout_s
        self._refusals = Refusals()
        self._hello_rate = HelloRate(self._credentials.agent_pools)

    async def Connect(
        self, request_iterator: AsyncIterator[fpb.AgentMessage], context: Any
    ) -> AsyncIterator[fpb.RouterMessage]:
        try:  # a stream that says nothing is not held: the Hello comes first, and soon
            async with asyncio.timeout(self._hello_timeout_s):
                first = await anext(aiter(request_iterator), None)
        except TimeoutError:
            raise DeadlineExceeded(
                f"no Hello within {self._hello_timeout_s:g} s of opening an AgentLink"
            ) from None
        if first is None or first.WhichOneof("kind") != "hello":
            raise InvalidInput("the first message on an AgentLink must be a Hello")
        self._refusals.check(context.peer())
        _check_hello(first.hello)
        try:
            identity = self._credentials.agent_identity(first.hello.agent_id, first.hello.token, context)
        except StratusError as exc:
            self._refusals.refused(first.hello.agent_id, context.peer(), exc)
            raise
        try:
            self._hello_rate.take(identity)
        except StratusError as exc:
            self._refusals.refused(first.hello.agent_id, context.peer(), exc)
            raise
        await self._gate.admit(first.hello.agent_id)
        try:
            hello = hello_from_wire(first.hello)  # bounded above, before anything was logged
            handle = self._registry.register(hello, peer=context.peer(), identity=identity)
        except StratusError as exc:
            self._refusals.refused(first.hello.agent_id, context.peer(), exc)
            raise
        held = _Held(token=first.hello.token)
        reader = asyncio.create_task(
            self._read(handle, request_iterator, context, held), name=f"stratus-link-{handle.id}"
        )
        try:
            yield fpb.RouterMessage(
                welcome=fpb.Welcome(
                    agent_id=handle.id,
                    heartbeat_interval_s=handle.heartbeat_s,
                    router_version=__version__,
                    router_workers=self._workers,
                )
            )
            handle.sent = 1
            if self._registry.site_mark(handle.id) == "drained":  # drained site-wide, before it linked here
                self._registry.drain(handle.id)
            while (message := await handle.work.outbox.get()) is not None:
                yield message
                handle.sent += 1
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            self._registry.lose(handle, "link closed")

    async def _read(
        self, handle: AgentHandle, messages: AsyncIterator[fpb.AgentMessage], context: Any, held: _Held
    ) -> None:
        reason = "link ended (closed by the agent, or its connection stopped answering pings)"
        try:
            async for message in messages:
                kind = message.WhichOneof("kind")
                if kind == "heartbeat":
                    revoked = self._revoked(handle, context, held)
                    if revoked is not None:
                        reason = revoked
                        break
                    self._registry.heartbeat(handle, heartbeat_from_wire(message.heartbeat))
                elif kind == "result":
                    self._registry.result(handle, result_from_wire(message.result, f"agent {handle.id}"))
                elif kind == "chunk":
                    self._registry.chunk(handle, message.chunk.request_id, chunk_from_wire(message.chunk))
                elif kind == "draining":
                    self._registry.draining(handle)
                elif kind == "hello":
                    self._reannounce(handle, message.hello, context, held)
                elif kind == "reload_failed":
                    self._registry.reload_failed(handle, message.reload_failed.message)
                else:
                    reason = f"unexpected {kind or 'empty'} message after Hello"
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"link broke: {type(exc).__name__}: {exc}"
        log.info("agent %s: %s", handle.id, reason)
        self._registry.lose(handle, reason)

    def _revoked(self, handle: AgentHandle, context: Any, held: _Held) -> str | None:
        """Why the agent's credential no longer admits it (its line deleted from the agent
        tokens file, the file broken), or None: checked at every heartbeat, so a revoked
        agent is cut off within one (security2 N4)."""
        try:
            identity = self._credentials.agent_identity(handle.id, held.token, context)
        except StratusError as exc:
            log.warning("agent %s: its credential no longer admits it (%s): link ended", handle.id, exc)
            return f"credential revoked: {exc}"
        return None if identity == handle.identity else "credential revoked: it names another identity now"

    def _reannounce(self, handle: AgentHandle, hello: fpb.Hello, context: Any, held: _Held) -> None:
        """A later Hello: the agent reloaded. Same credential rule as the first, and the same
        identity; a refused one leaves the agent serving what it served before."""
        try:
            identity = self._credentials.agent_identity(hello.agent_id, hello.token, context)
        except StratusError as exc:
            self._registry.reload_failed(handle, f"its new Hello was refused: {exc}")
            return
        if identity != handle.identity:
            self._registry.reload_failed(handle, "its new Hello comes with another identity")
            return
        held.token = hello.token
        try:
            announced = hello_from_wire(hello)
        except InvalidInput as exc:  # the operator who asked for the reload is told why
            self._registry.reload_failed(handle, f"its new Hello was refused: {exc}")
            return
        try:
            self._registry.reannounce(handle, announced)
        except InvalidInput as exc:
            log.warning("agent %s: reload refused: %s", handle.id, exc)


@dataclass
class _Held:
    """What one link's agent proved itself with: the token of its last accepted Hello, which
    every heartbeat checks again against the router's credentials."""

    token: str


def _check_hello(hello: fpb.Hello) -> None:
    if not hello.agent_id:
        raise InvalidInput("Hello.agent_id is empty")
    check_hello_bounds(hello)  # before anything logs the id
