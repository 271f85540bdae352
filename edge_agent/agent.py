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
import platform
import random
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from stratus import __version__
from stratus.auth import check_endpoint, clients_authenticated, insecure_warning
from stratus.convert.errors import error_to_wire, wire_error, wire_error_label
from stratus.convert.fleet import chunk_to_wire, wire_tier
from stratus.discovery import DNS_PREFIX, discover_all, resolve_all
from stratus.errors import ConfigError, DeadlineExceeded, StratusError
from stratus.generation import Chunk
from stratus.hardware import to_wire as hardware_to_wire
from stratus.local import LocalDataPlane, LocalModels
from stratus.metrics import Metrics
from stratus.metrics import serve as serve_metrics
from stratus.precision import Hardware
from stratus.process import announce, process_uptime_s, start_collapsed
from stratus.repository import VariantSpec
from stratus.serving import (
    NO_TLS,
    Health,
    InferenceServicer,
    TlsSettings,
    bind,
    create_server,
    is_loopback,
    open_channel,
    server_name_options,
)
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.agent")

SERVE = "the agent's --serve endpoint"
# With --router auto or dns:NAME:PORT, how often to look for routers that joined since.
REDISCOVER_S = 30.0


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    tier: Tier
    router: str  # host:port[,host:port...]; "auto" (zeroconf); or dns:NAME:PORT (every address)
    name: str
    capacity: int = 4
    queue_limit: int = 64
    heartbeat_s: float = 1.0
    serve: str | None = None
    token: str = ""
    backoff_initial_s: float = 0.2
    # Capped so that a returning router has its whole fleet back within a few seconds.
    backoff_max_s: float = 2.0
    drain_timeout_s: float = 30.0
    tls: TlsSettings = NO_TLS
    metrics: str | None = None  # HOST:PORT for Prometheus's /metrics; None: not served
    # --serve's callers must send "authorization: Bearer CLIENT_TOKEN"; empty: not asked.
    client_token: str = ""
    # Plaintext links to routers off this machine, zeroconf without a CA, and --serve off
    # loopback without TLS and client authentication.
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.heartbeat_s <= 0 or self.backoff_initial_s <= 0:
            raise ConfigError("capacity, heartbeat_s and backoff_initial_s must be positive")
        self.check_links()  # before any model loads: a refused setting costs nothing
        if self.serve:
            check_endpoint(
                SERVE, self.serve, self.tls, client_token=self.client_token, insecure=self.insecure
            )

    @property
    def serve_authenticated(self) -> bool:
        return clients_authenticated(self.tls, self.client_token)

    def check_links(self) -> None:
        """Refuse links that would hand the token, and every input, to whoever answers: zeroconf
        without a CA to verify the router's certificate, or plaintext to another machine."""
        if self.insecure:
            return
        if self.router == "auto" and self.tls.ca is None:
            raise ConfigError(
                "--router auto dials whatever advertises _stratus._tcp: give --tls-ca, so the agent "
                "verifies the router's certificate before it sends anything, or --insecure"
            )
        if self.router == "auto" or self.router.startswith(DNS_PREFIX):
            return  # each address found is checked as it is dialled (may_dial)
        for address in self.router.split(","):
            if address.strip() and not self.may_dial(address.strip()):
                raise ConfigError(
                    f"router {address.strip()} is not on this machine: the link, and the agent's "
                    "token, would cross the network in plaintext; give --tls-ca (and --tls-cert, "
                    "--tls-key for mutual TLS), or --insecure"
                )

    def may_dial(self, address: str) -> bool:
        return self.insecure or self.tls.enabled or is_loopback(address.rsplit(":", 1)[0])


def default_name(tier: Tier) -> str:
    """The host name and the tier (``pi-7-device``): stable across restarts, so a restarted
    agent is the same agent to the router, its metrics and its alerts; two agents of one tier
    on one host need ``--name``."""
    return f"{socket.gethostname().split('.')[0]}-{tier.label}"


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

    @property
    def in_flight(self) -> int:
        """Work running or waiting here, from every router."""
        return sum(len(link.work) for link in self.links.values())

    def hello(self) -> fpb.AgentMessage:
        return fpb.AgentMessage(
            hello=fpb.Hello(
                agent_id=self.settings.name,
                tier=wire_tier(self.settings.tier),
                host=socket.gethostname(),
                hardware=f"{platform.machine()} {self.models.hardware.model}".strip(),
                hardware_info=hardware_to_wire(self.models.hardware),
                runtimes=sorted({info.runtime for info in self.models.variants_info()}),
                variants=self.models.variants_info(),
                capacity=self.settings.capacity,
                token=self.settings.token,
                version=__version__,
                families=self.models.families_info(),
                queue_limit=self.settings.queue_limit,
                unavailable=self.models.unavailable_info(),
                uptime_s=self._clock() - self._started,
            )
        )

    def heartbeat(self, link: Link) -> fpb.AgentMessage:
        """Load (all routers' work), and latency only for the variants that ran since this
        link's previous heartbeat."""
        latency = []
        for name, window in self.models.latency.items():
            if link.reported.get(name) == window.count:
                continue
            link.reported[name] = window.count
            s = window.summary()
            latency.append(
                fpb.LatencyEstimate(
                    variant=name, mean_ms=s.mean_ms, p50_ms=s.p50_ms, p99_ms=s.p99_ms, count=s.count
                )
            )
        return fpb.AgentMessage(
            heartbeat=fpb.Heartbeat(
                in_flight=self.in_flight,
                queue_length=self.models.batcher.waiting_items,
                latency=latency,
                received=link.received,
            )
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Stay linked to every router until ``stop``; then drain and return.

        ``--router A,B`` holds a link to each; ``auto`` links to every router zeroconf
        finds, and ``dns:NAME:PORT`` to every address NAME resolves to (a Kubernetes headless
        Service: one per router pod); both look again now and then for routers that joined.
        """
        if self.settings.router == "auto":
            await self._link_found_routers(stop, lambda: discover_all(timeout_s=3.0))
        elif self.settings.router.startswith(DNS_PREFIX):
            name, _, port = self.settings.router.removeprefix(DNS_PREFIX).rpartition(":")
            await self._link_found_routers(stop, lambda: resolve_all(name, int(port)), server_name=name)
        else:
            addresses = [a.strip() for a in self.settings.router.split(",") if a.strip()]
            await asyncio.gather(*(self._stay_linked(address, stop) for address in addresses))
            if not stop.is_set():  # every link gave up: nothing here is a router
                raise ConfigError(f"none of {', '.join(addresses)} is a Stratus router (see the log)")
        await self._finish_work()

    async def _link_found_routers(
        self, stop: asyncio.Event, find: Callable[[], Awaitable[list[str]]], server_name: str | None = None
    ) -> None:
        """Link to every router ``find`` returns, and look again now and then: routers come
        and go (a Deployment scaled, a pod replaced); a link to one that went simply ends."""
        tasks: dict[str, asyncio.Task[None]] = {}
        while not stop.is_set():
            with contextlib.suppress(StratusError, OSError):
                for address in await find():
                    if address not in tasks or tasks[address].done():
                        tasks[address] = asyncio.create_task(
                            self._stay_linked(address, stop, server_name), name=f"stratus-link-{address}"
                        )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=REDISCOVER_S if tasks else 1.0)
        await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _stay_linked(self, address: str, stop: asyncio.Event, server_name: str | None = None) -> None:
        """One router: link, serve, and re-link with backoff whenever the link breaks.
        ``server_name``: what the router's certificate names, where ``address`` is an IP found
        for it (dns:NAME)."""
        backoff = Backoff(
            initial_s=self.settings.backoff_initial_s, max_s=self.settings.backoff_max_s, rng=self._rng
        )
        if not self.settings.may_dial(address):
            log.error(
                "not linking to router %s: it is not on this machine and the link has no TLS "
                "(give --tls-ca, or --insecure)",
                address,
            )
            return
        while not stop.is_set():
            try:
                await self._session(address, stop, backoff, server_name)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # retrying would never change that
                    log.error(
                        "%s is not a Stratus router (it has no AgentLink service: a cloud gateway, or "
                        "an agent's --serve port?); not linking to it",
                        address,
                    )
                    return
                log.warning("link to router %s lost: %s", address, _describe(exc))
            except (StratusError, ConnectionError) as exc:
                log.warning("link to router %s lost: %s", address, _describe(exc))
            except Exception:  # an agent must outlive any one link, whatever broke it
                log.exception("link to router %s failed unexpectedly", address)
            if stop.is_set():
                break
            delay = backoff.next_delay()
            log.info("reconnecting to %s in %.2f s", address, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)

    async def _session(
        self, address: str, stop: asyncio.Event, backoff: Backoff, server_name: str | None = None
    ) -> None:
        link = Link(address=address)
        link.outbox.put_nowait(self.hello())
        tls = self.settings.tls
        async with open_channel(address, tls, extra_options=server_name_options(server_name, tls)) as channel:
            call = fpb_grpc.AgentLinkStub(channel).Connect(_drain_queue(link.outbox))
            try:
                welcome = await call.read()
                if not isinstance(welcome, fpb.RouterMessage) or not welcome.HasField("welcome"):
                    raise ConnectionError("router closed the link without a Welcome")
            except BaseException:  # refused: end what gRPC reads the link from, or its task
                link.outbox.put_nowait(None)  # outlives the loop ("Task was destroyed ...")
                await _ended(call)
                raise
            log.info("linked to router %s as %s", address, welcome.welcome.agent_id)
            link.received = 1  # the Welcome; counts restart with every link
            backoff.reset()
            link.interval = welcome.welcome.heartbeat_interval_s or self.settings.heartbeat_s
            self.links[address] = link
            tasks = [
                asyncio.create_task(self._heartbeats(link), name="stratus-agent-heartbeat"),
                asyncio.create_task(self._receive(call, link), name="stratus-agent-receive"),
                asyncio.create_task(stop.wait(), name="stratus-agent-stop"),
            ]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if stop.is_set():
                    await self._say_goodbye(link)
                    call.cancel()
                else:
                    for task in done:
                        task.result()  # re-raise why the link ended
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                link.outbox.put_nowait(None)
                if self.links.get(address) is link:
                    del self.links[address]
                await _ended(call)

    async def _say_goodbye(self, link: Link) -> None:
        """Draining: tell the router, then let in-flight work finish and report."""
        log.info("stopping: draining the link to %s, finishing %d work item(s)", link.address, len(link.work))
        link.outbox.put_nowait(fpb.AgentMessage(draining=fpb.Draining(reason="agent stopping")))
        await self._finish_work()
        await asyncio.sleep(0.05)  # let the last Results leave before the stream closes

    async def _finish_work(self) -> None:
        running = [task for link in self.links.values() for task in link.work.values()]
        if running:
            await asyncio.wait(running, timeout=self.settings.drain_timeout_s)

    async def _heartbeats(self, link: Link) -> None:
        """Every interval, and at once when the router sets a new pace."""
        while True:
            link.beat_now.clear()
            link.outbox.put_nowait(self.heartbeat(link))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(link.beat_now.wait(), timeout=link.interval)

    async def _receive(
        self, call: grpc.aio.StreamStreamCall[fpb.AgentMessage, fpb.RouterMessage], link: Link
    ) -> None:
        while (message := await call.read()) is not grpc.aio.EOF:
            assert isinstance(message, fpb.RouterMessage)
            link.received += 1
            kind = message.WhichOneof("kind")
            if kind == "work":
                self._accept(message.work, link)
            elif kind == "cancel":
                task = link.work.get(message.cancel.request_id)
                if task is not None:
                    task.cancel()
            elif kind == "pace":
                link.interval = message.pace.heartbeat_interval_s or self.settings.heartbeat_s
                link.beat_now.set()
            elif kind == "drain":
                link.outbox.put_nowait(
                    fpb.AgentMessage(draining=fpb.Draining(reason=message.drain.reason or "drained"))
                )
            elif kind == "reload":
                self.start_reload()
        raise ConnectionError("router ended the link")

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
                failed = fpb.AgentMessage(reload_failed=fpb.ReloadFailed(message=_describe(exc)))
                for link in self.links.values():
                    link.outbox.put_nowait(failed)
                return
            log.info("reloaded; announcing %s", served)
            for link in self.links.values():
                link.outbox.put_nowait(self.hello())

    def _accept(self, work: fpb.Work, link: Link) -> None:
        if work.request_id in link.work:
            log.warning("duplicate work id %s ignored", work.request_id)
            return
        task = asyncio.create_task(self._serve(work, link.outbox), name=f"stratus-work-{work.request_id}")
        link.work[work.request_id] = task
        task.add_done_callback(lambda _: link.work.pop(work.request_id, None))

    async def _serve(self, work: fpb.Work, outbox: asyncio.Queue[fpb.AgentMessage | None]) -> None:
        result = fpb.Result(request_id=work.request_id)
        ran: VariantSpec | None = None
        try:
            ran = await self._run(work, result, outbox)
        except asyncio.CancelledError:
            result.error.CopyFrom(wire_error(grpc.StatusCode.CANCELLED, "cancelled by the router"))
        except StratusError as exc:
            result.error.CopyFrom(error_to_wire(exc))
        except Exception as exc:
            log.exception("work %s failed", work.request_id)
            result.error.CopyFrom(error_to_wire(exc))
        self.models.count(_outcome(result), work.request.model_name, ran)
        outbox.put_nowait(fpb.AgentMessage(result=result))

    async def _run(
        self, work: fpb.Work, result: fpb.Result, outbox: asyncio.Queue[fpb.AgentMessage | None]
    ) -> VariantSpec:
        """Run the Work's items (maybe in one batch with other Work) within its budget; a
        generative Work sends its tokens as Chunks while it runs, then the Result. Returns
        the variant that ran."""
        budget_s = work.budget_ms / 1000.0 if work.budget_ms > 0 else None

        async def send(chunk: Chunk) -> None:
            outbox.put_nowait(fpb.AgentMessage(chunk=chunk_to_wire(work.request_id, chunk)))

        try:
            async with asyncio.timeout(budget_s):
                if self.models.generates(work.request.model_name):
                    answer = await self.models.generate(work.request, send)
                else:
                    answer = await self.models.answer(work.request)
        except TimeoutError:
            raise DeadlineExceeded(
                f"agent {self.settings.name}: budget of {work.budget_ms:.1f} ms ran out"
            ) from None
        result.variant = answer.variant.name
        result.response.CopyFrom(answer.response)
        result.confidence = answer.confidence
        result.confidences.extend(answer.confidences)
        result.service_ms = answer.service_ms
        result.queue_ms = answer.queue_ms
        result.batch_size = answer.batch_size
        return answer.variant


def _outcome(result: fpb.Result) -> str:
    if result.WhichOneof("outcome") != "error":
        return "ok"
    return wire_error_label(result.error)


async def _ended(call: grpc.aio.StreamStreamCall[fpb.AgentMessage, fpb.RouterMessage]) -> None:
    """Wait for the call to be over (cancelled, or ended by either side), so that none of
    gRPC's tasks for it is still pending when the channel closes and the loop moves on."""
    call.cancel()
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        await call.code()


async def _drain_queue(outbox: asyncio.Queue[fpb.AgentMessage | None]) -> AsyncIterator[fpb.AgentMessage]:
    while (message := await outbox.get()) is not None:
        yield message


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


async def serve_locally(models: LocalModels, settings: AgentSettings) -> tuple[grpc.aio.Server, str, Health]:
    """The agent's ``--serve`` endpoint: the inference service, straight to the local models."""
    assert settings.serve is not None
    server = create_server(client_token=settings.client_token)
    plane = LocalDataPlane(models, tier=settings.tier, name=settings.name)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(plane), server)
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
        exporter = await serve_metrics(models.metrics, settings.metrics)
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
    from stratus.local import LocalSettings
    from stratus.repository import ModelRepository

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
