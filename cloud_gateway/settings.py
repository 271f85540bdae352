"""The cloud gateway's settings: each default written once, here; loaded by
:mod:`stratus.config` from ``[cloud]`` in ``--config FILE``, ``STRATUS_CLOUD_*`` and the flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stratus.config import at_least_one, not_negative, outside, secret, setting, validate
from stratus.families.cpu import Hardware
from stratus.families.precision import Precision
from stratus.obs.endpoint import check_metrics_exposure
from stratus.sched.batching import DEFAULT_MAX_BATCH, DEFAULT_MAX_DELAY_S
from stratus.serving.channels import NO_TLS, TlsSettings
from stratus.serving.client_limits import MAX_REQUESTS_PER_CLIENT


def _http_url(url: str | None) -> str | None:
    if url is None or url.startswith(("http://", "https://")):
        return None
    return f"is an http:// or https:// URL, not {url!r}"


@dataclass(frozen=True, kw_only=True)
class CloudSettings:
    listen: str = "127.0.0.1:8002"
    models: Path = Path("models")
    variants: tuple[str, ...] | None = None  # None: the cloud variants
    concurrency: int = setting(2, check=at_least_one)  # runtime calls at once
    queue_limit: int = setting(256, check=not_negative)  # items that may wait beyond those running
    max_batch: int = setting(DEFAULT_MAX_BATCH, check=at_least_one)  # 1 turns batching off
    max_batch_delay_s: float = setting(DEFAULT_MAX_DELAY_S, check=not_negative)
    precision: Precision | None = None  # None: the fastest this CPU runs within tolerance
    hardware: Hardware | None = outside()  # the CPU read (STRATUS_CPU_FLAGS stands in)
    emulated_extra_ms: float = setting(0.0, check=not_negative)  # benchmarks and tests only
    metrics: str | None = None  # HOST:PORT for Prometheus's /metrics; None: not served
    # Off loopback /metrics needs Prometheus to send "authorization: Bearer METRICS_TOKEN", or
    # metrics_open (a network policy admits only Prometheus), or --insecure.
    metrics_token: str = secret("STRATUS_METRICS_TOKEN")
    metrics_open: bool = False
    cache_dir: Path = Path.home() / ".cache" / "stratus"  # runtime caches
    runtimes: tuple[str, ...] | None = None  # None: every runtime that can run the variants
    name: str = ""
    tls: TlsSettings = NO_TLS
    # Callers must send "authorization: Bearer CLIENT_TOKEN" (the router: --cloud-token-file).
    client_token: str = secret("STRATUS_CLIENT_TOKEN")
    insecure: bool = False  # listen off loopback without TLS and client authentication
    # Certificates revoked though they chain to the CA (SPIFFE ids or serial:HEX lines).
    revoked_certificates: Path | None = None
    # Inference requests one client address may have in flight (0: no limit).
    max_requests_per_client: int = setting(MAX_REQUESTS_PER_CLIENT, check=not_negative)
    # An OpenAI-compatible server (vLLM) that generates for one family; None: no such family.
    openai_upstream: str | None = setting(None, check=_http_url)
    upstream_model: str | None = None  # its model name; None: the first it lists
    upstream_family: str | None = None  # the family served from it; None: the model's name

    def __post_init__(self) -> None:
        validate(self)
        check_metrics_exposure(
            self.metrics, token=self.metrics_token, open_to_all=self.metrics_open, insecure=self.insecure
        )
