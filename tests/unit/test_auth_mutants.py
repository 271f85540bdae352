"""Who may do what (stratus.serving.auth), pinned where mutation testing found the rules loose:
exact refusals (which flag to give, who was refused), the inference-token interceptor, the
exposure checks and the parsers of the operator's flags."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest

from stratus.errors import ConfigError, PermissionDenied, Unauthenticated
from stratus.serving.auth import (
    BearerTokenInterceptor,
    CertIdentity,
    RouterCredentials,
    caller_certificate,
    id_fits_certificate,
    is_loopback,
    is_loopback_peer,
    parse_agent_pool,
    role_server_name,
    spiffe_identity,
)
from stratus.serving.exposure import (
    check_endpoint,
    check_exposure,
    check_secrets,
    clients_authenticated,
    exposed_insecurely,
    insecure_warning,
    warn_insecure_forever,
)
from tests.unit.test_auth import AGENT_TOKEN, Context

OPERATOR_TOKEN = "operator-token-00000001"
CLIENT_TOKEN = "client-token-00000001"


REMOTE = Context("ipv4:10.1.2.3:5000")
AGENT_CERT = Context(spiffe="spiffe://stratus/agent/device-1")


@dataclass
class Revoked:
    """A revocation list that revokes every certificate, for one stated reason."""

    why: str = "certificate is stolen"

    def why_revoked(self, auth_context: Any) -> str | None:
        return self.why


@dataclass
class Tokens:
    """Per-agent tokens, as the checks read them."""

    table: dict[str, str]

    def token_for(self, agent_id: str) -> str | None:
        return self.table.get(agent_id)


def refusal(exc: type[Exception], message: str) -> Any:
    """pytest.raises for exactly ``message``, nothing more nor less."""
    return pytest.raises(exc, match=f"^{re.escape(message)}$")


# --- identities -------------------------------------------------------------------------------


def test_a_caller_certificate_is_of_the_stratus_trust_domain_unless_told_otherwise() -> None:
    """The default trust domain is the fleet's default, "stratus": another's certificate is no one."""
    assert caller_certificate(AGENT_CERT) == CertIdentity("agent", "device-1")
    other = Context(spiffe="spiffe://other/agent/device-1")
    assert caller_certificate(other) is None
    assert caller_certificate(other, None) == CertIdentity("agent", "device-1")


def test_an_id_without_the_spiffe_scheme_is_no_identity() -> None:
    """``stratus/agent/x`` has the three parts of an id but not its scheme."""
    assert spiffe_identity({"peer_spiffe_id": [b"stratus/agent/device-1"]}) is None
    assert spiffe_identity({"peer_spiffe_id": [b"spiffe://stratus/agent/device-1"]}) == ("agent", "device-1")


def test_a_certificate_is_one_agent_unless_named_a_pool() -> None:
    """Without pool=True no suffix fits; with it, a suffix of one character is enough."""
    assert id_fits_certificate("edge.a", "edge") is False
    assert id_fits_certificate("edge.a", "edge", pool=True) is True
    assert id_fits_certificate("edge", "edge") is True


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("unix-abstract:stratus", True),
        ("ipv6:[0:0:0:0:0:0:0:1]:5000", True),
        ("ipv6:::1:5000", True),  # without brackets
        ("ipv6:1::1:5000", False),  # 1::1 is not ::1
        ("ipv6:X::1:5000", False),
        ("ipv6:[::1]X:5000", False),
    ],
)
def test_loopback_peers_spelled_every_way(peer: str, local: bool) -> None:
    """Every spelling of this machine counts, and nothing that merely contains one."""
    assert is_loopback_peer(peer) is local


def test_a_host_with_stray_characters_is_not_loopback() -> None:
    assert is_loopback("[::1]") is True
    assert is_loopback("X127.0.0.1") is False
    assert is_loopback("127.0.0.1X") is False


def test_role_server_names_carry_role_and_trust_domain() -> None:
    """A client dialling by role checks this name; only server roles have one."""
    assert role_server_name("router") == "router.stratus.spiffe.invalid"
    assert role_server_name("cloud", "acme") == "cloud.acme.spiffe.invalid"
    with refusal(ValueError, "'operator' serves nothing a client dials by role"):
        role_server_name("operator")


# --- agent identities -------------------------------------------------------------------------


def test_an_agent_on_an_open_router_is_anonymous() -> None:
    assert RouterCredentials().agent_identity("device-1", "", Context()) == "anonymous"


def test_an_agent_without_a_certificate_is_told_what_it_needs() -> None:
    with refusal(
        PermissionDenied,
        "an agent needs a certificate with a Stratus identity (spiffe://<domain>/<role>/<name>, "
        "as `stratus certs` writes)",
    ):
        RouterCredentials(mutual_tls=True).agent_identity("device-1", "", Context())


def test_a_revoked_agent_certificate_is_refused_as_an_agent() -> None:
    credentials = RouterCredentials(mutual_tls=True, revoked=Revoked())
    with refusal(PermissionDenied, "an agent: certificate is stolen"):
        credentials.agent_identity("device-1", "", AGENT_CERT)


def test_a_pool_refusal_names_the_ids_the_pool_may_hold() -> None:
    """A pool's refusal says which ids fit, and does not tell the operator to make it a pool."""
    pools = RouterCredentials(mutual_tls=True, agent_pools={"edge-pool": 2})
    with refusal(
        PermissionDenied,
        "agent id 'other.node' does not match its certificate's name 'edge-pool' "
        "(it may be 'edge-pool' or 'edge-pool.SUFFIX')",
    ):
        pools.agent_identity("other.node", "", Context(spiffe="spiffe://stratus/agent/edge-pool"))


def test_a_certificate_and_per_agent_token_bind_the_id_to_the_certificate() -> None:
    credentials = RouterCredentials(mutual_tls=True, agent_tokens=Tokens({"device-1": AGENT_TOKEN}))
    assert credentials.agent_identity("device-1", AGENT_TOKEN, AGENT_CERT) == "cert:device-1"
    with pytest.raises(Unauthenticated):
        credentials.agent_identity("device-1", "wrong-token-000000001", AGENT_CERT)


def test_the_fleet_agent_token_admits_its_holders_and_no_one_else() -> None:
    fleet = RouterCredentials(agent_token=AGENT_TOKEN)
    assert fleet.agent_identity("device-1", AGENT_TOKEN, REMOTE) == "fleet-token"
    for wrong in ("", "wrong-token-000000001"):
        with refusal(Unauthenticated, "the agent token is missing or wrong"):
            fleet.agent_identity("device-1", wrong, REMOTE)


def test_with_a_certificate_the_fleet_token_adds_a_check_not_an_identity() -> None:
    both = RouterCredentials(mutual_tls=True, agent_token=AGENT_TOKEN)
    assert both.agent_identity("device-1", AGENT_TOKEN, AGENT_CERT) == "cert:device-1"
    with pytest.raises(Unauthenticated):
        both.agent_identity("device-1", "", AGENT_CERT)


# --- operators ----------------------------------------------------------------------------


def test_an_open_router_tells_a_remote_operator_which_flag_to_give() -> None:
    with refusal(
        PermissionDenied,
        "Drain from ipv4:10.1.2.3:5000: this router has no credential for it, so only callers on its "
        "own machine may do it; give it --operator-token-file or mutual TLS",
    ):
        RouterCredentials().require_operator("", REMOTE, "Drain")


def test_an_open_router_off_loopback_trusts_no_caller_as_local() -> None:
    """security: behind a local proxy every caller looks local, so a loopback peer is no one."""
    with refusal(
        PermissionDenied,
        "Drain: this router listens off loopback and has no credential for it; behind a local proxy "
        "or sidecar every caller would look local, so none is trusted as such: give it "
        "--operator-token-file or mutual TLS",
    ):
        RouterCredentials(off_loopback=True).require_operator("", Context(), "Drain")


def test_a_call_with_no_context_is_no_local_caller() -> None:
    """No context means no peer: refused like a stranger, not crashed on."""
    with refusal(
        PermissionDenied,
        "Drain from : this router has no credential for it, so only callers on its own machine may "
        "do it; give it --operator-token-file or mutual TLS",
    ):
        RouterCredentials().require_operator("", None, "Drain")


def test_revoked_certificates_are_refused_naming_the_call() -> None:
    credentials = RouterCredentials(mutual_tls=True, revoked=Revoked())
    operator = Context(spiffe="spiffe://stratus/operator/alice")
    with refusal(PermissionDenied, "Drain: certificate is stolen"):
        credentials.require_operator("", operator, "Drain")


def test_an_operator_refusal_says_whose_certificate_was_shown() -> None:
    with refusal(PermissionDenied, "Drain needs the operator role; this certificate is a agent 'a''s"):
        RouterCredentials(mutual_tls=True).require_operator("", Context(spiffe="spiffe://stratus/agent/a"), "Drain")


def test_is_operator_answers_as_require_operator_decides() -> None:
    open_router = RouterCredentials()
    assert open_router.is_operator("", Context()) is True
    assert open_router.is_operator("", REMOTE) is False
    tokens = RouterCredentials(operator_token=OPERATOR_TOKEN)
    assert tokens.is_operator(OPERATOR_TOKEN, REMOTE) is True
    assert tokens.is_operator("wrong-token-000000001", REMOTE) is False
    mtls = RouterCredentials(mutual_tls=True)
    assert mtls.is_operator("", Context(spiffe="spiffe://stratus/operator/alice")) is True
    assert mtls.is_operator("", AGENT_CERT) is False


# --- the inference token ----------------------------------------------------------------------


class Details(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, Any], ...] | None


class AbortContext:
    """Records what a refusal aborts with."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)


PASSED = object()


def intercept(details: Details, *, prefix: str | None = None) -> tuple[Any, list[Any]]:
    """The interceptor's answer for ``details``, and what reached the continuation."""
    reached: list[Any] = []

    async def continuation(call_details: Any) -> Any:
        reached.append(call_details)
        return PASSED

    guard = (
        BearerTokenInterceptor(CLIENT_TOKEN)
        if prefix is None
        else BearerTokenInterceptor(CLIENT_TOKEN, guarded_prefix=prefix)
    )
    return asyncio.run(guard.intercept_service(continuation, details)), reached


INFER = "/inference.GRPCInferenceService/ModelInfer"
BEARER = (("authorization", f"Bearer {CLIENT_TOKEN}"),)


def test_inference_with_the_client_token_goes_through_untouched() -> None:
    details = Details(INFER, (("x-trace", "1"), *BEARER))
    answer, reached = intercept(details)
    assert answer is PASSED and reached == [details]


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        (),
        (("authorization", "Bearer wrong-token-0001"),),
        (("authorization", CLIENT_TOKEN),),  # no "Bearer "
        (("authorization", f"Bearer {CLIENT_TOKEN}".encode()),),  # not text
        (("x-authorization", f"Bearer {CLIENT_TOKEN}"),),
    ],
)
def test_inference_without_the_client_token_is_refused_unauthenticated(metadata: Any) -> None:
    answer, reached = intercept(Details(INFER, metadata))
    assert reached == []
    assert answer.unary_unary is not None and answer.stream_stream is None
    context = AbortContext()
    asyncio.run(answer.unary_unary(object(), context))
    assert context.aborted == (
        grpc.StatusCode.UNAUTHENTICATED,
        "ModelInfer needs 'authorization: Bearer TOKEN' (the client token)",
    )


def test_a_streaming_inference_is_refused_by_a_streaming_handler() -> None:
    """A unary handler on a stream-stream method would fail the call with the wrong error."""
    answer, reached = intercept(Details("/inference.GRPCInferenceService/ModelStreamInfer", ()))
    assert reached == []
    assert answer.stream_stream is not None and answer.unary_unary is None
    context = AbortContext()
    asyncio.run(answer.stream_stream(iter(()), context))
    assert context.aborted == (
        grpc.StatusCode.UNAUTHENTICATED,
        "ModelStreamInfer needs 'authorization: Bearer TOKEN' (the client token)",
    )


def test_a_refusal_names_a_method_that_has_no_service_part() -> None:
    """With every method guarded (prefix ""), a bare method name is refused by that name."""
    answer, _ = intercept(Details("Ping", ()), prefix="")
    context = AbortContext()
    asyncio.run(answer.unary_unary(object(), context))
    assert context.aborted == (
        grpc.StatusCode.UNAUTHENTICATED,
        "Ping needs 'authorization: Bearer TOKEN' (the client token)",
    )


@pytest.mark.parametrize(
    "method",
    [
        "/inference.GRPCInferenceService/ServerLive",
        "/inference.GRPCInferenceService/ServerReady",
        "/grpc.health.v1.Health/Check",
        "/stratus.Fleet/Drain",  # not an inference call: its own checks apply
    ],
)
def test_probes_and_other_services_need_no_client_token(method: str) -> None:
    details = Details(method, ())
    answer, reached = intercept(details)
    assert answer is PASSED and reached == [details]


# --- exposure ---------------------------------------------------------------------------------


def test_the_exposure_refusal_says_what_is_missing_and_how_to_give_it() -> None:
    with refusal(
        ConfigError,
        "the router would listen on 0.0.0.0:8001 without TLS (--tls-cert, --tls-key) and client auth: "
        "anyone who reaches it could use it. Give those (see `stratus certs`), listen on 127.0.0.1, "
        "or accept the risk with --insecure",
    ):
        check_exposure(
            "the router",
            "0.0.0.0:8001",
            tls=False,
            callers_authenticated=False,
            insecure=False,
            needs="client auth",
        )


@dataclass(frozen=True)
class Tls:
    cert: Path | None = None
    mutual: bool = False


CERT = Path("server.pem")
CLIENT_AUTH = "client authentication (--tls-ca for mutual TLS, or --client-token-file)"


def test_clients_authenticate_by_mutual_tls_or_the_client_token() -> None:
    assert clients_authenticated(Tls(mutual=True), "") is True
    assert clients_authenticated(Tls(), CLIENT_TOKEN) is True
    assert clients_authenticated(Tls(), "") is False


def test_an_endpoint_off_loopback_needs_tls_and_client_authentication() -> None:
    with refusal(
        ConfigError,
        f"the gateway would listen on 0.0.0.0:8000 without TLS (--tls-cert, --tls-key) and {CLIENT_AUTH}: "
        "anyone who reaches it could use it. Give those (see `stratus certs`), listen on 127.0.0.1, "
        "or accept the risk with --insecure",
    ):
        check_endpoint("the gateway", "0.0.0.0:8000", Tls(), client_token="", insecure=False)
    with pytest.raises(ConfigError, match=f"without {re.escape(CLIENT_AUTH)}: anyone"):
        check_endpoint("the gateway", "0.0.0.0:8000", Tls(cert=CERT), client_token="", insecure=False)
    with pytest.raises(ConfigError, match=r"without TLS \(--tls-cert, --tls-key\): anyone"):
        check_endpoint("the gateway", "0.0.0.0:8000", Tls(mutual=True), client_token="", insecure=False)


def test_an_endpoint_says_whether_its_callers_are_authenticated() -> None:
    assert (
        check_endpoint("g", "0.0.0.0:8000", Tls(cert=CERT), client_token=CLIENT_TOKEN, insecure=False) is True
    )
    assert (
        check_endpoint("g", "0.0.0.0:8000", Tls(cert=CERT, mutual=True), client_token="", insecure=False)
        is True
    )
    assert check_endpoint("g", "127.0.0.1:8000", Tls(), client_token="", insecure=False) is False
    assert check_endpoint("g", "0.0.0.0:8000", Tls(), client_token="", insecure=True) is False


@pytest.mark.parametrize(
    ("listen", "tls", "authenticated", "exposed"),
    [
        ("0.0.0.0:8001", True, True, False),
        ("0.0.0.0:8001", True, False, True),
        ("0.0.0.0:8001", False, True, True),
        ("0.0.0.0:8001", False, False, True),
        ("127.0.0.1:8001", False, False, False),
        ("[::1]:8001", False, False, False),
        ("localhost:8001", False, False, False),
    ],
)
def test_exposed_insecurely_means_reachable_without_tls_and_authentication(
    listen: str, tls: bool, authenticated: bool, exposed: bool
) -> None:
    assert exposed_insecurely(listen, tls=tls, callers_authenticated=authenticated) is exposed


def test_off_loopback_a_secret_of_sixteen_characters_is_long_enough() -> None:
    check_secrets("router", "0.0.0.0:8001", {"--agent-token-file": "a" * 16}, insecure=False)
    with pytest.raises(ConfigError, match="shorter than 16"):
        check_secrets("router", "0.0.0.0:8001", {"--agent-token-file": "a" * 15}, insecure=False)


def test_the_short_secret_refusal_names_every_short_one() -> None:
    with refusal(
        ConfigError,
        "router would listen on 0.0.0.0:8001 with a secret shorter than 16 characters "
        "(--agent-token-file, --peer-token-file): anyone could guess it. Use longer ones, or accept "
        "the risk with --insecure",
    ):
        check_secrets(
            "router", "0.0.0.0:8001", {"--peer-token-file": "short", "--agent-token-file": "tiny", "--x": ""},
            insecure=False,
        )  # fmt: skip


def test_two_roles_cannot_share_one_secret() -> None:
    """Even two: whoever holds the secret holds both roles."""
    secret = "one-long-secret-000001"
    with refusal(
        ConfigError,
        "router would listen on 0.0.0.0:8001 with one secret for --agent-token-file, --operator-token-file: "
        "whoever holds it has every one of those roles. Give each role its own (STRATUS_TOKEN stands in "
        "for all that have none), or accept the risk with --insecure",
    ):
        check_secrets(
            "router", "0.0.0.0:8001", {"--operator-token-file": secret, "--agent-token-file": secret},
            insecure=False,
        )  # fmt: skip


@pytest.mark.parametrize("listen", ["[::1]:8001", "127.0.0.1:8001", "localhost:8001"])
def test_on_loopback_any_secret_will_do(listen: str) -> None:
    check_secrets("router", listen, {"--agent-token-file": "x", "--operator-token-file": "x"}, insecure=False)


def test_an_insecure_listener_off_loopback_warns_until_stopped(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        assert insecure_warning("gateway", "127.0.0.1:8000", tls=False, callers_authenticated=False) is None
        assert insecure_warning("gateway", "0.0.0.0:8000", tls=True, callers_authenticated=True) is None
        task = insecure_warning("gateway", "0.0.0.0:8000", tls=True, callers_authenticated=False)
        assert task is not None
        assert task.get_name() == "stratus-insecure-warning"
        await asyncio.sleep(0.01)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.WARNING, logger="stratus.auth"):
        asyncio.run(body())
    assert [r.getMessage() for r in caplog.records] == [
        "gateway on 0.0.0.0:8000 runs with --insecure: traffic may be plaintext and callers unauthenticated"
    ]


def test_the_insecure_warning_repeats_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        task = asyncio.create_task(warn_insecure_forever("agent", "0.0.0.0:9000", interval_s=0.001))
        await asyncio.sleep(0.1)
        assert not task.done()  # it runs until stopped
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.WARNING, logger="stratus.auth"):
        asyncio.run(body())
    assert len(caplog.records) >= 2
    assert all("agent on 0.0.0.0:9000 runs with --insecure" in r.getMessage() for r in caplog.records)


# --- --agent-pool -----------------------------------------------------------------------------


def test_an_agent_pool_is_a_name_and_a_size() -> None:
    assert parse_agent_pool("edge-pool=40") == ("edge-pool", 40)
    assert parse_agent_pool(" edge-pool =1") == ("edge-pool", 1)
    assert parse_agent_pool("edge-pool=100000") == ("edge-pool", 100_000)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("edge-pool", "expected NAME=MAX, NAME an agent certificate's name"),
        ("bad/name=3", "expected NAME=MAX, NAME an agent certificate's name"),
        ("=3", "expected NAME=MAX, NAME an agent certificate's name"),
        ("edge-pool=many", "MAX must be a whole number"),
        ("edge-pool=3=4", "MAX must be a whole number"),  # the name ends at the first '='
        ("edge-pool=0", "MAX must be from 1 to 100000"),
        ("edge-pool=100001", "MAX must be from 1 to 100000"),
    ],
)
def test_a_malformed_agent_pool_is_refused_saying_why(text: str, problem: str) -> None:
    with refusal(ValueError, f"--agent-pool {text!r}: {problem}"):
        parse_agent_pool(text)
