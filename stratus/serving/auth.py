"""Who a caller is, and what each role may do.

A Stratus fleet has five roles: ``agent`` (joins a router over an AgentLink), ``operator``
(drains, reloads, rollout changes; reads a private status), ``router`` (a router's server identity,
its calls to the cloud and to the site's NATS store), ``cloud`` (a cloud gateway's server identity) and ``client``
(inference callers). A caller proves its role one of two ways:

* **mutual TLS**: its certificate chains to the fleet CA and carries a SPIFFE id
  ``spiffe://<trust domain>/<role>/<name>`` (``stratus certs`` writes such certificates); an
  agent's id is its certificate's name, and nothing else, unless the router's operator made
  that name a pool (``--agent-pool NAME=MAX``: agents sharing one certificate, a DaemonSet),
  whose ids are ``<name>.<suffix>``, at most MAX linked at once, none taking over another's;
* **tokens**: one per role from a file or the environment, and per-agent tokens from a file of
  ``AGENT_ID TOKEN`` lines, which binds each id to its own token.

With neither configured, a server listens on loopback only (or with ``--insecure``), and the
mutating Fleet calls are taken only from callers on the router's own machine.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, Protocol

import grpc

from stratus.errors import PermissionDenied, Unauthenticated


class AgentTokenTable(Protocol):
    """Per-agent tokens (stratus.serving.credential_files.AgentTokens), as checks read them."""

    def token_for(self, agent_id: str) -> str | None: ...


class Revocations(Protocol):
    """Revoked certificates: a router's file (credential_files.RevokedCertificates), the site's
    store's (revocations.SiteRevocations), or both (revocations.AnyRevoked)."""

    def why_revoked(self, auth_context: Mapping[str, Sequence[bytes]]) -> str | None: ...


ROLES: Final = frozenset({"agent", "operator", "router", "cloud", "client"})
NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TRUST_DOMAIN_PATTERN: Final = re.compile(r"[a-z0-9._-]{1,255}")  # SPIFFE's trust-domain charset
# The DNS name a server leaf carries for its role (``router.stratus.spiffe.invalid``): clients
# dialling with the fleet CA check the server's certificate against it. ``.invalid`` is
# reserved (RFC 2606), so no real host has it and no public CA issues it.
ROLE_NAME_SUFFIX: Final = "spiffe.invalid"
SERVER_ROLES: Final = frozenset({"router", "cloud", "agent"})


def role_server_name(role: str, trust_domain: str = "stratus") -> str:
    """The name only ``role``'s certificates of ``trust_domain`` carry."""
    if role not in SERVER_ROLES:
        raise ValueError(f"{role!r} serves nothing a client dials by role")
    return f"{role}.{trust_domain}.{ROLE_NAME_SUFFIX}"


class CertIdentity(NamedTuple):
    """A caller's identity as its certificate states it."""

    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role} {self.name!r}"


def spiffe_identity(
    auth_context: Mapping[str, Sequence[bytes]], trust_domain: str | None = None
) -> CertIdentity | None:
    """(role, name) from a gRPC peer's ``peer_spiffe_id``; None when the peer has none, more
    than one, or one that is not ``spiffe://<td>/<role>/<name>`` with a known role and a valid
    name, or (given ``trust_domain``) one of another trust domain."""
    values = auth_context.get("peer_spiffe_id") or ()
    if len(values) != 1:
        return None
    try:
        text = values[0].decode("ascii")
    except UnicodeDecodeError:
        return None
    parts = text.removeprefix("spiffe://").split("/") if text.startswith("spiffe://") else []
    if len(parts) != 3:
        return None
    domain, role, name = parts
    if trust_domain is not None and domain != trust_domain:
        return None
    if TRUST_DOMAIN_PATTERN.fullmatch(domain) and role in ROLES and NAME_PATTERN.fullmatch(name):
        return CertIdentity(role, name)
    return None


def caller_certificate(context: Any, trust_domain: str | None = "stratus") -> CertIdentity | None:
    """The caller's certificate identity on a mutual-TLS server, in ``trust_domain`` (the
    fleet's; None: any), else None."""
    return spiffe_identity(_auth_context(context), trust_domain)


def _auth_context(context: Any) -> Mapping[str, Sequence[bytes]]:
    try:
        return context.auth_context() or {}
    except (AttributeError, RuntimeError):
        return {}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``localhost``, or an address, brackets allowed) is this machine's loopback."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``)
    is on this machine."""
    if peer.startswith(("unix:", "unix-abstract:")):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].startswith("127.")
    if peer.startswith("ipv6:"):
        host = peer[5:].rsplit(":", 1)[0].strip("[]").lower()
        return host in ("::1", "0:0:0:0:0:0:0:1") or host.startswith("::ffff:127.")
    return False


def same_secret(presented: str, expected: str) -> bool:
    """Constant-time comparison (over digests, so lengths leak nothing either)."""
    return hmac.compare_digest(
        hashlib.sha256(presented.encode()).digest(), hashlib.sha256(expected.encode()).digest()
    )


def id_fits_certificate(agent_id: str, name: str, *, pool: bool = False) -> bool:
    """An agent certificate named N holds the id N; a pool's (``--agent-pool N=MAX``) holds
    the ids ``N.<suffix>`` too. Without the operator's say-so, one certificate is one agent:
    the suffix rule once let one device's certificate register 40 agents (security2 N3)."""
    return agent_id == name or (pool and agent_id.startswith(f"{name}.") and len(agent_id) > len(name) + 1)


POOL_PREFIX: Final = "pool:"


def parse_agent_pool(text: str) -> tuple[str, int]:
    """``NAME=MAX``: the agent certificate NAME is a pool of at most MAX agents linked at once."""
    name, sep, size = text.partition("=")
    if not sep or not NAME_PATTERN.fullmatch(name.strip()):
        raise ValueError(f"--agent-pool {text!r}: expected NAME=MAX, NAME an agent certificate's name")
    try:
        most = int(size)
    except ValueError:
        raise ValueError(f"--agent-pool {text!r}: MAX must be a whole number") from None
    if not 1 <= most <= 100_000:
        raise ValueError(f"--agent-pool {text!r}: MAX must be from 1 to 100000")
    return name.strip(), most


@dataclass(frozen=True, kw_only=True)
class RouterCredentials:
    """What a router checks agents and operators against.

    ``mutual_tls``: the router's server asks every caller for a certificate from the fleet CA,
    so roles and agent ids come from certificates. An operator proves its role with
    either its certificate or its token; an agent with its certificate and, where per-agent or
    fleet agent tokens are configured, its token too.
    """

    mutual_tls: bool = False
    agent_token: str = ""
    agent_tokens: AgentTokenTable | None = None
    operator_token: str = ""
    # Agent certificates that are pools (name -> most members linked at once): --agent-pool.
    agent_pools: Mapping[str, int] = field(default_factory=dict)
    # The fleet's SPIFFE trust domain (--tls-trust-domain): a certificate of another is no one.
    trust_domain: str = "stratus"
    # Certificates revoked though they chain to the CA (--revoked-certificates, and the site's
    # store's `fleet revoke`), and agent ids revoked whatever they prove themselves with.
    revoked: Revocations | None = None
    revoked_agent: Callable[[str], str | None] | None = None
    # The router listens off loopback (with --insecure): then no caller counts as local, since a
    # proxy or sidecar on its machine (Istio's 127.0.0.6, nginx, ssh -L) makes every one look so.
    off_loopback: bool = False
    # Inference callers' token (--client-token-file): a caller holding it may also read the
    # corrections of answers (Fleet.Corrections), which are its answers.
    client_token: str = ""

    @property
    def agents_authenticated(self) -> bool:
        return self.mutual_tls or bool(self.agent_token) or self.agent_tokens is not None

    @property
    def operators_authenticated(self) -> bool:
        return self.mutual_tls or bool(self.operator_token)

    @property
    def callers_authenticated(self) -> bool:
        """What a router off loopback needs: agents and operators both prove who they are."""
        return self.agents_authenticated and self.operators_authenticated

    def agent_identity(self, agent_id: str, token: str, context: Any) -> str:
        """Who holds ``agent_id`` on this link: ``cert:NAME``, ``pool:NAME`` (a member of a
        pool certificate), ``token:ID`` (a per-agent token), ``fleet-token`` or ``anonymous``. A
        link never takes over an id another identity holds, so an id is only as bound as its
        credential: a shared token or none binds nothing."""
        why = self.revoked_agent(agent_id) if self.revoked_agent is not None else None
        if why is not None:
            raise PermissionDenied(why)
        identity = "anonymous"
        if self.mutual_tls:
            cert = self._certificate(context, "an agent")
            if cert.role != "agent":
                raise PermissionDenied(f"a {cert} certificate cannot join as an agent")
            pool = cert.name in self.agent_pools
            if not id_fits_certificate(agent_id, cert.name, pool=pool):
                allowed = f"{cert.name!r} or '{cert.name}.SUFFIX'" if pool else f"only {cert.name!r}"
                raise PermissionDenied(
                    f"agent id {agent_id!r} does not match its certificate's name {cert.name!r} "
                    f"(it may be {allowed}"
                    + ("" if pool else f"; a pool's certificate is named by the router's --agent-pool {cert.name}=MAX")
                    + ")"
                )
            identity = f"{POOL_PREFIX}{cert.name}" if pool and agent_id != cert.name else f"cert:{cert.name}"
        if self.agent_tokens is not None:
            # Per-agent tokens bind every id: an id not listed is refused, never let in on a
            # shared token, and the refusal is the same whether it is listed or not.
            own = self.agent_tokens.token_for(agent_id)
            if own is None or not same_secret(token, own):
                raise Unauthenticated(f"the token of agent {agent_id!r} is missing, wrong or revoked")
            return identity if self.mutual_tls else f"token:{agent_id}"
        if self.agent_token:
            if not same_secret(token, self.agent_token):
                raise Unauthenticated("the agent token is missing or wrong")
            return identity if self.mutual_tls else "fleet-token"
        return identity

    def is_operator(self, token: str, context: Any) -> bool:
        """Whether the caller holds the operator role (as :meth:`require_operator` decides)."""
        try:
            self.require_operator(token, context, "this call")
        except (PermissionDenied, Unauthenticated):
            return False
        return True

    def require_operator(self, token: str, context: Any, what: str) -> None:
        """An operator: its certificate's role, or the operator token."""
        cert = self._trusted(context, what)
        if cert is not None and cert.role == "operator":
            return
        if self.operator_token:
            if not same_secret(token, self.operator_token):
                raise Unauthenticated(f"{what} needs the operator token")
            return
        self._refuse_without_credential(cert, context, what, "operator", "--operator-token-file")

    def require_answers_reader(self, token: str, context: Any, what: str) -> None:
        """An operator, or a caller this router serves inference to: the client token where one
        is set, else (under mutual TLS) a client certificate; with neither, whoever may call
        inference here may read what concerns its answers."""
        if self.is_operator(token, context):
            return
        if self.client_token:
            metadata = dict(context.invocation_metadata() or ()) if context is not None else {}
            presented = metadata.get("authorization", "")
            if isinstance(presented, str) and same_secret(presented, f"Bearer {self.client_token}"):
                return
            raise Unauthenticated(f"{what} needs 'authorization: Bearer TOKEN' (the client token) or the operator's")
        if self.mutual_tls:
            cert = self._trusted(context, what)
            if cert is None or cert.role != "client":
                shown = f"this certificate is a {cert}'s" if cert else "this certificate has no Stratus identity"
                raise PermissionDenied(f"{what} needs a client or operator certificate; {shown}")

    def _refuse_without_credential(
        self, cert: CertIdentity | None, context: Any, what: str, role: str, flag: str
    ) -> None:
        if self.mutual_tls:
            shown = f"this certificate is a {cert}'s" if cert else "this certificate has no Stratus identity"
            raise PermissionDenied(f"{what} needs the {role} role; {shown}")
        self._loopback_only(context, what, flag)

    def _loopback_only(self, context: Any, what: str, flag: str) -> None:
        peer = context.peer() if context is not None else ""
        if self.off_loopback:
            raise PermissionDenied(
                f"{what}: this router listens off loopback and has no credential for it; behind a "
                f"local proxy or sidecar every caller would look local, so none is trusted as such: "
                f"give it {flag} or mutual TLS"
            )
        if not is_loopback_peer(peer):
            raise PermissionDenied(
                f"{what} from {peer}: this router has no credential for it, so only callers on its "
                f"own machine may do it; give it {flag} or mutual TLS"
            )

    def _trusted(self, context: Any, what: str) -> CertIdentity | None:
        """The caller's certificate identity, or None; PermissionDenied for a revoked one."""
        if self.revoked is not None and self.mutual_tls:
            why = self.revoked.why_revoked(_auth_context(context))
            if why is not None:
                raise PermissionDenied(f"{what}: {why}")
        return caller_certificate(context, self.trust_domain)

    def _certificate(self, context: Any, who: str) -> CertIdentity:
        cert = self._trusted(context, who)
        if cert is None:
            raise PermissionDenied(
                f"{who} needs a certificate with a Stratus identity (spiffe://<domain>/<role>/<name>, "
                "as `stratus certs` writes)"
            )
        return cert


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Inference calls need ``authorization: Bearer TOKEN`` (liveness, readiness and health do
    not: probes carry no secrets and learn nothing)."""

    OPEN: Final = frozenset(
        {
            "/inference.GRPCInferenceService/ServerLive",
            "/inference.GRPCInferenceService/ServerReady",
            "/grpc.health.v1.Health/Check",
            "/grpc.health.v1.Health/Watch",
        }
    )

    def __init__(self, token: str, *, guarded_prefix: str = "/inference.GRPCInferenceService/") -> None:
        self._expected = f"Bearer {token}"
        self._prefix = guarded_prefix

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        method = handler_call_details.method
        if method.startswith(self._prefix) and method not in self.OPEN:
            presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
            if not isinstance(presented, str) or not same_secret(presented, self._expected):
                return _refusal(method)
        return await continuation(handler_call_details)


def _refusal(method: str) -> grpc.RpcMethodHandler[Any, Any]:
    message = f"{method.rsplit('/', 1)[-1]} needs 'authorization: Bearer TOKEN' (the client token)"

    async def refuse_unary(request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_iterator: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if method.endswith("StreamInfer"):
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse_unary)
