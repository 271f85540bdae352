"""How every Stratus gRPC server and channel is built: message and stream limits, keepalive
options, TLS settings, binding a port and dialling a peer, so that every process's links
refuse and time out alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

from stratus.errors import ConfigError, InvalidInput
from stratus.serving.auth import TRUST_DOMAIN_PATTERN, BearerTokenInterceptor, Revocations, role_server_name
from stratus.serving.interceptor import CallerRoles, ErrorInterceptor, InferenceShare, RevokedCallers

# Every server and channel refuses messages past this size (a digits batch of 64 is 16 KiB,
# a request's most items, 1,024, 256 KiB). gRPC's own default: a message is held whole, twice
# (gRPC's buffer, then its bytes), before Stratus sees it, so this bounds what a caller's
# concurrent requests cost the server (16 MiB ones took +600 MB in benchmarks/abuse.py).
MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
# What one message on a shared stream (an AgentLink, the cloud link) may carry: a message over
# MAX_MESSAGE_BYTES ends the whole stream and every call on it, so a request that would
# build one is refused alone, before it is sent.
MAX_WORK_BYTES: Final = MAX_MESSAGE_BYTES - 64 * 1024


def check_fits(size: int, what: str) -> None:
    """Refuse (INVALID_ARGUMENT) a message of ``size`` bytes that a shared stream cannot carry."""
    if size > MAX_WORK_BYTES:
        raise InvalidInput(
            f"{what} would be {size} bytes, over the {MAX_WORK_BYTES}-byte limit of a link; "
            "send fewer items per request"
        )


def grpc_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES, *, keepalive_s: float = 10.0, keepalive_timeout_s: float = 5.0
) -> list[tuple[str, Any]]:
    """Options for every server and channel: ping a quiet peer every ``keepalive_s`` and
    close the connection when a ping goes unanswered for ``keepalive_timeout_s``. A router
    pings its agents often, so a frozen or unplugged agent is lost within seconds; each
    ping costs gRPC's core, not Python, about 0.1 ms here."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        # gRPC's core times a keepalive ping out by this one (default 60 s), not the above.
        ("grpc.http2.ping_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


@dataclass(frozen=True, kw_only=True)
class TlsSettings:
    """TLS for every link a process has, as server and as client.

    ``cert`` and ``key`` are this process's identity (served to peers, and presented to
    servers that ask for a client certificate); ``ca`` verifies peers. On a server, a
    ``ca`` means mutual TLS: a client without a certificate from that CA is refused.
    """

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    # The fleet's SPIFFE trust domain: callers' certificates must be of it, and a server dialled
    # with the fleet CA must carry its role's name in it (see role_server_name).
    trust_domain: str = "stratus"

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if not TRUST_DOMAIN_PATTERN.fullmatch(self.trust_domain):
            raise ConfigError(
                f"--tls-trust-domain {self.trust_domain[:64]!r}: lowercase letters, digits, '.', '-' and '_'"
            )
        for path in (self.cert, self.key, self.ca):
            if path is not None and not path.is_file():
                raise ConfigError(f"TLS file {path} does not exist")

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    @property
    def mutual(self) -> bool:
        """As a server: callers must present a certificate from ``ca``."""
        return self.cert is not None and self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ConfigError("serving TLS needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes() if self.ca else None,
            require_client_auth=self.ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


NO_TLS: Final = TlsSettings()


# Streams one client connection may hold open at once, and calls a server runs at once: a
# client opening thousands of silent streams is refused past these (an AgentLink is one
# stream on its own connection, so a router of 2,000 agents holds 2,000 calls). Generous per
# connection: a client that opens many calls at once on a new channel, before the server's
# SETTINGS reach it, gets REFUSED_STREAM (UNAVAILABLE) past the cap; 300 at once were seen.
MAX_STREAMS_PER_CONNECTION: Final = 1024
MAX_CONCURRENT_RPCS: Final = 16_384
# Of those, the most inference calls (ModelInfer, ModelStreamInfer, metadata) may hold: the
# last quarter is kept for agents' links, Fleet calls, ServerLive and health checks.
INFERENCE_SHARE: Final = 12_288
# Calls that have reached the server and wait for its loop to take them. gRPC's defaults drop
# them at random past 1,000 and all past 3,000, whoever sent them: one client's 4,000 calls at
# once cost another client's calls CANCELLED within a millisecond (security F21). Past this
# many, the server's own slots are taken anyway; a client's share is ClientLimits' to refuse.
MAX_PENDING_CALLS: Final = MAX_CONCURRENT_RPCS
# A connection that has not finished its handshake in this long is closed (silent TCP
# connections were held ~100 s each, security2 N10), and one with no call for this long too:
# clients reconnect on their next call, links and streams hold a call and are never idle.
HANDSHAKE_TIMEOUT_MS: Final = 5_000
MAX_CONNECTION_IDLE_MS: Final = 300_000


def create_server(
    *,
    keepalive_s: float = 10.0,
    keepalive_timeout_s: float = 5.0,
    client_token: str = "",
    inference_roles: frozenset[str] | None = None,
    trust_domain: str = "stratus",
    revoked: Revocations | None = None,
    max_connection_age_s: float | None = None,
    reuse_port: bool = False,
) -> grpc.aio.Server:
    """A server with Stratus's limits; with ``client_token``, inference calls need it as
    ``authorization: Bearer TOKEN``, and with ``inference_roles`` (under mutual TLS) a
    certificate of one of those roles (the other services check their own credentials).

    ``max_connection_age_s``: each connection is sent a graceful GOAWAY at that age (gRPC
    jitters it by 10%), its calls and streams going on to their end: clients open a new one for
    their next call, through whatever balancer is in front. A stopping router waits for that
    instead of its own shutdown's GOAWAY, which cancels calls that reach it before a handler
    takes them (grpc/grpc#41785): a plain client behind a Service lost ~12 calls a restart.

    ``reuse_port``: its ports are bound with SO_REUSEPORT, shared with the router's other
    workers (router/workers.py); otherwise a port in use is refused, as it should be."""
    guards: list[grpc.aio.ServerInterceptor] = [BearerTokenInterceptor(client_token)] if client_token else []
    if revoked is not None:
        guards.append(RevokedCallers(revoked, exempt=BearerTokenInterceptor.OPEN))
    if inference_roles is not None:
        guards.append(CallerRoles(inference_roles, trust_domain=trust_domain, exempt=BearerTokenInterceptor.OPEN))
    guards.append(InferenceShare(INFERENCE_SHARE, exempt=BearerTokenInterceptor.OPEN))
    options = [
        *grpc_options(keepalive_s=keepalive_s, keepalive_timeout_s=keepalive_timeout_s),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ]
    if reuse_port:
        options = [(key, 1 if key == "grpc.so_reuseport" else value) for key, value in options]
    if max_connection_age_s is not None:  # its grace is gRPC's default, unbounded: links run on
        options.append(("grpc.max_connection_age_ms", round(max_connection_age_s * 1000)))
    return grpc.aio.server(
        interceptors=[*guards, ErrorInterceptor()],
        options=options,
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )


def bind(server: grpc.aio.Server, address: str, tls: TlsSettings = NO_TLS) -> int:
    """Bind ``host:port`` (port 0 picks a free one) and return the port actually bound."""
    try:
        if tls.enabled:
            port = server.add_secure_port(address, tls.server_credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # gRPC's "Failed to bind": say what it usually means
        port = 0
    if port == 0:
        raise ConfigError(
            f"cannot listen on {address}: the port is in use (another process, or another "
            "Stratus server), or the host is not an address of this machine"
        )
    return port


def open_channel(
    address: str, tls: TlsSettings = NO_TLS, *, extra_options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to a Stratus server, over TLS when the settings say so.

    Each channel keeps its own connection (a local subchannel pool): gRPC would otherwise
    share one connection between every channel to the same address in a process, and
    agents simulated in one process must each hold their own link, as real ones do.
    """
    options = [*grpc_options(), ("grpc.use_local_subchannel_pool", 1), *extra_options]
    if tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def server_options(role: str, tls: TlsSettings, name: str | None = None) -> list[tuple[str, Any]]:
    """Dial a server of ``role`` (router, cloud) only if its certificate is that role's.

    With the fleet CA given (``--tls-ca``), every Stratus certificate chains to it, an agent's
    as much as a router's: a chain and a host name alone let a stolen agent key pose as the
    router (security2 N2). gRPC's Python API has no hook to read the server's SPIFFE id, so
    each server leaf carries its role's name (``router.<trust domain>.spiffe.invalid``, which
    ``stratus certs`` and the Helm chart write, and no other role's leaf has), and the client
    checks the certificate against that name instead of the host's. Without a CA (public
    roots) the host name is checked as usual: ``name`` where the address does not say it (an
    IP found through DNS or zeroconf), else the address's own."""
    if tls.ca is None:
        return server_name_options(name, tls)
    return [("grpc.ssl_target_name_override", role_server_name(role, tls.trust_domain))]


def server_name_options(name: str | None, tls: TlsSettings) -> list[tuple[str, Any]]:
    """Check a TLS server's certificate against ``name`` rather than the address dialled."""
    return [("grpc.ssl_target_name_override", name)] if name and tls.enabled else []


def open_sync_channel(
    address: str, tls: TlsSettings = NO_TLS, extra_options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel (CLI, SDK's synchronous path)."""
    options = [*grpc_options(), *extra_options]
    if tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.insecure_channel(address, options=options)
