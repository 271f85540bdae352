"""Prometheus metrics: one registry per process, families built once, served at ``/metrics``.

Every process owns a :class:`Metrics` (no module-level registry, so tests and several
components in one process never share counters). Components are given the recorder for
their role, as clocks are: :class:`RouterMetrics` to the router's data plane and registry,
:class:`ModelMetrics` to whatever runs models (agents, the cloud gateway). What is a
level rather than an event (agents by state, queues, the cloud breaker) is read at scrape
time by a collector, so it costs nothing between scrapes.

Names start with ``stratus_``, use base units (seconds, bytes), counters end in ``_total``;
labels are bounded sets (family, variant, tier, agent, outcome, reason), never request ids.
A ``family`` or ``variant`` label names what the process's model files (or the fleet's Hellos)
define, never a name a client sent: a request for a variant is counted under the variant's
family, and a name nothing here serves as ``unknown``.
The exposition is prometheus-client's; :mod:`stratus.obs.endpoint` serves it at ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stratus import __version__
from stratus.convert.errors import error_label
from stratus.errors import StratusError

__all__ = [
    "UNKNOWN",
    "GenerationTiming",
    "Metric",
    "Metrics",
    "ModelMetrics",
    "RouterMetrics",
    "counted",
    "gauge",
    "outcome_of",
]

log = logging.getLogger("stratus.metrics")

# Sub-millisecond device answers to multi-second cloud ones.
LATENCY_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128)
CONFIDENCE_BUCKETS: Final = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)
# The family or variant label of a request for a name that nothing here serves.
UNKNOWN: Final = "unknown"


class Children:
    """A labelled metric's children by their label values, kept: prometheus_client's ``labels()``
    takes a lock and checks every value on each call, which the request path paid several times
    per request (issue 37's profile: about 5% of a router's request). Label values here are
    bounded (families, tiers, variants, outcomes), and no child is ever removed."""

    def __init__(self, metric: Counter | Histogram | Gauge) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class Metrics:
    """A process's registry, with what every Stratus process exports: its memory, and what
    it is built from (so a dashboard can tell a fleet mid-upgrade from a fleet that drifted)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        memory = Gauge(
            "stratus_process_resident_memory_bytes",
            "Resident memory of this process (VmRSS).",
            registry=self.registry,
        )
        memory.set_function(resident_bytes)
        build = Gauge(
            "stratus_build_info",
            "1, labelled with the Stratus version, Python, gRPC and the machine this process runs.",
            ["version", "python", "grpc", "machine"],
            registry=self.registry,
        )
        build.labels(__version__, platform.python_version(), grpc.__version__, platform.machine()).set(1)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def collect_with(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Add levels read at scrape time (agents by state, queue depths)."""
        self.registry.register(_Callback(collect))


class _Callback(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()

    def describe(self) -> list[Metric]:
        return []  # families vary with the fleet; described as collected


def resident_bytes(status: Path = Path("/proc/self/status")) -> float:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024.0
    except OSError:
        pass
    return 0.0


class RouterMetrics:
    """What the router records as requests climb the tiers."""

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.metrics = metrics
        self.requests = Counter(
            "stratus_router_requests",
            "Requests by family, highest tier that answered (none when refused) and outcome.",
            ["family", "tier", "outcome"],
            registry=r,
        )
        self.escalations = Counter(
            "stratus_router_escalations",
            "Climbs from one tier to a higher one, by reason: unsure, too_slow or failed.",
            ["family", "from_tier", "to_tier", "reason"],
            registry=r,
        )
        self.duration = Histogram(
            "stratus_router_request_duration_seconds",
            "End-to-end time in the router, per request.",
            ["family"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tier_duration = Histogram(
            "stratus_router_tier_duration_seconds",
            "Time one tier took to answer the items sent to it (queue, link and run).",
            ["family", "tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.degraded = Counter(
            "stratus_router_degraded_answers",
            "Answers returned below the tier their confidence asked for, by why the climb stopped.",
            ["family", "reason"],
            registry=r,
        )
        self.refusals = Counter(
            "stratus_router_refusals",
            "Requests answered with an error, by reason (the gRPC status).",
            ["reason"],
            registry=r,
        )
        self.confidence = Histogram(
            "stratus_router_confidence",
            "Each item's confidence as a tier answered it.",
            ["family", "tier"],
            buckets=CONFIDENCE_BUCKETS,
            registry=r,
        )
        self.batch_items = Histogram(
            "stratus_router_batch_items",
            "Items in each Work sent to an agent.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.rollout_requests = Counter(
            "stratus_router_rollout_requests",
            "Attempts on a tier under a rollout, by arm (current or candidate) and outcome.",
            ["family", "tier", "arm", "outcome"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "stratus_router_generated_tokens",
            "Tokens generative tiers made, by fate: answered (in the answer the client got) or "
            "discarded (a lower tier's answer held and then climbed past, or cancelled).",
            ["family", "tier", "fate"],
            registry=r,
        )
        self.first_text = Histogram(
            "stratus_router_first_text_seconds",
            "Time from a streamed generative request to the first text the client saw.",
            ["family"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rollbacks = Counter(
            "stratus_router_rollout_rollbacks",
            "Candidates rolled back automatically, by what was worse: errors, p99 or unsure.",
            ["family", "tier", "reason"],
            registry=r,
        )
        self.audits = Counter(
            "stratus_router_audits",
            "Items settled below the top tier and asked of it too, by outcome: agreed, disagreed, "
            "or dropped (no spare capacity there, a full audit queue, or the top tier failed it).",
            ["family", "tier", "outcome"],
            registry=r,
        )
        self.captured = Counter(
            "stratus_router_captured",
            "Items handed to --capture's writer, by source: audit (an unbiased sample) or escalated.",
            ["family", "source"],
            registry=r,
        )
        self.capture_dropped = Counter(
            "stratus_router_capture_dropped",
            "Items --capture did not keep, by reason: queue full (the writer is behind) or write failed.",
            ["family", "reason"],
            registry=r,
        )
        # Offline-first (router/offline); the backlog's gauges are collected at scrape time there.
        self.deferred = Counter(
            "stratus_router_deferred",
            "Requests answered provisionally and kept for the cloud to judge (outcome kept), or not kept: "
            "full_items, full_bytes (the family's [offline] bounds), store_failed.",
            ["family", "outcome"],
            registry=r,
        )
        self.deferred_dropped = Counter(
            "stratus_router_deferred_dropped_items",
            "Deferred items that left the store unjudged, by reason: expired (older than max_age_s), "
            "refused_by_cloud, family_changed.",
            ["family", "reason"],
            registry=r,
        )
        self.judged = Counter(
            "stratus_router_judged_items",
            "Provisional items the cloud judged, by the tier that answered them and verdict: agreed or corrected.",
            ["family", "tier", "verdict"],
            registry=r,
        )


@dataclass(frozen=True, kw_only=True)
class GenerationTiming:
    """One generation's times, from its arrival at this process. ``queued_s`` and
    ``first_token_s`` are None where they are not known (an upstream server's own queue; a
    generation that made no token, or answered whole)."""

    queued_s: float | None
    first_token_s: float | None
    running_s: float  # from its slot (or the upstream call) to its last token
    tokens: int


class ModelMetrics:
    """What a process that runs models records (agents, the cloud gateway)."""

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.metrics = metrics
        self.inference = Histogram(
            "stratus_inference_duration_seconds",
            "Runtime call per batch, by variant, runtime and precision.",
            ["variant", "runtime", "precision"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_items = Histogram(
            "stratus_inference_batch_items",
            "Items in each runtime call.",
            ["variant"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.work = Counter(
            "stratus_work",
            "Requests (Work from a router, or direct calls) by family, the variant that ran (or "
            "would have), and outcome: ok, cancelled or the gRPC status.",
            ["family", "variant", "outcome"],
            registry=r,
        )
        self.load_failures = Counter(
            "stratus_model_load_failures",
            "Runtimes that refused to load (or warm up) a variant here; the next runtime was tried.",
            ["variant", "runtime"],
            registry=r,
        )
        self.inference_of, self.batch_items_of = Children(self.inference), Children(self.batch_items)
        self.work_of = Children(self.work)
        self._generation_metrics(r)

    def _generation_metrics(self, r: CollectorRegistry) -> None:
        labels = ["family", "variant"]
        self.first_token = Histogram(
            "stratus_generation_first_token_seconds",
            "Time from a generative request's arrival here to its first token (waiting for a slot included).",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter(
            "stratus_generation_tokens",
            "Tokens generated here, whatever became of them (a generation cancelled keeps those it made).",
            labels,
            registry=r,
        )
        self.generation = Histogram(
            "stratus_generation_duration_seconds",
            "Time each generation ran, from its slot to its last token: tokens per second is "
            "rate(stratus_generation_tokens_total) / rate(stratus_generation_duration_seconds_sum).",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generation_queue = Histogram(
            "stratus_generation_queue_seconds",
            "Time each generation waited for one of its variant's slots.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def count_work(self, family: str, variant: str, outcome: str) -> None:
        self.work_of(family, variant, outcome).inc()

    def record_generation(self, family: str, variant: str, timing: GenerationTiming) -> None:
        if timing.queued_s is not None:
            self.generation_queue.labels(family, variant).observe(timing.queued_s)
        if timing.first_token_s is not None:
            self.first_token.labels(family, variant).observe(timing.first_token_s)
        self.generation.labels(family, variant).observe(timing.running_s)
        if timing.tokens:
            self.generated_tokens.labels(family, variant).inc(timing.tokens)


def outcome_of(error: StratusError) -> str:
    """A failed request's outcome label: its gRPC status, as ``deadline_exceeded``."""
    return error_label(error)


@contextlib.contextmanager
def counted(count: Callable[[str], None]) -> Iterator[None]:
    """Count one request once, by how it ended: ok, cancelled (the caller went away), or its
    error's gRPC status; the error itself goes on to the caller."""
    try:
        yield
    except StratusError as exc:
        count(outcome_of(exc))
        raise
    except (asyncio.CancelledError, GeneratorExit):
        count("cancelled")
        raise
    count("ok")


def gauge(
    name: str, documentation: str, labels: list[str], values: Iterable[tuple[list[str], float]]
) -> Metric:
    """One gauge family with its samples, for collectors."""
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family
