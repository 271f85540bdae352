"""Who may do what (stratus.serving.auth): the pure rules, with the gRPC context reduced to what they read."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from router.settings import RouterSettings
from stratus.errors import ConfigError, Overloaded, PermissionDenied, Unauthenticated
from stratus.serving.auth import CertIdentity, RouterCredentials, is_loopback_peer, spiffe_identity
from stratus.serving.channels import TlsSettings
from stratus.serving.client_limits import ClientLimits, client_of
from stratus.serving.credential_files import AgentTokens, RevokedCertificates
from stratus.serving.exposure import check_exposure

AGENT_TOKEN = "a-long-agent-token-0001"


@dataclass
class Context:
    """What the rules read of a grpc.aio servicer context: the peer and its certificate."""

    peer_address: str = "ipv4:127.0.0.1:5000"
    spiffe: str | None = None
    auth: dict[str, list[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.spiffe is not None:
            self.auth = {"peer_spiffe_id": [self.spiffe.encode()], "x509_pem_cert": [b"PEM"]}

    def peer(self) -> str:
        return self.peer_address

    def auth_context(self) -> dict[str, list[bytes]]:
        return self.auth


REMOTE = Context("ipv4:10.1.2.3:5000")


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.8.9.10:1", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("unix:/run/stratus.sock", True),
        ("ipv4:10.0.0.7:5000", False),
        ("ipv4:128.0.0.1:5000", False),
        ("ipv6:[fd00::2]:5000", False),
        ("", False),
    ],
)
def test_loopback_peers(peer: str, local: bool) -> None:
    assert is_loopback_peer(peer) is local


def test_spiffe_ids_name_a_role_and_a_name_in_any_trust_domain() -> None:
    assert spiffe_identity({"peer_spiffe_id": [b"spiffe://stratus/agent/device-1"]}) == CertIdentity(
        "agent", "device-1"
    )
    assert spiffe_identity({"peer_spiffe_id": [b"spiffe://example.org/operator/alice"]}) == (
        CertIdentity("operator", "alice")
    )
    for unknown in (
        b"spiffe://stratus/admin/root",
        b"spiffe://stratus/agent/bad\nname",
        b"https://x/agent/a",
    ):
        assert spiffe_identity({"peer_spiffe_id": [unknown]}) is None, unknown
    assert spiffe_identity({}) is None


def test_per_agent_tokens_bind_each_id_and_revocation_needs_no_restart(tmp_path: Path) -> None:
    path = tmp_path / "agents.tokens"
    path.write_text(f"# id token\ndevice-1 {AGENT_TOKEN}\ndevice-2 another-long-token-0002\n")
    credentials = RouterCredentials(agent_tokens=AgentTokens(path))
    assert credentials.agent_identity("device-1", AGENT_TOKEN, Context()) == "token:device-1"
    with pytest.raises(Unauthenticated, match="token of agent 'device-1'"):
        credentials.agent_identity("device-1", "another-long-token-0002", Context())  # device-2's token
    # an id not listed gets the same answer as a wrong token: the refusal says nothing of the list
    with pytest.raises(Unauthenticated, match="token of agent 'device-9' is missing, wrong or revoked"):
        credentials.agent_identity("device-9", AGENT_TOKEN, Context())
    path.write_text("device-2 another-long-token-0002\n")  # device-1 revoked
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(Unauthenticated):
        credentials.agent_identity("device-1", AGENT_TOKEN, Context())


def _touch(path: Path, seconds: int) -> None:
    os.utime(path, ns=(time.time_ns(), time.time_ns() + seconds * 10**9))


def test_a_broken_or_deleted_tokens_file_admits_no_one_until_fixed(tmp_path: Path) -> None:
    """security2 N4: a file that stopped parsing kept the last good table, so a revocation
    written beside one bad line was silently not applied. It fails closed now."""
    path = tmp_path / "agents.tokens"
    path.write_text(f"device-1 {AGENT_TOKEN}\n")
    credentials = RouterCredentials(agent_tokens=AgentTokens(path))
    assert credentials.agent_identity("device-1", AGENT_TOKEN, Context()) == "token:device-1"
    path.write_text(f"device-1 {AGENT_TOKEN}\nkiosk-7 short\n")
    _touch(path, 1)
    with pytest.raises(Unauthenticated):
        credentials.agent_identity("device-1", AGENT_TOKEN, Context())
    path.write_text(f"device-1 {AGENT_TOKEN}\n")
    _touch(path, 2)
    assert credentials.agent_identity("device-1", AGENT_TOKEN, Context()) == "token:device-1"
    path.unlink()
    with pytest.raises(Unauthenticated):
        credentials.agent_identity("device-1", AGENT_TOKEN, Context())


def test_a_hash_inside_a_token_is_part_of_it(tmp_path: Path) -> None:
    path = tmp_path / "agents.tokens"
    path.write_text("device-2 token#with-a-hash-0002  # a comment\n")
    credentials = RouterCredentials(agent_tokens=AgentTokens(path))
    assert credentials.agent_identity("device-2", "token#with-a-hash-0002", Context()) == "token:device-2"


def test_no_shared_token_lets_an_id_in_beside_per_agent_tokens(tmp_path: Path) -> None:
    path = tmp_path / "agents.tokens"
    path.write_text(f"device-1 {AGENT_TOKEN}\n")
    credentials = RouterSettings(agent_tokens_file=path, token="fleet-token-shared-0001").credentials()
    assert credentials.agent_token == ""
    with pytest.raises(Unauthenticated, match="rogue-9"):
        credentials.agent_identity("rogue-9", "fleet-token-shared-0001", Context())
    with pytest.raises(ConfigError, match="give one of them"):
        RouterSettings(agent_tokens_file=path, agent_token="fleet-token-shared-0001")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("device-1\n", "expected 'AGENT_ID TOKEN'"),
        ("device-1 short\n", "shorter than 16"),
        (f"device-1 {AGENT_TOKEN}\ndevice-1 {AGENT_TOKEN}\n", "listed twice"),
        (f"bad/id {AGENT_TOKEN}\n", "expected 'AGENT_ID TOKEN'"),
    ],
)
def test_a_malformed_tokens_file_stops_the_router(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "agents.tokens"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem):
        AgentTokens(path)


def test_certificates_bind_agent_ids_and_pools() -> None:
    credentials = RouterCredentials(mutual_tls=True)
    agent = Context(spiffe="spiffe://stratus/agent/device-1")
    assert credentials.agent_identity("device-1", "", agent) == "cert:device-1"
    with pytest.raises(PermissionDenied, match="does not match its certificate"):
        credentials.agent_identity("device-2", "", agent)
    with pytest.raises(PermissionDenied, match="does not match"):
        credentials.agent_identity("device-10", "", agent)  # a prefix is not a pool member
    pool = Context(spiffe="spiffe://stratus/agent/edge-pool")
    with pytest.raises(PermissionDenied, match=r"it may be only 'edge-pool'; a pool's certificate is named"):
        credentials.agent_identity("edge-pool.node-a", "", pool)  # not a pool unless the operator says so
    pools = RouterCredentials(mutual_tls=True, agent_pools={"edge-pool": 2})
    assert pools.agent_identity("edge-pool.node-a", "", pool) == "pool:edge-pool"
    assert pools.agent_identity("edge-pool", "", pool) == "cert:edge-pool"
    with pytest.raises(PermissionDenied, match="does not match"):
        pools.agent_identity("edge-pool.", "", pool)  # a member has a suffix
    with pytest.raises(PermissionDenied, match="cannot join as an agent"):
        credentials.agent_identity("alice", "", Context(spiffe="spiffe://stratus/operator/alice"))
    with pytest.raises(PermissionDenied, match="Stratus identity"):
        credentials.agent_identity("device-1", "", Context())


def test_operator_calls_need_the_operator_role() -> None:
    open_router = RouterCredentials()
    open_router.require_operator("", Context(), "Drain")  # loopback, nothing configured
    with pytest.raises(PermissionDenied, match="only callers on its own machine"):
        open_router.require_operator("", REMOTE, "Drain")
    tokens = RouterCredentials(operator_token="operator-secret", agent_token="agent-secret")
    tokens.require_operator("operator-secret", REMOTE, "Drain")
    for wrong in ("agent-secret", ""):
        with pytest.raises(Unauthenticated, match="Drain needs the operator token"):
            tokens.require_operator(wrong, Context(), "Drain")
    mtls = RouterCredentials(mutual_tls=True)
    mtls.require_operator("", Context(spiffe="spiffe://stratus/operator/alice"), "Drain")
    with pytest.raises(PermissionDenied, match="needs the operator role; this certificate is a agent"):
        mtls.require_operator("", Context(spiffe="spiffe://stratus/agent/device-1"), "Drain")


def test_a_certificate_of_another_trust_domain_is_no_one() -> None:
    """security2 N13: an operator certificate of another trust domain is no operator here."""
    with pytest.raises(PermissionDenied, match="operator role; this certificate has no Stratus identity"):
        RouterCredentials(mutual_tls=True).require_operator("", Context(spiffe="spiffe://other/operator/o"), "Drain")
    RouterCredentials(mutual_tls=True, trust_domain="other").require_operator(
        "", Context(spiffe="spiffe://other/operator/o"), "Drain"
    )


@pytest.mark.parametrize("listen", ["0.0.0.0:8001", "[::]:8001", "192.0.2.2:8001"])
def test_reachable_listeners_need_tls_and_authentication(listen: str) -> None:
    with pytest.raises(ConfigError, match=r"without TLS .* and client auth.*--insecure"):
        check_exposure(
            "x", listen, tls=False, callers_authenticated=False, insecure=False, needs="client auth"
        )
    with pytest.raises(ConfigError, match="without client auth"):
        check_exposure(
            "x", listen, tls=True, callers_authenticated=False, insecure=False, needs="client auth"
        )
    check_exposure("x", listen, tls=True, callers_authenticated=True, insecure=False, needs="client auth")
    check_exposure("x", listen, tls=False, callers_authenticated=False, insecure=True, needs="client auth")


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:8001", "[::1]:8001"])
def test_loopback_listeners_need_nothing(listen: str) -> None:
    check_exposure("x", listen, tls=False, callers_authenticated=False, insecure=False, needs="auth")


def test_one_client_cannot_hold_more_than_its_share() -> None:
    limits = ClientLimits(per_client=2)
    assert client_of("ipv4:10.0.0.7:5000") == client_of("ipv4:10.0.0.7:6000") == "ipv4:10.0.0.7"
    with limits.hold("ipv4:10.0.0.7:1"), limits.hold("ipv4:10.0.0.7:2"):
        with pytest.raises(Overloaded, match="2 requests in flight"), limits.hold("ipv4:10.0.0.7:3"):
            pass
        with limits.hold("ipv4:10.0.0.8:1"):  # another client is not held back
            assert limits.held == {"ipv4:10.0.0.7": 2, "ipv4:10.0.0.8": 1}
    assert limits.held == {}  # every slot given back


def test_one_client_cannot_hold_more_items_than_its_share_but_one_request_always_fits() -> None:
    """security F21: one client's 1,000 requests of 256 items each held every queue."""
    limits = ClientLimits(per_client=100, items_per_client=1000)
    with limits.hold("ipv6:[::1]:1", 600), limits.hold("ipv6:[::1]:2", 400):
        with pytest.raises(Overloaded, match="has 1000 items in requests in flight"), limits.hold("ipv6:[::1]:3", 1):
            pass
        with limits.hold("ipv4:127.0.0.1:1", 1000):  # another client is not held back
            assert limits.items == {"ipv6:[::1]": 1000, "ipv4:127.0.0.1": 1000}
    # alone, a request over the share is taken; then nothing more is
    with limits.hold("ipv6:[::1]:4", 5000), pytest.raises(Overloaded, match="has 5000 items"), limits.hold("ipv6:[::1]:5", 1):
        pass
    with limits.hold("ipv6:[::1]:6", 999), limits.hold("ipv6:[::1]:7", -(10**6)):  # counted as one item
        assert limits.items == {"ipv6:[::1]": 1000}
    assert limits.items == {} and limits.held == {}
    unlimited = ClientLimits(per_client=0, items_per_client=0)
    with unlimited.hold("ipv4:10.0.0.7:1", 10**6), unlimited.hold("ipv4:10.0.0.7:2", 10**6):
        assert unlimited.items == {"ipv4:10.0.0.7": 2 * 10**6}


def _reachable_router(tmp_path: Path, **secrets: str) -> RouterSettings:
    cert, key = tmp_path / "router.pem", tmp_path / "router.key"
    cert.write_text("PEM")
    key.write_text("PEM")
    settings: dict[str, object] = {"anonymous_inference": True, **secrets}
    return RouterSettings(listen="0.0.0.0:8001", tls=TlsSettings(cert=cert, key=key), **settings)  # type: ignore[arg-type]


def test_off_loopback_inference_needs_client_authentication_or_saying_anonymous(tmp_path: Path) -> None:
    """security2 N9: a token-mode router off loopback relayed strangers to the cloud on its own
    cloud token (1,024 items answered by digits-large)."""
    roles = {"agent_token": "agent-token-0000000001", "operator_token": "operator-token-00000001"}
    open_router = _reachable_router(tmp_path, anonymous_inference=False, **roles)
    with pytest.raises(ConfigError, match=r"inference API would listen on 0\.0\.0\.0:8001 without client authentication"):
        open_router.check_exposure(open_router.credentials())
    guarded = _reachable_router(tmp_path, anonymous_inference=False, client_token="client-token-00000001", **roles)
    guarded.check_exposure(guarded.credentials())
    said = _reachable_router(tmp_path, anonymous_inference=True, **roles)
    said.check_exposure(said.credentials())


def test_the_rest_port_off_loopback_needs_tls_and_client_authentication(tmp_path: Path) -> None:
    """--http is the inference API over HTTP: exposed on the same terms as the gRPC port, even
    when that port itself stays on loopback."""
    cert, key = tmp_path / "router.pem", tmp_path / "router.key"
    cert.write_text("PEM")
    key.write_text("PEM")
    tls = TlsSettings(cert=cert, key=key)

    def checked(**settings: object) -> None:
        router = RouterSettings(listen="127.0.0.1:8001", http="0.0.0.0:8000", **settings)  # type: ignore[arg-type]
        router.check_exposure(router.credentials())

    with pytest.raises(ConfigError, match=r"REST API would listen on 0\.0\.0\.0:8000 without TLS"):
        checked(anonymous_inference=True)
    with pytest.raises(ConfigError, match=r"REST API would listen on 0\.0\.0\.0:8000 without client authentication"):
        checked(tls=tls)
    checked(tls=tls, client_token="client-token-00000001")
    checked(tls=tls, anonymous_inference=True)
    checked(insecure=True)
    loopback = RouterSettings(http="127.0.0.1:8000")  # a demo needs nothing
    loopback.check_exposure(loopback.credentials())


def test_off_loopback_one_secret_cannot_fill_several_roles_nor_be_short(tmp_path: Path) -> None:
    """security2 N5: STRATUS_TOKEN=x made every device that held it an operator."""
    shared = _reachable_router(tmp_path, token="x")
    with pytest.raises(ConfigError, match="shorter than 16 characters"):
        shared.check_exposure(shared.credentials())
    shared = _reachable_router(tmp_path, token="one-long-token-for-all-roles")
    with pytest.raises(ConfigError, match="one secret for the agent token, the operator token"):
        shared.check_exposure(shared.credentials())
    own = _reachable_router(
        tmp_path, agent_token="agent-token-0000000001", operator_token="operator-token-00000001",
    )  # fmt: skip
    own.check_exposure(own.credentials())
    loopback = RouterSettings(token="x")  # a demo on one machine needs nothing
    loopback.check_exposure(loopback.credentials())
    _reachable_router(tmp_path, token="x", insecure=True).check_exposure(RouterSettings(token="x").credentials())


def test_revoked_certificates_are_read_again_and_a_broken_file_trusts_no_one(tmp_path: Path) -> None:
    path = tmp_path / "revoked"
    path.write_text("spiffe://stratus/agent/device-1  # stolen\nserial:1A:2b\n")
    revoked = RevokedCertificates(path)
    device1 = Context(spiffe="spiffe://stratus/agent/device-1")
    device2 = Context(spiffe="spiffe://stratus/agent/device-2")
    assert revoked.why_revoked(device1.auth_context()) == "certificate spiffe://stratus/agent/device-1 is revoked"
    assert revoked.why_revoked(device2.auth_context()) is None
    credentials = RouterCredentials(mutual_tls=True, revoked=revoked)
    with pytest.raises(PermissionDenied, match="is revoked"):
        credentials.agent_identity("device-1", "", device1)
    assert credentials.agent_identity("device-2", "", device2) == "cert:device-2"
    path.write_text("not an id\n")
    _touch(path, 1)
    assert "no certificate is trusted until it is fixed" in (revoked.why_revoked(device2.auth_context()) or "")
    path.write_text("")
    _touch(path, 2)
    assert revoked.why_revoked(device1.auth_context()) is None
    with pytest.raises(ConfigError, match="expected a SPIFFE id"):
        (tmp_path / "bad").write_text("device-1\n")
        RevokedCertificates(tmp_path / "bad")


def test_the_cli_refuses_to_send_the_operator_token_in_plaintext_off_the_machine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """security2 N14: `stratus fleet` sent the operator token to any router, TLS or not."""
    import argparse

    from stratus.cli.options import operator_token

    monkeypatch.setenv("STRATUS_OPERATOR_TOKEN", "operator-token-00000001")

    def args(router: str, ca: Path | None = None) -> argparse.Namespace:
        return argparse.Namespace(router=router, operator_token_file=None, tls_cert=None, tls_key=None, tls_ca=ca)

    with pytest.raises(ConfigError, match=r"would go to router\.example:8001 in plaintext"):
        operator_token(args("router.example:8001"))
    with pytest.raises(ConfigError, match="in plaintext"):
        operator_token(args("dns:///router.example:8001"))
    assert operator_token(args("127.0.0.1:8001")) == "operator-token-00000001"
    assert operator_token(args("localhost:8001")) == "operator-token-00000001"
    ca = tmp_path / "ca.pem"
    ca.write_text("PEM")
    assert operator_token(args("router.example:8001", ca)) == "operator-token-00000001"
