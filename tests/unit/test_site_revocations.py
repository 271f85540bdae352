"""Site-wide revocations (`stratus fleet revoke`, issue 35 §2): the three forms of a credential,
matching a caller's certificate or agent id, and the store's records as a router reads them."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from router.fleet.registry import FleetRegistry
from router.rollout.plans import Rollouts
from router.site import Entry
from router.site.file import FileSiteState
from router.site.keys import revoked_key
from router.site.mirror import SiteMirror
from router.thresholds.pushes import ThresholdPushes
from stratus.errors import InvalidInput, PermissionDenied
from stratus.serving.auth import RouterCredentials
from stratus.serving.revocations import AnyRevoked, Revoked, SiteRevocations, credential_key, parse_credential


def certificate_pem(serial: int) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "t")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(serial).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return cert.public_bytes(serialization.Encoding.PEM)


def caller(spiffe: str = "", pem: bytes = b"") -> dict[str, list[bytes]]:
    return {"peer_spiffe_id": [spiffe.encode()] if spiffe else [], "x509_pem_cert": [pem] if pem else []}


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("spiffe://stratus/agent/device-1", "spiffe://stratus/agent/device-1"),
        ("serial:1A:2B", "serial:1a2b"),
        (" serial:00ff ", "serial:ff"),
        ("agent:device-1", "agent:device-1"),
    ],
)
def test_a_credential_is_kept_one_way(given: str, kept: str) -> None:
    assert parse_credential(given) == kept
    assert credential_key(kept) == credential_key(parse_credential(kept))  # the same key however written


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("device-1", "is no credential: give a SPIFFE id"),
        ("serial:xyz", "a serial is hexadecimal"),
        ("agent:", "an agent id is letters"),
        ("agent:a/b", "an agent id is letters"),
        ("spiffe://stratus/" + "x" * 600, "at most 512 characters"),
    ],
)
def test_a_malformed_credential_is_refused_saying_the_forms(given: str, says: str) -> None:
    with pytest.raises(InvalidInput, match=says):
        parse_credential(given)


def test_the_sites_revocations_match_an_identity_a_serial_and_an_agent_id() -> None:
    site = SiteRevocations()
    revoked_pem, other_pem = certificate_pem(0x1A2B), certificate_pem(0x1A2C)
    for credential in ("spiffe://stratus/operator/ops", "serial:1a2b", "agent:device-1"):
        site.put(revoked_key(credential), Revoked(credential=credential))
    assert site.why_revoked(caller("spiffe://stratus/operator/ops")) == (
        "certificate spiffe://stratus/operator/ops is revoked (site-wide)"
    )
    assert site.why_revoked(caller("spiffe://stratus/agent/d2", revoked_pem)) == (
        "certificate serial 1a2b is revoked (site-wide)"
    )
    assert site.why_revoked(caller("spiffe://stratus/agent/d2", other_pem)) is None
    assert site.agent_revoked("device-1") == "agent 'device-1' is revoked (site-wide)"
    assert site.agent_revoked("device-2") is None
    site.remove(revoked_key("agent:device-1"))
    assert site.agent_revoked("device-1") is None
    assert [r.credential for r in site.listed()] == ["serial:1a2b", "spiffe://stratus/operator/ops"]


def test_any_list_that_revokes_the_caller_refuses_it() -> None:
    first, second = SiteRevocations(), SiteRevocations()
    second.put("k", Revoked(credential="spiffe://stratus/client/c"))
    both = AnyRevoked([first, second])
    assert both.why_revoked(caller("spiffe://stratus/client/c")) == "certificate spiffe://stratus/client/c is revoked (site-wide)"
    assert both.why_revoked(caller("spiffe://stratus/client/d")) is None


@pytest.mark.parametrize("mutual_tls", [False, True])
def test_a_revoked_agent_id_is_refused_whatever_it_proves_itself_with(mutual_tls: bool) -> None:
    site = SiteRevocations()
    site.put(revoked_key("agent:device-1"), Revoked(credential="agent:device-1"))
    credentials = RouterCredentials(mutual_tls=mutual_tls, agent_token="agent-token-0000000001",
                                    revoked_agent=site.agent_revoked)  # fmt: skip
    with pytest.raises(PermissionDenied, match="agent 'device-1' is revoked"):
        credentials.agent_identity("device-1", "agent-token-0000000001", None)
    if not mutual_tls:
        assert credentials.agent_identity("device-2", "agent-token-0000000001", None) == "fleet-token"


def mirror(tmp_path: Path) -> SiteMirror:
    return SiteMirror(
        FileSiteState(tmp_path / "site.json"),
        rollouts=Rollouts(router_id="a"),
        pushes=ThresholdPushes(router_id="a"),
        registry=FleetRegistry(),
        router_id="a",
    )


def test_the_store_brings_revocations_and_takes_them_away(tmp_path: Path) -> None:
    site = mirror(tmp_path)
    key = revoked_key("agent:device-1")
    record = {"credential": "agent:device-1", "by": "ana", "at": 5.0, "reason": "stolen"}
    site.apply(Entry(key=key, value=json.dumps(record).encode(), revision=1, at=0.0))
    assert site.revocations.agent_revoked("device-1")
    assert site.revocations.listed() == [Revoked(credential="agent:device-1", by="ana", at=5.0, reason="stolen")]
    site.apply(Entry(key=key, value=b"", revision=2, at=0.0, deleted=True))
    assert site.revocations.agent_revoked("device-1") is None


def test_a_record_revoking_another_credential_than_its_key_names_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record under agent:device-1's key that revokes the operator would survive a lift of
    device-1 (which deletes the key of what it names): never applied."""
    site = mirror(tmp_path)
    forged = {"credential": "spiffe://stratus/operator/ops"}
    site.apply(Entry(key=revoked_key("agent:device-1"), value=json.dumps(forged).encode(), revision=1, at=0.0))
    assert site.revocations.listed() == []
    assert "not the credential its key names" in caplog.text
