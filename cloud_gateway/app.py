"""The cloud gateway: the escalation API for the largest models.

It serves the Open Inference Protocol for the cloud variants (ONNX Runtime on a CPU
machine, TensorRT where present). The router holds one long-lived ModelStreamInfer
stream to it and multiplexes escalations over that stream; any standard client may call
it directly too. Each answer carries ``stratus.confidence`` so the router can judge it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stratus.batching import DEFAULT_MAX_BATCH, DEFAULT_MAX_DELAY_S
from stratus.local import LocalDataPlane, LocalModels, LocalSettings
from stratus.metrics import Metrics
from stratus.metrics import serve as serve_metrics
from stratus.precision import Hardware
from stratus.process import announce, stop_on_signals
from stratus.repository import ModelRepository
from stratus.serving import NO_TLS, Health, InferenceServicer, TlsSettings, bind, create_server
from stratus.tiers import Tier
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.cloud")


@dataclass(frozen=True, kw_only=True)
class CloudSettings:
    listen: str
    models: Path
    variants: Sequence[str] | None = None
    concurrency: int = 2
    queue_limit: int = 256
    max_batch: int = DEFAULT_MAX_BATCH
    max_batch_delay_s: float = DEFAULT_MAX_DELAY_S
    precision: str | None = None
    hardware: Hardware | None = None
    emulated_extra_ms: float = 0.0  # benchmarks and tests only
    metrics: str | None = None  # HOST:PORT for Prometheus's /metrics; None: not served
    cache_dir: Path = Path.home() / ".cache" / "stratus"
    runtimes: Sequence[str] | None = None
    name: str = ""
    tls: TlsSettings = NO_TLS


async def serve(settings: CloudSettings, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    metrics = Metrics()
    models = LocalModels(
        ModelRepository.load(settings.models),
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
    name = settings.name or f"cloud-{socket.gethostname()}"
    server = create_server()
    plane = LocalDataPlane(models, tier=Tier.CLOUD, name=name)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(plane), server)
    health = Health(server, plane.ready)
    port = bind(server, settings.listen, settings.tls)
    await server.start()
    await health.start()
    host = settings.listen.rsplit(":", 1)[0]
    log.info("cloud gateway %s serving %s on %s:%d", name, sorted(models.variants), host, port)
    announce("cloud", f"{host}:{port}")
    exporter = await serve_metrics(metrics, settings.metrics) if settings.metrics else None
    await stop.wait()
    await health.stop()  # not ready first; then no new calls, and those in flight finish
    if exporter is not None:
        exporter.close()
    await server.stop(grace=5.0)
    models.close()
