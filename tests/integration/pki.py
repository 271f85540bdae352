"""A fleet's certificates for the tests: a CA, a leaf per role and name (each with the SPIFFE id
``spiffe://stratus/<role>/<name>`` that Stratus reads identities from), and a rogue CA's leaf."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from stratus.serving.auth import SERVER_ROLES, role_server_name
from stratus.serving.channels import TlsSettings


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
    folder: Path,
    stem: str,
    ca_key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    role: str = "client",
    *,
    ip: bool = True,
) -> TlsSettings:
    """A leaf named ``stem`` with the SPIFFE id of ``role``, valid for ``localhost`` (and for
    127.0.0.1 unless ``ip`` is false: a server that clients must reach by name)."""
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
                [
                    # the name clients with the fleet CA check a router, cloud or agent by
                    *([x509.DNSName(role_server_name(role))] if role in SERVER_ROLES else []),
                    x509.DNSName("localhost"),
                    *([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))] if ip else []),
                    x509.UniformResourceIdentifier(f"spiffe://stratus/{role}/{stem}"),
                ]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = _write(folder, stem, key, cert)
    return TlsSettings(cert=cert_path, key=key_path)


# Each leaf of the test fleet: its name and role (agents' names are their ids).
LEAVES = {
    "router": "router",
    "router-2": "router",
    "cloud": "cloud",
    "client": "client",
    "operator": "operator",
    "dev-1": "agent",
    "dev-2": "agent",
    "pool": "agent",
    "pool.a": "agent",
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsSettings]:
    """TLS settings per leaf name, each with the fleet CA; ``intruder`` is signed by a rogue CA
    and ``no-cert`` has the CA alone."""
    folder = tmp_path_factory.mktemp("pki")
    ca_path, ca_key, ca = make_ca(folder, "stratus-test-ca")
    _, rogue_key, rogue = make_ca(folder, "rogue-ca")
    settings = {}
    for name, role in LEAVES.items():
        leaf = make_leaf(folder, name, ca_key, ca, role)
        settings[name] = TlsSettings(cert=leaf.cert, key=leaf.key, ca=ca_path)
    by_name = make_leaf(folder, "router-by-name", ca_key, ca, "router", ip=False)
    settings["router-by-name"] = TlsSettings(cert=by_name.cert, key=by_name.key, ca=ca_path)
    rogue_leaf = make_leaf(folder, "intruder", rogue_key, rogue, "router")
    settings["intruder"] = TlsSettings(cert=rogue_leaf.cert, key=rogue_leaf.key, ca=ca_path)
    settings["no-cert"] = TlsSettings(ca=ca_path)
    return settings


def tls_args(settings: TlsSettings) -> list[str]:
    args = []
    for flag, path in (("--tls-cert", settings.cert), ("--tls-key", settings.key), ("--tls-ca", settings.ca)):
        if path is not None:
            args += [flag, str(path)]
    return args
