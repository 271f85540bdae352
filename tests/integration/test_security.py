"""Who may join: the fleet token, TLS and mutual TLS on every link."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from stratus.launcher import Launched
from stratus.serving import NO_TLS, TlsSettings, open_sync_channel
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

from .cluster import Cluster, fleet_status, infer, ready_count, states, wait_until


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(
    folder: Path, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate
) -> tuple[Path, Path]:
    key_path, cert_path = folder / f"{stem}.key", folder / f"{stem}.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def make_ca(folder: Path, stem: str) -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(stem))
        .issuer_name(_name(stem))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _write(folder, stem, key, cert)[0], key, cert


def make_leaf(
    folder: Path, stem: str, ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate
) -> TlsSettings:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(stem))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = _write(folder, stem, key, cert)
    return TlsSettings(cert=cert_path, key=key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsSettings]:
    folder = tmp_path_factory.mktemp("pki")
    ca_path, ca_key, ca = make_ca(folder, "stratus-test-ca")
    _, rogue_key, rogue = make_ca(folder, "rogue-ca")
    with_ca = {name: make_leaf(folder, name, ca_key, ca) for name in ("router", "agent", "cloud", "client")}
    settings = {name: TlsSettings(cert=s.cert, key=s.key, ca=ca_path) for name, s in with_ca.items()}
    rogue_leaf = make_leaf(folder, "intruder", rogue_key, rogue)
    settings["intruder"] = TlsSettings(cert=rogue_leaf.cert, key=rogue_leaf.key, ca=ca_path)
    settings["no-cert"] = TlsSettings(ca=ca_path)
    return settings


def tls_args(settings: TlsSettings) -> list[str]:
    args = []
    for flag, path in (("--tls-cert", settings.cert), ("--tls-key", settings.key), ("--tls-ca", settings.ca)):
        if path is not None:
            args += [flag, str(path)]
    return args


def test_router_refuses_agents_without_the_token(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router("--token", "s3cret")
    cluster.agent("no-token", router.address)
    cluster.agent("bad-token", router.address, "--token", "guess")
    cluster.start(
        "env-token",
        [
            "agent",
            "--tier",
            "device",
            "--models",
            str(Path(__file__).parents[2] / "models"),
            "--router",
            router.address,
            "--name",
            "env-token",
        ],
        env={"STRATUS_TOKEN": "s3cret"},
    )
    wait_until(lambda: ready_count(router.address) == 1)
    assert set(states(router.address)) == {"env-token"}
    log = router.log()
    assert "refused agent 'no-token' from ipv4:127.0.0.1" in log and "refused agent 'bad-token'" in log
    assert infer(router.address, digits.held_out.x[:1])[1].agent == "env-token"  # inference needs no token
    with open_sync_channel(router.address) as channel:
        stub = fpb_grpc.FleetStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Drain(fpb.DrainRequest(agent_id="env-token"), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Drain(fpb.DrainRequest(agent_id="env-token", token="s3cret"), timeout=5).accepted


def test_mutual_tls_on_every_link(cluster: Cluster, pki: dict[str, TlsSettings], digits) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud(*tls_args(pki["cloud"]))
    router = cluster.router("--cloud", cloud.address, *tls_args(pki["router"])).address
    cluster.agent("dev-1", router, *tls_args(pki["agent"]))
    wait_until(
        lambda: (
            fleet_status(router, pki["client"]).cloud.state == "connected"
            and len(fleet_status(router, pki["client"]).agents) == 1
        )
    )
    _, served = infer(router, digits.held_out.x[:1], min_confidence=1.0, tls=pki["client"])
    assert served.path == (Tier.DEVICE, Tier.CLOUD)
    # Both servers refuse a client without a certificate, one from a rogue CA, and plaintext.
    for server in (router, cloud.address):
        for refused in ("no-cert", "intruder", "plaintext"):
            tls = pki.get(refused, NO_TLS)
            with pytest.raises(grpc.RpcError) as error:
                infer(server, digits.held_out.x[:1], tls=tls, timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE, (server, refused, error.value)
    rejected = [cluster.agent("intruder", router, *tls_args(pki["intruder"])), cluster.agent("plain", router)]

    def tried_and_failed(agent: Launched) -> bool:
        log = agent.log()
        return f"link to router {router} lost" in log and "reconnecting" in log

    for agent in rejected:  # each tried, more than once, and was refused
        wait_until(lambda agent=agent: tried_and_failed(agent), timeout_s=20)
        assert "linked to router" not in agent.log(), agent.role
    assert set(a.id for a in fleet_status(router, pki["client"]).agents) == {"dev-1"}
