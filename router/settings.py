"""The router's settings: each default written once, here; loaded by :mod:`stratus.config`
from ``[router]`` in ``--config FILE``, ``STRATUS_ROUTER_*`` and the flags."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from router.audit.capture import CaptureOptions
from router.audit.sampling import AuditPolicy
from router.cloud.models import parse_cloud_models, parse_header, secret_headers
from router.cloud.pool import CloudTarget
from router.offline import DEFAULT_ADJUDICATE_SHARE
from router.thresholds.auto import AutoPolicy
from stratus.config import at_least_one, not_negative, outside, positive, secret, setting, share, validate
from stratus.errors import ConfigError
from stratus.families.cpu import Hardware
from stratus.families.precision import Precision
from stratus.obs.endpoint import check_metrics_exposure
from stratus.sched.batching import DEFAULT_MAX_BATCH, DEFAULT_MAX_DELAY_S
from stratus.serving.auth import RouterCredentials, is_loopback, parse_agent_pool
from stratus.serving.channels import NO_TLS, TlsSettings
from stratus.serving.client_limits import MAX_ITEMS_PER_CLIENT, MAX_REQUESTS_PER_CLIENT
from stratus.serving.credential_files import AgentTokens, RevokedCertificates
from stratus.serving.exposure import check_exposure, check_secrets
from stratus.tiers import Tier


def _local_tier(tier: Tier | None) -> str | None:
    return None if tier in (None, Tier.DEVICE, Tier.EDGE) else "is device or edge (the cloud is a gateway)"


@dataclass(frozen=True, kw_only=True)
class LocalTierOptions:
    """``--local-tier`` and its flags (``[router.local]`` in a config file): a tier of the fleet
    served in the router's own process from ``--models`` (router/fleet/in_process.py), as an
    agent of that tier on the same machine would serve it, without its process and its hop."""

    tier: Tier | None = setting(None, check=_local_tier)  # None: none served here
    name: str = ""  # its agent id; empty: the router's name and the tier (router-x-8001-edge)
    variants: tuple[str, ...] | None = None  # None: the tier's current variants
    runtimes: tuple[str, ...] | None = None
    concurrency: int = setting(2, check=at_least_one)  # runtime calls at once (threads)
    queue_limit: int = setting(64, check=not_negative)
    max_batch: int = setting(DEFAULT_MAX_BATCH, check=at_least_one)
    precision: Precision | None = None  # None: the fastest this CPU runs within tolerance
    cache_dir: Path = Path.home() / ".cache" / "stratus"  # runtime caches


class OnCloudFailure(enum.Enum):
    """What an escalation that needs the cloud gets while the cloud is away."""

    DEGRADE = "degrade"  # the best answer below, marked degraded
    FAIL = "fail"  # UNAVAILABLE


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    listen: str = "127.0.0.1:8001"
    cloud: str | None = None
    advertise: bool = True
    heartbeat_s: float = setting(1.0, check=positive)
    # Heartbeats the whole fleet may send per second; the interval doubles past it. Each
    # costs the router about 0.2 ms of Python: 100/s is 2% of a core.
    max_heartbeats_per_s: float = setting(100.0, check=positive)
    # Agents admitted per second after a restart, and how many Hellos may wait in line.
    admit_per_s: float = setting(500.0, check=positive)
    admit_waiting: int = setting(4096, check=at_least_one)
    # How long a new AgentLink may stay silent before its Hello (an agent sends it at once).
    hello_timeout_s: float = setting(10.0, check=positive)
    # HTTP/2 keepalive on every link: a peer that stops answering pings (dead, frozen,
    # unplugged) is lost within keepalive_s + keepalive_timeout_s, at any fleet size.
    keepalive_s: float = setting(2.0, check=positive)
    keepalive_timeout_s: float = setting(1.0, check=positive)
    token: str = secret("STRATUS_TOKEN")  # one token for every role, where a role has none of its own
    # Each role's own credential: agents' Hellos, operators' changes (drain, reload,
    # rollouts). Empty: the fleet token.
    agent_token: str = secret("STRATUS_AGENT_TOKEN")
    operator_token: str = secret("STRATUS_OPERATOR_TOKEN")
    # Removed with the peer protocol (issue 35): given, each stops the router saying what
    # replaces it, rather than a site silently sharing nothing after an upgrade.
    peer_token: str = secret("STRATUS_PEER_TOKEN")
    # Per-agent tokens (AGENT_ID TOKEN lines): each id bound to its own token.
    agent_tokens_file: Path | None = None
    # Agent certificates that are pools ((NAME, MAX): ids NAME.SUFFIX, at most MAX linked at
    # once); any other agent certificate holds exactly its own name.
    agent_pools: tuple[tuple[str, int], ...] = setting((), item=parse_agent_pool)
    # Inference callers must send "authorization: Bearer CLIENT_TOKEN"; empty: not asked.
    client_token: str = secret("STRATUS_CLIENT_TOKEN")
    # Sent to the cloud gateway as "authorization: Bearer CLOUD_TOKEN" (its --client-token-file).
    cloud_token: str = secret("STRATUS_CLOUD_TOKEN")
    # Listen off loopback without TLS and caller authentication (warned about every minute).
    insecure: bool = False
    # Status, Watch and rollout status need the operator role too.
    private_status: bool = False
    # Certificates revoked though they chain to the CA (SPIFFE ids or serial:HEX lines, re-read
    # when changed): their calls are refused, and an agent's link ends at its next heartbeat.
    revoked_certificates: Path | None = None
    # The operator's own copy of the models folder: each family's description (tensors,
    # thresholds) comes from it, and an agent that describes a family otherwise is refused for
    # it. None: the first ready agent's description is the fleet's.
    models: Path | None = None
    # Off loopback, serve inference without a client token or mutual TLS (anyone may then use
    # the cloud through this router): refused unless said.
    anonymous_inference: bool = False
    # Inference requests one client address may have in flight (0: no limit).
    max_requests_per_client: int = setting(MAX_REQUESTS_PER_CLIENT, check=not_negative)
    # Items (dimension 0 of each request's first input) one client address may have in flight (0: no limit).
    max_items_per_client: int = setting(MAX_ITEMS_PER_CLIENT, check=not_negative)
    name: str = ""
    tls: TlsSettings = NO_TLS
    on_cloud_failure: OnCloudFailure = OnCloudFailure.DEGRADE
    max_requests: int = setting(4096, check=at_least_one)
    # Longest a batch for a busy agent waits for more requests before it is sent anyway.
    max_batch_delay_s: float = setting(DEFAULT_MAX_DELAY_S, check=not_negative)
    metrics: str | None = None  # HOST:PORT for Prometheus's /metrics; None: not served
    # Off loopback /metrics needs Prometheus to send "authorization: Bearer METRICS_TOKEN", or
    # metrics_open (a network policy admits only Prometheus), or --insecure.
    metrics_token: str = secret("STRATUS_METRICS_TOKEN")
    metrics_open: bool = False
    # On SIGTERM: how long requests in flight may take to finish before the router exits.
    drain_timeout_s: float = setting(20.0, check=not_negative)
    # Every client connection is moved on (a graceful GOAWAY) at this age, so that on SIGTERM
    # a router waits at most this long, still serving, for its clients to reconnect elsewhere
    # before it stops (router/app.py _shut_down); agents' links and streams run on regardless.
    connection_age_s: float = setting(10.0, check=positive)
    # Removed with the peer protocol (issue 35), refused by name: see check_site_state.
    rollout_state: Path | None = None
    peers: str | None = None
    # The site's shared state (router/site): file:PATH (a lone router's, kept across restarts)
    # or nats://HOST:PORT / tls://HOST:PORT (every router of the site on one store); None: this
    # router's rollouts, threshold pushes and drains in memory only.
    site_state: str | None = None
    # The address the site's other routers and `fleet thresholds --suggest` reach this router
    # at, registered in a shared store; empty: --listen's, or this host's name with its port
    # where --listen is a wildcard.
    site_address: str = ""
    # How long the site's judge lease (rollout steps, --auto-thresholds) outlives its holder's
    # last renewal: another router takes the judging over within it when that one dies.
    site_lease_s: float = setting(15.0, check=positive)
    # Credentials for a NATS store: a .creds file or a user/password file (never in the URL).
    site_state_creds: Path | None = None
    # HOST:PORT for the Open Inference Protocol over HTTP/REST (Triton's port 8000; the same
    # data plane, credentials and TLS as the gRPC port); None: not served.
    http: str | None = None
    # HOST:PORT for the OpenAI API (/v1/completions, /v1/chat/completions); None: not served.
    openai: str | None = None
    # Its API key (required off loopback), and Host names it answers besides loopback's.
    openai_api_key: str = secret("STRATUS_OPENAI_API_KEY")
    openai_hosts: tuple[str, ...] = ()
    # HTTPS for it: a certificate (chain) and key for the names its clients dial, which the
    # fleet's role-named leaves are not; None: plain HTTP (off loopback, warned about: the key
    # and the prompts then travel in clear unless TLS ends in front of it).
    openai_tls_cert: Path | None = None
    openai_tls_key: Path | None = None
    # A cloud that is not a Stratus gateway: the models it serves the families with
    # ("NAME" or "FAMILY=NAME", comma-separated), and gRPC metadata sent on every call to it.
    cloud_models: str | None = None
    cloud_headers: tuple[tuple[str, str], ...] = setting((), item=parse_header)
    # The same from a file (--cloud-header-file: KEY=VALUE lines), for values that are secrets:
    # a flag's value shows in `ps` and shell history.
    cloud_header: str = secret("STRATUS_CLOUD_HEADER")
    # Background audits (router/audit/auditor.py): the share of the items settled below a family's
    # top tier also asked of it, and at most this many a second per family; a family's
    # [audit] table overrides both.
    audit: AuditPolicy = field(default_factory=AuditPolicy)
    # --auto-thresholds: families whose thresholds step toward the audits' suggestion by
    # themselves (router/thresholds/auto.py); none by default.
    auto_thresholds: AutoPolicy = field(default_factory=AutoPolicy)
    # --capture: audited and escalated items of the families named, as Parquet (router/audit/capture.py).
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    # Offline-first (router/offline): where a lone router keeps requests answered provisionally
    # while the cloud was away (deferred/) and the cloud's corrections (corrections.jsonl),
    # across restarts and crashes; None: nothing is deferred (answers are degraded, as before).
    state_dir: Path | None = None
    # The share of the cloud's capacity judging deferred requests may take, out of its spare room.
    adjudicate_share: float = setting(DEFAULT_ADJUDICATE_SHARE, check=share)
    # Decision records as Parquet (every provisional request's, and this share of the others').
    decision_log: Path | None = None
    decision_log_share: float = setting(0.0, check=share)
    # A tier served in this process from --models (router/fleet/in_process.py); off by default.
    local: LocalTierOptions = field(default_factory=LocalTierOptions)
    hardware: Hardware | None = outside()  # the CPU --local-tier's precision choice reads
    # Router processes sharing --listen (SO_REUSEPORT), each on a core of its own
    # (router/workers.py); 1: this process serves alone.
    workers: int = setting(1, check=at_least_one)
    # Set by the parent of --workers for each worker, never by hand: the worker's own address
    # (agents link to each worker there; an operator reaches one worker there) and every
    # worker's as agents reach them, which its Welcome names so that an agent that came
    # through --listen links to each.
    worker_address: str = ""
    router_workers: tuple[str, ...] = ()

    @property
    def shares_ports(self) -> bool:
        """One of --workers: its ports (gRPC, --http, --openai) are bound with SO_REUSEPORT."""
        return bool(self.worker_address)

    def __post_init__(self) -> None:
        validate(self)
        if self.local.tier is not None and self.models is None:
            raise ConfigError("--local-tier serves from the operator's models folder: give --models DIR too")
        check_metrics_exposure(
            self.metrics, token=self.metrics_token, open_to_all=self.metrics_open, insecure=self.insecure
        )
        parse_cloud_models(self.cloud_models)  # a bad entry stops the router before it serves
        if self.cloud:
            CloudTarget.parse(self.cloud)
        for key, value in self.cloud_headers:
            parse_header(f"{key}={value}")
        secret_headers(self.cloud_header)  # a bad line stops the router, naming the line, not the value
        if (self.openai_tls_cert is None) != (self.openai_tls_key is None):
            raise ConfigError("--openai-tls-cert and --openai-tls-key go together")
        for path in (self.openai_tls_cert, self.openai_tls_key):
            if path is not None and not path.is_file():
                raise ConfigError(f"the OpenAI API's TLS file {path} does not exist")
        if self.agent_tokens_file and self.agent_token:
            raise ConfigError(
                "--agent-token-file (one token for every agent) and --agent-tokens-file (a token "
                "per agent) together would let any id in on the shared one: give one of them"
            )

    def check_site_state(self) -> None:
        """The site's store replaced the peer protocol and the state file: either given stops
        the router, saying what to give instead (README: "Migrating from --peers")."""
        removed = {
            "--peers": (self.peers, "give every router of the site --site-state nats://HOST:PORT (one NATS JetStream store)"),
            "--peer-token-file / STRATUS_PEER_TOKEN": (self.peer_token, "the store's own credentials replace it (--site-state-creds, or tls:// with the router's certificate)"),
            "--rollout-state": (self.rollout_state, "give --site-state file:PATH (a lone router) or nats://HOST:PORT (a site)"),
        }  # fmt: skip
        for flag, (value, instead) in removed.items():
            if value:
                raise ConfigError(f"{flag} was removed with the routers' peer protocol: {instead}")

    def all_cloud_headers(self) -> tuple[tuple[str, str], ...]:
        """The metadata sent on every call to the cloud: the flags', then the file's."""
        return (*self.cloud_headers, *secret_headers(self.cloud_header))

    def credentials(self) -> RouterCredentials:
        return RouterCredentials(
            mutual_tls=self.tls.mutual,
            # per-agent tokens bind every id: no shared token stands in beside them
            agent_token="" if self.agent_tokens_file else self.agent_token or self.token,
            agent_tokens=AgentTokens(self.agent_tokens_file) if self.agent_tokens_file else None,
            operator_token=self.operator_token or self.token,
            agent_pools=dict(self.agent_pools),
            trust_domain=self.tls.trust_domain,
            off_loopback=not is_loopback(self.listen.rsplit(":", 1)[0]),
            revoked=RevokedCertificates(self.revoked_certificates) if self.revoked_certificates else None,
            client_token=self.client_token,
        )

    def check_exposure(self, credentials: RouterCredentials) -> None:
        """Off loopback: TLS, and credentials for agents and operators, or --insecure."""
        check_exposure(
            "the router",
            self.listen,
            tls=self.tls.cert is not None,
            callers_authenticated=credentials.callers_authenticated,
            insecure=self.insecure,
            needs="credentials for agents and operators (--tls-ca for mutual TLS, or "
            "--agent-token-file/--agent-tokens-file and --operator-token-file)",
        )
        if not (self.insecure or self.anonymous_inference or self.tls.mutual or self.client_token):
            check_exposure(
                "the router's inference API",
                self.listen,
                tls=True,
                callers_authenticated=False,
                insecure=False,
                needs="client authentication (--tls-ca for mutual TLS, or --client-token-file): "
                "strangers would reach the cloud through it on this router's token; or say "
                "--anonymous-inference",
            )
        if self.http:
            check_exposure(
                "the router's REST API",
                self.http,
                tls=self.tls.cert is not None,
                callers_authenticated=self.anonymous_inference or self.tls.mutual or bool(self.client_token),
                insecure=self.insecure,
                needs="client authentication (--tls-ca for mutual TLS, or --client-token-file), or "
                "--anonymous-inference",
            )
        check_secrets(
            "the router",
            self.listen,
            {
                "the agent token": credentials.agent_token,
                "the operator token": credentials.operator_token,
                "the client token": self.client_token,
                "the cloud token": self.cloud_token,
            },
            insecure=self.insecure,
        )
