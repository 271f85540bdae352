"""The cloud gateway: the escalation API for the largest models.

It serves the Open Inference Protocol for the cloud variants (ONNX Runtime on a CPU
machine, TensorRT where present) and, with ``--openai-upstream``, a generative family that
an OpenAI-compatible server (vLLM) generates (see :mod:`cloud_gateway.generative`). The
router holds one long-lived ModelStreamInfer stream to it and multiplexes escalations over
that stream; any standard client may call it directly too. Each answer carries
``stratus.confidence`` so the router can judge it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
from collections.abc import AsyncIterator

import grpc

from cloud_gateway.generative import GenerativeModel, UpstreamDataPlane
from cloud_gateway.reload import GatewayServicer, Reloader
from cloud_gateway.settings import CloudSettings
from cloud_gateway.upstream import OpenAIUpstream, UpstreamSettings, served_model
from stratus.errors import NotFound
from stratus.execution.dataplane import LocalDataPlane
from stratus.execution.loading import LocalSettings
from stratus.execution.local_models import LocalModels
from stratus.families.repository import ModelRepository
from stratus.obs.endpoint import serve as serve_metrics
from stratus.obs.metrics import Metrics, ModelMetrics
from stratus.process import announce, stop_on_signals
from stratus.serving.auth import is_loopback
from stratus.serving.channels import bind, create_server
from stratus.serving.client_limits import ClientLimits
from stratus.serving.credential_files import RevokedCertificates
from stratus.serving.exposure import check_endpoint, insecure_warning
from stratus.serving.health import Health
from stratus.serving.servicer import DataPlane, InferenceServicer, add_inference_service
from stratus.tiers import Tier
from stratus.wire import fleet_pb2_grpc as fpb_grpc

log = logging.getLogger("stratus.cloud")


async def serve(settings: CloudSettings, stop: asyncio.Event | None = None) -> None:
    what = "the cloud gateway"
    authenticated = check_endpoint(
        what, settings.listen, settings.tls, client_token=settings.client_token, insecure=settings.insecure
    )
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    metrics = Metrics()
    name = settings.name or f"cloud-{socket.gethostname()}"
    async with _data_plane(settings, metrics, name) as (plane, models):
        server = create_server(
            client_token=settings.client_token,
            # under mutual TLS: escalations from routers, and clients', not any device's
            inference_roles=frozenset({"router", "client", "operator"}) if settings.tls.mutual else None,
            trust_domain=settings.tls.trust_domain,
            revoked=RevokedCertificates(settings.revoked_certificates)
            if settings.revoked_certificates and settings.tls.mutual
            else None,
        )
        limits = ClientLimits(settings.max_requests_per_client)
        add_inference_service(InferenceServicer(plane, limits=limits), server)
        reloader = _reloads(server, settings, models)
        health = Health(server, plane.ready)
        port = bind(server, settings.listen, settings.tls)
        await server.start()
        await health.start()
        host = settings.listen.rsplit(":", 1)[0]
        log.info("cloud gateway %s serving %s on %s:%d", name, plane.model_names(), host, port)
        announce("cloud", f"{host}:{port}")
        exporter = (
            await serve_metrics(metrics, settings.metrics, token=settings.metrics_token) if settings.metrics else None
        )
        warning = insecure_warning(
            what, settings.listen, tls=settings.tls.cert is not None, callers_authenticated=authenticated
        )
        await stop.wait()
        log.info("stopping: not ready now, finishing what is in flight")
        if warning is not None:
            warning.cancel()
        await health.stop()  # not ready first; then no new calls, and those in flight finish
        if exporter is not None:
            exporter.close()
        await server.stop(grace=5.0)
        await reloader.close()
    log.info("stopped")


def _reloads(server: grpc.aio.Server, settings: CloudSettings, models: LocalModels | None) -> Reloader:
    """Reloads on SIGHUP and on a router's CloudGateway.Reload (``stratus fleet reload --cloud``)."""
    reloader = Reloader(models)
    fpb_grpc.add_CloudGatewayServicer_to_server(
        GatewayServicer(
            reloader,
            client_token=settings.client_token,
            mutual_tls=settings.tls.mutual,
            trust_domain=settings.tls.trust_domain,
            off_loopback=not is_loopback(settings.listen.rsplit(":", 1)[0]),
        ),
        server
    )
    with contextlib.suppress(NotImplementedError, AttributeError):  # no SIGHUP off POSIX
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader.on_hangup)
    return reloader


@contextlib.asynccontextmanager
async def _data_plane(
    settings: CloudSettings, metrics: Metrics, name: str
) -> AsyncIterator[tuple[DataPlane, LocalModels | None]]:
    """The local cloud variants (and the models, for reloads), with the upstream's family in
    front of them if there is one; closed when the gateway stops."""
    repository = ModelRepository.load(settings.models)
    upstream = await _upstream(settings) if settings.openai_upstream else None
    models: LocalModels | None = None
    try:
        model = _generative_model(settings, upstream, repository) if upstream is not None else None
        # The upstream serves its family: the gateway does not load (or run) it as well.
        others = {k: v for k, v in repository.families.items() if model is None or k != model.family}
        models = _local_models(settings, dataclasses.replace(repository, families=others), metrics)
        local = LocalDataPlane(models, tier=Tier.CLOUD, name=name) if models is not None else None
        if upstream is None or model is None:
            assert local is not None
            yield local, models
        else:
            recorder = models.recorder if models is not None else None
            plane = UpstreamDataPlane(
                upstream, model, local=local, name=name, recorder=recorder or ModelMetrics(metrics)
            )
            metrics.collect_with(plane.levels)
            yield plane, models
    finally:
        if upstream is not None:
            await upstream.close()
        if models is not None:
            models.close()


def _local_models(
    settings: CloudSettings, repository: ModelRepository, metrics: Metrics
) -> LocalModels | None:
    """The cloud variants to run here; none is fine when an upstream serves the gateway's family."""
    try:
        return LocalModels(
            repository,
            LocalSettings(
                tier=None if settings.variants else Tier.CLOUD,
                variants=settings.variants,
                cache_dir=settings.cache_dir,
                concurrency=settings.concurrency,
                queue_limit=settings.queue_limit,
                runtimes=settings.runtimes,
                executor_name="stratus-cloud-infer",
                max_batch=settings.max_batch,
                max_batch_delay_s=settings.max_batch_delay_s,
                precision=settings.precision,
                hardware=settings.hardware,
                emulated_extra_ms=settings.emulated_extra_ms,
            ),
            metrics=metrics,
        )
    except NotFound:
        if settings.openai_upstream is None:
            raise
        log.info("no cloud variants in %s: serving the upstream's family only", settings.models)
        return None


async def _upstream(settings: CloudSettings) -> OpenAIUpstream:
    """The upstream client, started: its model named, its health and load being followed."""
    assert settings.openai_upstream is not None
    model = settings.upstream_model or await served_model(settings.openai_upstream)
    upstream = OpenAIUpstream(UpstreamSettings(url=settings.openai_upstream, model=model))
    await upstream.start()
    if not upstream.healthy:
        log.warning(
            "upstream %s is not healthy yet; the gateway is not ready until it is", settings.openai_upstream
        )
    return upstream


def upstream_family(model: str, repository: ModelRepository) -> str:
    """The family an upstream model serves when ``--upstream-family`` is not given.

    A model named as one of the repository's variants (vLLM serving ``arith-large``) is that
    variant, answering as its family's cloud tier: otherwise the gateway would make a new
    family of that name, answer the real family's escalations from its own variants, and
    the upstream would never see one. Any other name is a family of its own.
    """
    try:
        family, _pinned = repository.resolve(model)
    except NotFound:
        return model
    return family.name


def _generative_model(
    settings: CloudSettings, upstream: OpenAIUpstream, repository: ModelRepository
) -> GenerativeModel:
    """The family's generation settings from the repository where it is described there."""
    model = upstream.settings.model
    family = settings.upstream_family or upstream_family(model, repository)
    spec = repository.families.get(family)
    generation = spec.generation if spec is not None else None
    if generation is None:
        return GenerativeModel(family=family, variant=model)
    return GenerativeModel(
        family=family,
        variant=model,
        max_tokens=generation.max_tokens,
        stop=generation.stop,
        method=generation.method,
    )
