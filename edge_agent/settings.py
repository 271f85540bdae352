"""The agent's settings: each default written once, here; loaded by :mod:`stratus.config`
from ``[agent]`` in ``--config FILE``, ``STRATUS_AGENT_*`` and the flags."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from stratus.config import at_least_one, not_negative, outside, positive, secret, setting, validate
from stratus.errors import ConfigError
from stratus.families.cpu import Hardware
from stratus.families.precision import Precision
from stratus.obs.endpoint import check_metrics_exposure
from stratus.sched.batching import DEFAULT_MAX_BATCH
from stratus.serving.auth import is_loopback
from stratus.serving.channels import NO_TLS, TlsSettings
from stratus.serving.discovery import dns_target
from stratus.serving.exposure import check_endpoint, clients_authenticated
from stratus.tiers import Tier

SERVE = "the agent's --serve endpoint"


def _agent_tier(tier: Tier) -> str | None:
    return None if tier in (Tier.DEVICE, Tier.EDGE) else "is device or edge (the cloud is a gateway)"


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    tier: Tier = setting(check=_agent_tier)
    router: str  # host:port[,host:port...]; "auto" (zeroconf); or dns:NAME:PORT (every address)
    name: str = ""  # the agent's id; empty: HOSTNAME-TIER (default_name)
    # Runtime calls at once, which is also the capacity the agent declares in its Hello.
    concurrency: int = setting(2, check=at_least_one)
    # Work items that may wait beyond those running.
    queue_limit: int = setting(64, check=not_negative)
    heartbeat_s: float = setting(1.0, check=positive)
    serve: str | None = None
    token: str = secret("STRATUS_AGENT_TOKEN", "STRATUS_TOKEN")
    backoff_initial_s: float = setting(0.2, check=positive)
    # Capped so that a returning router has its whole fleet back within a few seconds.
    backoff_max_s: float = setting(2.0, check=positive)
    drain_timeout_s: float = setting(30.0, check=not_negative)
    tls: TlsSettings = NO_TLS
    metrics: str | None = None  # HOST:PORT for Prometheus's /metrics; None: not served
    # Off loopback /metrics needs Prometheus to send "authorization: Bearer METRICS_TOKEN", or
    # metrics_open (a network policy admits only Prometheus), or --insecure.
    metrics_token: str = secret("STRATUS_METRICS_TOKEN")
    metrics_open: bool = False
    # --serve's callers must send "authorization: Bearer CLIENT_TOKEN"; empty: not asked.
    client_token: str = secret("STRATUS_CLIENT_TOKEN")
    # Plaintext links to routers off this machine, zeroconf without a CA, and --serve off
    # loopback without TLS and client authentication.
    insecure: bool = False
    # What the agent serves: the models folder, and which of its variants and runtimes
    # (None: the tier's variants; every runtime that can run them).
    models: Path = Path("models")
    variants: tuple[str, ...] | None = None
    runtimes: tuple[str, ...] | None = None
    cache_dir: Path = Path.home() / ".cache" / "stratus"  # runtime caches
    max_batch: int = setting(DEFAULT_MAX_BATCH, check=at_least_one)  # 1 turns batching off
    precision: Precision | None = None  # None: the fastest this CPU runs within tolerance
    emulated_extra_ms: float = setting(0.0, check=not_negative)  # benchmarks and tests only
    hardware: Hardware | None = outside()  # the CPU read (STRATUS_CPU_FLAGS stands in)

    def __post_init__(self) -> None:
        validate(self)
        check_metrics_exposure(
            self.metrics, token=self.metrics_token, open_to_all=self.metrics_open, insecure=self.insecure
        )
        if not self.name:
            object.__setattr__(self, "name", default_name(self.tier))
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
        without a CA to verify the router's certificate, or plaintext to another machine. A
        malformed DNS spec is refused first, whatever else is given."""
        named = dns_target(self.router) is not None
        if self.insecure:
            return
        if self.router == "auto" and self.tls.ca is None:
            raise ConfigError(
                "--router auto dials whatever advertises _stratus._tcp: give --tls-ca, so the agent "
                "verifies the router's certificate before it sends anything, or --insecure"
            )
        if self.router == "auto" or named:
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
