"""The edge agent: loads its variants, dials out to the router and serves Work.

The agent owns one long-lived ``AgentLink.Connect`` stream. It says Hello only after its
models are loaded and warmed up (the first request never pays load cost), heartbeats
its load and what changed in its latency at the pace the router sets (Welcome, then
Pace as the fleet grows), and answers Work concurrently up to its capacity. When the router
goes away it reconnects with exponential backoff and jitter; on SIGTERM it tells the
router it is draining, finishes what it holds, and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc

from edge_agent.link import Link, describe, stay_linked
from edge_agent.settings import SERVE, AgentSettings
from stratus.convert.fleet import heartbeat_to_wire
from stratus.convert.hello import hello_to_wire
from stratus.errors import ConfigError, StratusError
from stratus.execution.dataplane import LocalDataPlane
from stratus.execution.describe import Introduction, heartbeat, hello
from stratus.execution.local_models import LocalModels
from stratus.execution.work import serve_work
from stratus.families.cpu import Hardware
from stratus.obs.endpoint import serve as serve_metrics
from stratus.obs.metrics import Metrics
from stratus.process import announce, process_uptime_s, start_collapsed
from stratus.serving.channels import bind, create_server
from stratus.serving.discovery import discover_all, dns_target, resolve_all
from stratus.serving.exposure import insecure_warning
from stratus.serving.health import Health
from stratus.serving.servicer import InferenceServicer, add_inference_service
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb

log = logging.getLogger("stratus.agent")

# With --router auto or dns:NAME:PORT, how often to look for routers that joined since.
REDISCOVER_S = 30.0
# A link to one of a router's workers gives up after this many failed attempts in a row; once
# every worker's has, the router's shared port is dialled again (router/workers.py).
WORKER_ATTEMPTS = 6


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        models: LocalModels,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.models = models
        self._rng = rng or random.Random()
        self._clock = clock
        # When this agent's process started, on ``clock``: its Hellos say how long it has run.
        self._started = clock() - (process_uptime_s() or 0.0)
        self.links: dict[str, Link] = {}  # by router address, while linked
        self._reload_lock = asyncio.Lock()
        self._reloads: set[asyncio.Task[None]] = set()
        # Links to the workers a router's shared port named (router/workers.py), by address.
        self._workers: dict[str, asyncio.Task[str | None]] = {}

    @property
    def in_flight(self) -> int:
        """Work running or waiting here, from every router."""
        return sum(len(link.work) for link in self.links.values())

    def hello(self) -> fpb.AgentMessage:
        who = Introduction(
            agent_id=self.settings.name,
            tier=self.settings.tier,
            capacity=self.settings.concurrency,
            queue_limit=self.settings.queue_limit,
            token=self.settings.token,
        )
        return fpb.AgentMessage(hello=hello_to_wire(hello(self.models, who, uptime_s=self._clock() - self._started)))

    def heartbeat(self, link: Link) -> fpb.AgentMessage:
        """Load (all routers' work), and latency only for the variants that ran since this
        link's previous heartbeat."""
        report = heartbeat(self.models, in_flight=self.in_flight, reported=link.reported, received=link.received)
        return fpb.AgentMessage(heartbeat=heartbeat_to_wire(report))

    async def run(self, stop: asyncio.Event) -> None:
        """Stay linked to every router until ``stop``; then drain and return.

        ``--router A,B`` holds a link to each; ``auto`` links to every router zeroconf
        finds, and ``dns:NAME:PORT`` to every address NAME resolves to (a Kubernetes headless
        Service: one per router pod); both look again now and then for routers that joined.
        A router of several workers is linked at each worker's own address (``link_workers``).
        """
        if self.settings.router == "auto":
            await self._link_found_routers(stop, lambda: discover_all(timeout_s=3.0))
        elif (target := dns_target(self.settings.router)) is not None:
            await self._link_found_routers(
                stop, lambda: resolve_all(target.name, target.port), server_name=target.name
            )
        else:
            addresses = [a.strip() for a in self.settings.router.split(",") if a.strip()]
            ends = await asyncio.gather(
                *(stay_linked(self, address, stop, self._rng) for address in addresses)
            )
            if not stop.is_set():  # every link gave up for good
                raise ConfigError(_no_router(ends))
        await self.finish_work()

    async def link_workers(self, addresses: Sequence[str], stop: asyncio.Event, server_name: str | None) -> None:
        """A router's workers share its port, so a link through the port reaches one of them:
        hold a link to each worker's own address instead, until ``stop`` or until every one has
        failed WORKER_ATTEMPTS times in a row (a worker restarting comes back at its address,
        which its parent holds; a router restarted has other workers, found through the port
        again). A worker already linked through another door is not linked twice."""
        mine = [a for a in addresses if a not in self._workers]
        for address in mine:
            self._workers[address] = asyncio.create_task(
                stay_linked(self, address, stop, self._rng, server_name, give_up_after=WORKER_ATTEMPTS),
                name=f"stratus-link-{address}",
            )
        try:
            ended = await asyncio.gather(*(self._workers[a] for a in mine), return_exceptions=True)
        finally:
            for address in mine:
                self._workers.pop(address, None)
        if not stop.is_set():
            log.warning("every worker of the router stopped answering (%s): dialling its port again",
                        "; ".join(str(e) for e in ended if e))  # fmt: skip

    async def _link_found_routers(
        self, stop: asyncio.Event, find: Callable[[], Awaitable[list[str]]], server_name: str | None = None
    ) -> None:
        """Link to every router ``find`` returns, and look again now and then: routers come
        and go (a Deployment scaled, a pod replaced); a link to one that went simply ends. A
        router that gave up on this agent for good is not dialled again; when every router
        found did, the agent stops (ConfigError): serving nothing while looking ready helps
        no one, and a supervisor shows the reason."""
        tasks: dict[str, asyncio.Task[str | None]] = {}
        given_up: dict[str, str] = {}
        stopping = asyncio.create_task(stop.wait(), name="stratus-agent-stop")
        try:
            while not stop.is_set():
                with contextlib.suppress(StratusError, OSError):
                    for address in await find():
                        if address not in given_up and (address not in tasks or tasks[address].done()):
                            tasks[address] = asyncio.create_task(
                                stay_linked(self, address, stop, self._rng, server_name),
                                name=f"stratus-link-{address}",
                            )
                live = [task for task in tasks.values() if not task.done()]
                await asyncio.wait(
                    [stopping, *live],
                    timeout=REDISCOVER_S if tasks else 1.0,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                given_up |= {address: why for address, task in tasks.items() if (why := _gave_up(task))}
                if tasks and set(tasks) <= set(given_up) and not stop.is_set():
                    raise ConfigError(_no_router(list(given_up.values())))
        finally:
            stopping.cancel()
            await asyncio.gather(stopping, *tasks.values(), return_exceptions=True)

    async def finish_work(self) -> None:
        running = [task for link in self.links.values() for task in link.work.values()]
        if running:
            await asyncio.wait(running, timeout=self.settings.drain_timeout_s)

    def start_reload(self) -> None:
        """A router's Reload, or SIGHUP: reload in the background; the link keeps serving.

        Reloads collapse: with one running and one waiting, another adds nothing (the waiting
        one reads the folder after the running one ends), so a burst of Reloads costs two."""
        if not start_collapsed(self._reloads, self.reload, name="stratus-agent-reload"):
            log.info("a reload is already waiting; this request joins it")

    async def reload(self) -> None:
        """Load and warm what changed in the models folder, then announce it to every router.

        One reload at a time; work keeps flowing meanwhile. A failure leaves the old
        variants serving and is reported to every router (and logged).
        """
        async with self._reload_lock:
            try:
                served = await self.models.reload()
            except Exception as exc:  # any failure to load must leave the agent serving
                log.error("reload failed; still serving %s: %s", sorted(self.models.served), exc)
                failed = fpb.AgentMessage(reload_failed=fpb.ReloadFailed(message=describe(exc)))
                for link in self.links.values():
                    link.outbox.put_nowait(failed)
                return
            log.info("reloaded; announcing %s", served)
            for link in self.links.values():
                link.outbox.put_nowait(self.hello())

    def accept(self, work: fpb.Work, link: Link) -> None:
        if work.request_id in link.work:
            log.warning("duplicate work id %s ignored", work.request_id)
            return
        task = asyncio.create_task(
            serve_work(self.models, self.settings.name, work, link.outbox),
            name=f"stratus-work-{work.request_id}",
        )
        link.work[work.request_id] = task
        task.add_done_callback(lambda _: link.work.pop(work.request_id, None))


def _gave_up(link: asyncio.Task[str | None]) -> str | None:
    """Why a link task ended for good, or None (running, stopped, or ended otherwise)."""
    if not link.done() or link.cancelled() or link.exception() is not None:
        return None
    return link.result()


def _no_router(why: Sequence[str | None]) -> str:
    """The one line an agent stops with when no router will link it, each router's reason."""
    return "no router links this agent: " + "; ".join(w for w in why if w)


async def serve_locally(models: LocalModels, settings: AgentSettings) -> tuple[grpc.aio.Server, str, Health]:
    """The agent's ``--serve`` endpoint: the inference service, straight to the local models."""
    assert settings.serve is not None
    server = create_server(client_token=settings.client_token)
    plane = LocalDataPlane(models, tier=settings.tier, name=settings.name)
    add_inference_service(InferenceServicer(plane), server)
    health = Health(server, plane.ready)
    port = bind(server, settings.serve, settings.tls)
    await server.start()
    await health.start()
    return server, f"{settings.serve.rsplit(':', 1)[0]}:{port}", health


async def run_agent(settings: AgentSettings, models: LocalModels, stop: asyncio.Event) -> None:
    local: grpc.aio.Server | None = None
    warning = None
    exporter = None
    if settings.metrics and models.metrics is not None:
        exporter = await serve_metrics(models.metrics, settings.metrics, token=settings.metrics_token)
    if settings.serve:
        local, address, health = await serve_locally(models, settings)
        announce("agent", address)
        warning = insecure_warning(
            SERVE,
            settings.serve,
            tls=settings.tls.cert is not None,
            callers_authenticated=settings.serve_authenticated,
        )
    else:
        announce("agent", settings.name)
    agent = Agent(settings, models)
    with contextlib.suppress(NotImplementedError, AttributeError):  # no SIGHUP off POSIX
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, agent.start_reload)
    try:
        await agent.run(stop)
        log.info("stopped")
    finally:
        if warning is not None:
            warning.cancel()
        if local is not None:
            await health.stop()
            await local.stop(grace=2.0)
        if exporter is not None:
            exporter.close()
        models.close()


def load_models(
    models_dir: Path,
    *,
    tier: Tier,
    variants: list[str] | None,
    concurrency: int,
    queue_limit: int,
    runtimes: list[str] | None,
    cache_dir: Path,
    max_batch: int = 32,
    precision: str | None = None,
    hardware: Hardware | None = None,
    emulated_extra_ms: float = 0.0,
    metrics: Metrics | None = None,
) -> LocalModels:
    from stratus.execution.loading import LocalSettings
    from stratus.families.repository import ModelRepository

    return LocalModels(
        ModelRepository.load(models_dir),
        LocalSettings(
            tier=None if variants else tier,
            variants=variants,
            cache_dir=cache_dir,
            concurrency=concurrency,
            queue_limit=queue_limit,
            runtimes=runtimes,
            executor_name="stratus-agent-infer",
            max_batch=max_batch,
            precision=precision,
            hardware=hardware,
            emulated_extra_ms=emulated_extra_ms,
        ),
        metrics=metrics,
    )
