"""One router link, as an agent holds it: the ``AgentLink.Connect`` session (Hello, then
Welcome), the heartbeats at the router's pace, the loop that reads what the router sends,
and reconnecting with ``Backoff`` when the link breaks. What the agent does with Work,
Reload and its Hello stays in ``edge_agent.agent``; this module only carries them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from stratus.errors import StratusError
from stratus.sched.streams import until_none
from stratus.serving.channels import TlsSettings, open_channel, server_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

log = logging.getLogger("stratus.agent")


class Backoff:
    """Exponential backoff with full jitter; ``reset`` after a healthy session."""

    def __init__(self, *, initial_s: float, max_s: float, rng: random.Random) -> None:
        self._initial, self._max, self._rng = initial_s, max_s, rng
        self._attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self._max, self._initial * (2**self._attempt))
        self._attempt += 1
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self._attempt = 0

    @property
    def failures(self) -> int:
        """Attempts since the last healthy session."""
        return self._attempt


@dataclass(eq=False)
class Link:
    """One router link's own state: an agent holds one per router and serves them all."""

    address: str
    outbox: asyncio.Queue[fpb.AgentMessage | None] = field(default_factory=asyncio.Queue)
    work: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # by the router's request id
    received: int = 0  # RouterMessages read on this link, the Welcome included
    interval: float = 1.0  # the heartbeat pace this router asks for
    beat_now: asyncio.Event = field(default_factory=asyncio.Event)
    reported: dict[str, int] = field(default_factory=dict)  # samples per variant at the last heartbeat


class LinkSettings(Protocol):
    """The agent's settings a link reads (``AgentSettings`` has them)."""

    @property
    def tls(self) -> TlsSettings: ...

    @property
    def heartbeat_s(self) -> float: ...

    @property
    def backoff_initial_s(self) -> float: ...

    @property
    def backoff_max_s(self) -> float: ...

    def may_dial(self, address: str) -> bool: ...


class LinkOwner(Protocol):
    """What a link needs from its agent: the messages to send, and where Work and Reloads go."""

    @property
    def settings(self) -> LinkSettings: ...

    @property
    def links(self) -> dict[str, Link]: ...

    def hello(self) -> fpb.AgentMessage: ...

    def heartbeat(self, link: Link) -> fpb.AgentMessage: ...

    def accept(self, work: fpb.Work, link: Link) -> None: ...

    def start_reload(self) -> None: ...

    async def finish_work(self) -> None: ...

    async def link_workers(self, addresses: Sequence[str], stop: asyncio.Event, server_name: str | None) -> None: ...


# What a router answers when it will not take this agent's credential: retrying the same
# credential cannot change that; the operator must (a token, a certificate, a revocation).
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


async def stay_linked(
    owner: LinkOwner,
    address: str,
    stop: asyncio.Event,
    rng: random.Random,
    server_name: str | None = None,
    *,
    give_up_after: int | None = None,
) -> str | None:
    """One router: link, serve, and re-link with backoff whenever the link breaks.
    ``server_name``: what the router's certificate names, where ``address`` is an IP found
    for it (dns:NAME). Returns None once stopped, or why it gave up on this router for good
    (not one, it refused this agent, or ``give_up_after`` attempts in a row failed), in one line.

    A router of several workers (``--workers``) answers through its shared port with every
    worker's own address: the agent links to each of those instead, and dials ``address``
    again only once every one of those links has given up (the router restarted with other
    workers)."""
    settings = owner.settings
    backoff = Backoff(initial_s=settings.backoff_initial_s, max_s=settings.backoff_max_s, rng=rng)
    if not settings.may_dial(address):
        refused = (
            f"router {address} is not on this machine and the link has no TLS (give --tls-ca, or --insecure)"
        )
        log.error("not linking: %s", refused)
        return refused
    while not stop.is_set():
        if give_up_after is not None and backoff.failures >= give_up_after:
            return f"router worker {address} did not answer {backoff.failures} times in a row"
        try:
            workers = await _session(owner, address, stop, backoff, server_name)
            if workers:
                await owner.link_workers(workers, stop, server_name)
                continue
        except grpc.aio.AioRpcError as exc:
            if (ended := _for_good(address, exc)) is not None:
                log.error("%s; not linking to it", ended)
                return ended
            log.warning("link to router %s lost: %s", address, describe(exc))
        except (StratusError, ConnectionError) as exc:
            log.warning("link to router %s lost: %s", address, describe(exc))
        except Exception:  # an agent must outlive any one link, whatever broke it
            log.exception("link to router %s failed unexpectedly", address)
        if stop.is_set():
            break
        delay = backoff.next_delay()
        log.info("reconnecting to %s in %.2f s", address, delay)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await stop.wait()
    return None


def worker_addresses(dialled: str, named: Sequence[str]) -> list[str]:
    """A router's workers as its Welcome names them, each ``HOST:PORT``, or ``:PORT`` on the
    host this agent dialled (a router listening on every interface cannot know which of its
    addresses an agent reaches it at)."""
    host = dialled.rpartition(":")[0]
    return [f"{host}{entry}" if entry.startswith(":") else entry for entry in named]


def _for_good(address: str, exc: grpc.aio.AioRpcError) -> str | None:
    """Why a link's failure cannot change by retrying it, or None when it may."""
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"{address} is not a Stratus router (it has no AgentLink service: a cloud gateway, or "
            "an agent's --serve port?)"
        )
    if exc.code() in REFUSALS:
        return f"router {address} refused this agent: {describe(exc)}"
    return None


async def _session(
    owner: LinkOwner, address: str, stop: asyncio.Event, backoff: Backoff, server_name: str | None = None
) -> list[str]:
    """One link, until it ends: nothing, or, where ``address`` was the shared port of a router's
    workers, their own addresses (the link ends at once: each worker is linked at its own)."""
    link = Link(address=address)
    link.outbox.put_nowait(owner.hello())
    tls = owner.settings.tls
    async with open_channel(
        address, tls, extra_options=server_options("router", tls, server_name)
    ) as channel:
        call = fpb_grpc.AgentLinkStub(channel).Connect(until_none(link.outbox))
        try:
            welcome = await call.read()
            if not isinstance(welcome, fpb.RouterMessage) or not welcome.HasField("welcome"):
                raise ConnectionError("router closed the link without a Welcome")
        except BaseException:  # refused: end what gRPC reads the link from, or its task
            link.outbox.put_nowait(None)  # outlives the loop ("Task was destroyed ...")
            await _ended(call)
            raise
        workers = worker_addresses(address, welcome.welcome.router_workers)
        if workers and address not in workers:
            log.info("router %s has %d workers: linking to each (%s)", address, len(workers), ", ".join(workers))
            backoff.reset()
            link.outbox.put_nowait(None)
            call.cancel()
            await _ended(call)
            return workers
        log.info("linked to router %s as %s", address, welcome.welcome.agent_id)
        link.received = 1  # the Welcome; counts restart with every link
        backoff.reset()
        link.interval = welcome.welcome.heartbeat_interval_s or owner.settings.heartbeat_s
        owner.links[address] = link
        tasks = [
            asyncio.create_task(_heartbeats(owner, link), name="stratus-agent-heartbeat"),
            asyncio.create_task(receive(owner, call, link), name="stratus-agent-receive"),
            asyncio.create_task(stop.wait(), name="stratus-agent-stop"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                await _say_goodbye(owner, link)
                call.cancel()
            else:
                for task in done:
                    task.result()  # re-raise why the link ended
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            link.outbox.put_nowait(None)
            if owner.links.get(address) is link:
                del owner.links[address]
            await _ended(call)
        return []


async def _say_goodbye(owner: LinkOwner, link: Link) -> None:
    """Draining: tell the router, then let in-flight work finish and report."""
    log.info("stopping: draining the link to %s, finishing %d work item(s)", link.address, len(link.work))
    link.outbox.put_nowait(fpb.AgentMessage(draining=fpb.Draining(reason="agent stopping")))
    await owner.finish_work()
    await asyncio.sleep(0.05)  # let the last Results leave before the stream closes


async def _heartbeats(owner: LinkOwner, link: Link) -> None:
    """Every interval, and at once when the router sets a new pace."""
    while True:
        link.beat_now.clear()
        link.outbox.put_nowait(owner.heartbeat(link))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(link.interval):  # not wait_for: see stratus/cancellation.py
                await link.beat_now.wait()


async def receive(
    owner: LinkOwner, call: grpc.aio.StreamStreamCall[fpb.AgentMessage, fpb.RouterMessage], link: Link
) -> None:
    while (message := await call.read()) is not grpc.aio.EOF:
        assert isinstance(message, fpb.RouterMessage)
        link.received += 1
        kind = message.WhichOneof("kind")
        if kind == "work":
            owner.accept(message.work, link)
        elif kind == "cancel":
            task = link.work.get(message.cancel.request_id)
            if task is not None:
                task.cancel()
        elif kind == "pace":
            link.interval = message.pace.heartbeat_interval_s or owner.settings.heartbeat_s
            link.beat_now.set()
        elif kind == "drain":
            link.outbox.put_nowait(
                fpb.AgentMessage(draining=fpb.Draining(reason=message.drain.reason or "drained"))
            )
        elif kind == "reload":
            owner.start_reload()
    raise ConnectionError("router ended the link")


async def _ended(call: grpc.aio.StreamStreamCall[fpb.AgentMessage, fpb.RouterMessage]) -> None:
    """Wait for the call to be over (cancelled, or ended by either side), so that none of
    gRPC's tasks for it is still pending when the channel closes and the loop moves on."""
    call.cancel()
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        await call.code()


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
