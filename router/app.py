"""The router process: one port serves the inference API, AgentLink and Fleet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import Awaitable, Callable

import grpc

from router import parts
from router.api.fleet_service import FleetServicer
from router.api.fleet_status import fleet_levels
from router.api.link import AdmissionGate, AgentLinkServicer
from router.api.openai.api import OpenAiApi
from router.api.openai.door import server_tls
from router.audit.metrics import audit_levels
from router.cloud.pool import CloudPool
from router.dataplane import RouterDataPlane
from router.fleet.registry import FleetRegistry
from router.offline import Offline
from router.rollout.plans import Rollouts
from router.settings import OnCloudFailure, RouterSettings
from router.site.mirror import SiteMirror
from router.thresholds.pushes import ThresholdPushes, threshold_levels
from stratus.families.repository import ModelRepository
from stratus.obs.endpoint import serve as serve_metrics
from stratus.obs.metrics import Metrics, RouterMetrics
from stratus.process import announce, raise_open_files_limit, stop_on_signals
from stratus.serving.auth import RouterCredentials
from stratus.serving.channels import bind, create_server
from stratus.serving.client_limits import ClientLimits
from stratus.serving.discovery import Advertisement
from stratus.serving.exposure import insecure_warning
from stratus.serving.health import Health
from stratus.serving.rest import RestApi, server_context
from stratus.serving.servicer import InferenceServicer, add_inference_service
from stratus.wire import fleet_pb2_grpc as fpb_grpc

log = logging.getLogger("stratus.router")

# On SIGTERM, how long the router keeps serving after turning not-ready, at least, so that
# clients and load balancers that watch its health stop sending before it refuses new calls;
# then until no call has come for QUIET_S (plain clients moved on at their connection's age).
NOTICE_S = 1.0
QUIET_S = 0.5


async def _watch_heartbeats(registry: FleetRegistry) -> None:
    while True:
        await asyncio.sleep(registry.heartbeat_s / 2)  # the base interval: silence is timed per agent
        registry.check_heartbeats()


async def serve(settings: RouterSettings, stop: asyncio.Event | None = None) -> None:
    credentials = parts.credentials(settings)
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    raise_open_files_limit()  # one descriptor per linked agent
    metrics = Metrics()
    recorder = RouterMetrics(metrics)
    rollouts = parts.rollouts(settings, metrics, recorder)
    registry = FleetRegistry(
        heartbeat_s=settings.heartbeat_s,
        max_heartbeats_per_s=settings.max_heartbeats_per_s,
        max_batch_delay_s=settings.max_batch_delay_s,
        metrics=recorder,
        pool_sizes=dict(settings.agent_pools),
        own_families=parts.own_families(settings.models) if settings.models is not None else None,
    )
    pushes = parts.threshold_pushes(settings, registry)
    metrics.collect_with(lambda: threshold_levels(pushes, registry))
    cloud = parts.cloud(settings, registry)
    metrics.collect_with(lambda: fleet_levels(registry, cloud))
    if cloud is not None:
        cloud.start()
    site = parts.site_mirror(settings, rollouts, pushes, registry)
    credentials = parts.with_site_revocations(credentials, site)
    audits, capture = parts.auditor(settings, registry, cloud, recorder, rollouts)
    metrics.collect_with(lambda: audit_levels(audits))
    offline = parts.offline(settings, registry, (metrics, recorder), capture, site, cloud=lambda: plane.cloud)
    plane = RouterDataPlane(
        registry,
        cloud,
        rng=random.Random(),
        fail_without_cloud=settings.on_cloud_failure is OnCloudFailure.FAIL,
        max_requests=settings.max_requests,
        metrics=recorder,
        rollouts=rollouts,
        audits=audits,
        offline=offline,
    )
    server = create_server(
        keepalive_s=settings.keepalive_s,
        keepalive_timeout_s=settings.keepalive_timeout_s,
        client_token=settings.client_token,
        revoked=credentials.revoked if settings.tls.mutual else None,
        max_connection_age_s=settings.connection_age_s,
        reuse_port=settings.shares_ports,
    )
    limits = ClientLimits(settings.max_requests_per_client, items_per_client=settings.max_items_per_client)
    servicer = InferenceServicer(plane, limits=limits)
    add_inference_service(servicer, server)
    gate = AdmissionGate(rate_per_s=settings.admit_per_s, max_waiting=settings.admit_waiting)
    fpb_grpc.add_AgentLinkServicer_to_server(
        AgentLinkServicer(
            registry,
            credentials=credentials,
            gate=gate,
            hello_timeout_s=settings.hello_timeout_s,
            workers=settings.router_workers,
        ),
        server,
    )
    fleet = FleetServicer(
        registry,
        cloud,
        credentials=credentials,
        private_status=settings.private_status,
        rollouts=rollouts,
        audits=audits,
        pushes=pushes,
        site=site,
        corrections=offline.corrections if offline is not None else None,
    )
    fpb_grpc.add_FleetServicer_to_server(fleet, server)
    health = Health(server, plane.ready)
    port = _bind(server, settings)
    name = settings.name or f"router-{socket.gethostname()}-{port}"
    host = (settings.worker_address or settings.listen).rsplit(":", 1)[0]
    closers = await _named(name, rollouts, pushes, site, address=site_address(settings, host, port))
    # what earlier runs deferred, and the tier served here, both before the first call is taken
    closers += await _start_offline(offline, name) + await _start_local_tier(settings, registry, metrics, name)
    await server.start()
    await health.start()
    closers += [audits.close, *([capture.close] if capture else [])]
    closers += await _start_extras(settings, plane, metrics, limits, name=name, host=host, port=port)
    closers += await _start_rest(settings, servicer, credentials)
    audits.start()
    watchdog = asyncio.create_task(_watch_heartbeats(registry), name="stratus-heartbeat-watchdog")
    warning = insecure_warning(
        "the router",
        settings.listen,
        tls=settings.tls.cert is not None,
        callers_authenticated=credentials.callers_authenticated,
    )
    stepping = parts.auto_thresholds(settings, pushes, registry, audits, metrics, site=site)
    log.info("router listening on %s:%d (cloud: %s)", host, port, settings.cloud or "none")
    announce("router", f"{host}:{port}")
    await stop.wait()
    log.info("stopping: not ready now, finishing %d request(s) in flight", plane.active)
    await _shut_down(plane, registry, server, health, settings)
    await _close_the_rest([watchdog, warning, stepping], closers, cloud)
    log.info("stopped")


def _bind(server: grpc.aio.Server, settings: RouterSettings) -> int:
    """The port this router is reached at: --listen's, or, for one of --workers (which shares
    --listen with the others), the port of its own address, bound as well."""
    port = bind(server, settings.listen, settings.tls)
    if settings.worker_address:
        port = bind(server, settings.worker_address, settings.tls)
    return port


async def _named(
    name: str, rollouts: Rollouts, pushes: ThresholdPushes, site: SiteMirror | None, *, address: str
) -> list[Callable[[], Awaitable[None]]]:
    """The router's name where its records say who changed what; the site's store started
    (what the site agreed on, applied before the first call is taken); what closes it."""
    rollouts.router_id = pushes.router_id = name
    if site is None:
        return []
    site.router_id, site.address = name, address
    await site.start()
    return [site.close]


async def _start_offline(offline: Offline | None, name: str) -> list[Callable[[], Awaitable[None]]]:
    """What an earlier run deferred, read before the first call is taken; what closes it."""
    if offline is None:
        return []
    offline.router = name
    await offline.start()
    return [offline.close]


async def _start_local_tier(
    settings: RouterSettings, registry: FleetRegistry, metrics: Metrics, name: str
) -> list[Callable[[], Awaitable[None]]]:
    """``--local-tier``: that tier's models loaded and warmed here, registered as one more agent
    of the tier before the first call is taken; what drains and unloads it. Imported only when
    asked: a router without it loads no runtime."""
    local = settings.local
    if local.tier is None:
        return []
    from router.fleet.in_process import InProcessAgent
    from stratus.execution.describe import Introduction
    from stratus.execution.loading import LocalSettings
    from stratus.execution.local_models import LocalModels

    assert settings.models is not None  # RouterSettings requires it with local.tier
    models = LocalModels(
        ModelRepository.load(settings.models),
        LocalSettings(
            tier=None if local.variants else local.tier,
            variants=local.variants,
            cache_dir=local.cache_dir,
            concurrency=local.concurrency,
            queue_limit=local.queue_limit,
            runtimes=local.runtimes,
            executor_name="stratus-router-infer",
            max_batch=local.max_batch,
            precision=local.precision,
            hardware=settings.hardware,
        ),
        metrics=metrics,
    )
    who = Introduction(
        agent_id=local.name or f"{name}-{local.tier.label}",
        tier=local.tier,
        capacity=local.concurrency,
        queue_limit=local.queue_limit,
    )
    agent = InProcessAgent(registry, models, who, drain_timeout_s=settings.drain_timeout_s)
    await agent.start()
    log.info("serving the %s tier in this process as agent %s: %s", local.tier.label, who.agent_id,
             sorted(models.served))  # fmt: skip
    return [agent.close]


def site_address(settings: RouterSettings, host: str, port: int) -> str:
    """Where the site's other routers (and an operator's CLI) reach this one: --site-address,
    else the listening address, with this host's name for a wildcard one."""
    if settings.site_address:  # a worker of --workers: the host named there, with its own port
        return f"{settings.site_address.rpartition(':')[0]}:{port}" if settings.worker_address else settings.site_address
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.getfqdn()
    return f"{host}:{port}"


async def _close_the_rest(
    tasks: list[asyncio.Task[None] | None],
    closers: list[Callable[[], Awaitable[None]]],
    cloud: CloudPool | None,
) -> None:
    """After the server stopped: background tasks, extras (OpenAI API, /metrics, zeroconf), the cloud link."""
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    for close in closers:
        with contextlib.suppress(Exception):
            await close()
    if cloud is not None:
        await cloud.close()


async def _start_extras(
    settings: RouterSettings,
    plane: RouterDataPlane,
    metrics: Metrics,
    limits: ClientLimits,
    *,
    name: str,
    host: str,
    port: int,
) -> list[Callable[[], Awaitable[None]]]:
    """zeroconf, /metrics and the OpenAI API, as the settings ask; their closers, in order."""
    closers: list[Callable[[], Awaitable[None]]] = []
    if settings.openai:
        openai = OpenAiApi(
            plane,
            api_key=settings.openai_api_key,
            hosts=settings.openai_hosts,
            tls=server_tls(settings.openai_tls_cert, settings.openai_tls_key),
            limits=limits,
        )
        log.info("OpenAI API on %s", await openai.start(settings.openai, reuse_port=settings.shares_ports))
        closers.append(openai.stop)
    if settings.metrics:
        exporter = await serve_metrics(metrics, settings.metrics, token=settings.metrics_token)

        async def close_exporter() -> None:
            exporter.close()

        closers.append(close_exporter)
    if settings.advertise:
        advertisement = Advertisement(name=name, host=host, port=port)
        await advertisement.start()
        closers.append(advertisement.close)
    return closers


async def _start_rest(
    settings: RouterSettings, servicer: InferenceServicer, credentials: RouterCredentials
) -> list[Callable[[], Awaitable[None]]]:
    """The REST front of the inference service (--http), with the gRPC port's TLS (its
    certificate; a client certificate under mutual TLS), client token and revocations."""
    if not settings.http:
        return []
    tls = settings.tls
    api = RestApi(
        servicer,
        client_token=settings.client_token,
        tls=server_context(str(tls.cert), str(tls.key), str(tls.ca) if tls.ca else None)
        if tls.cert
        else None,
        revoked=credentials.revoked if tls.mutual else None,
    )
    log.info("REST API (Open Inference Protocol over HTTP) on %s", await api.start(settings.http, reuse_port=settings.shares_ports))
    return [api.stop]


async def _shut_down(
    plane: RouterDataPlane, registry: FleetRegistry, server: grpc.aio.Server, health: Health, settings: RouterSettings
) -> None:
    """A rolling update loses nothing: not ready at once, clients moved on, in-flight calls finished.

    Readiness (ServerReady, the health service) turns false first, so a balancer's probe sends
    new connections elsewhere and health-checking clients move at once. Plain clients keep
    their connection; each is sent a graceful GOAWAY at its age (``connection_age_s``), its
    next call then goes through the balancer to another router. The router serves on until
    calls stop arriving (or the longest a connection can live has passed: nobody else takes
    them), and only then calls ``server.stop``, whose own GOAWAY cancels calls that reach it
    before a handler takes them (grpc/grpc#41785). Calls in flight finish, on agent links that
    stay open until the last of them is answered.
    """
    plane.stopping = True
    await health.stop()
    grace_s = settings.drain_timeout_s
    # The longest a connection made before not-ready lives on (gRPC jitters the age by 10%), and
    # a moment to see calls stop: clients that dial this router itself (the SDK's list, a
    # --router A,B) come straight back, and move only once the server stops, by their retry.
    limit_s = 1.1 * settings.connection_age_s + NOTICE_S + 2 * QUIET_S
    moved_s = await _until_clients_moved(plane, limit_s=min(grace_s, limit_s))
    log.info("stopping: %s", f"no new call for {QUIET_S:g} s, {moved_s:.1f} s after not ready" if moved_s
             is not None else "calls still arrive (clients that dial this router itself): stopping the server, "
             "their retries go elsewhere")  # fmt: skip
    stopped = asyncio.create_task(server.stop(grace=grace_s))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while plane.active and loop.time() < deadline:
        await asyncio.sleep(0.01)
    if plane.active:
        log.warning("stopping with %d requests still in flight after %.0f s", plane.active, grace_s)
    for handle in list(registry.agents.values()):
        handle.work.outbox.put_nowait(None)
    await stopped


async def _until_clients_moved(plane: RouterDataPlane, *, limit_s: float) -> float | None:
    """Serve on for NOTICE_S, then until no inference call has arrived for QUIET_S (an idle
    router stops after the notice): the seconds that took, or None once ``limit_s`` passed
    with calls still coming."""
    loop = asyncio.get_running_loop()
    start, seen = loop.time(), plane.admitted
    await asyncio.sleep(min(NOTICE_S, limit_s))
    while plane.admitted != seen:
        if loop.time() - start >= limit_s:
            return None
        seen = plane.admitted
        await asyncio.sleep(QUIET_S)
    return loop.time() - start
