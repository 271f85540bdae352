"""A fleet CA and one certificate per identity, for mutual TLS (what ``stratus certs`` writes).

Every leaf names its holder twice: a SPIFFE id ``spiffe://stratus/<role>/<name>`` (the one URI
SAN, which gRPC hands a server as ``peer_spiffe_id``) and subject CN=<name>, OU=<role>. The
router decides who a peer is from the SPIFFE id alone (``stratus.serving.auth.spiffe_identity``); the subject is for
people reading the certificate. Certificates of processes that serve (router, cloud, agents with
``--serve``) also carry the host names their clients dial, plus ``localhost`` and ``127.0.0.1``.

The CA is made once and reused, so a new agent is one more run (``--agent device-9``); a leaf
that exists is never overwritten without ``--force``. Keys are written 0600 in a 0700 folder.
The CA's key, which signs new identities, is kept apart from the leaves the fleet's machines
are given: ``DIR/private/ca.key`` by default (a folder ``kubectl create secret --from-file=DIR``,
``scp DIR/*`` and Compose mounts of ``DIR/*`` leave out), or wherever ``--ca-key`` says. A folder
from before (``DIR/ca.key`` beside the leaves) still works, and each run says how to move it.
``cryptography`` is imported only when certificates are written: the parser costs nothing to import.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from stratus.durable import write_atomically
from stratus.errors import ConfigError
from stratus.serving.auth import NAME_PATTERN, role_server_name
from stratus.serving.auth import ROLES as AUTH_ROLES

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey
    from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey

    CaKey = EllipticCurvePrivateKey | RSAPrivateKey

ROLES: Final = tuple(sorted(AUTH_ROLES))
# Roles whose processes other machines dial, and so carry the names given with --host. An
# agent's --serve endpoint is dialled on its own machine only (localhost); every leaf of a role
# that serves also carries its role's name (role_server_name), which clients with the fleet CA
# check, so an agent's leaf cannot pose as a router or the cloud (security2 N2).
SERVER_ROLES: Final = frozenset({"router", "cloud"})
LOCAL_SERVER_ROLES: Final = frozenset({"agent"})
NAME: Final = NAME_PATTERN
TRUST_DOMAIN: Final = "stratus"
# A SPIFFE trust domain: lowercase letters, digits, dots, dashes and underscores.
_TRUST_DOMAIN: Final = re.compile(r"[a-z0-9._-]{1,255}")
_DNS_LABEL: Final = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
ALWAYS_HOSTS: Final = ("localhost", "127.0.0.1")
PRIVATE: Final = "private"  # the subfolder of --out holding the CA's key, unless --ca-key says
CA_DAYS: Final = 3650
DEFAULT_DAYS: Final = 825
# Not-before a little in the past: a peer whose clock is a few minutes behind still accepts.
_SKEW: Final = dt.timedelta(minutes=5)
DEFAULTS: Final = {
    "router": ("router",),
    "cloud": ("cloud",),
    "operator": ("operator",),
    "client": ("client",),
    "agent": ("device-1", "device-2", "edge-1"),
}


@dataclass(frozen=True)
class Identity:
    """One holder of a certificate: what it is (role) and who (name)."""

    role: str
    name: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown role {self.role!r}: one of {', '.join(ROLES)}")
        check_name(self.name)

    @property
    def spiffe_id(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/{self.role}/{self.name}"

    @property
    def stem(self) -> str:
        """The files' name without extension: ``agent-device-1``."""
        return f"{self.role}-{self.name}"


@dataclass(frozen=True)
class Written:
    """One leaf written: whose, and where."""

    identity: Identity
    cert: Path
    key: Path


@dataclass(frozen=True)
class Report:
    """What one run did: the CA (made now or reused) and the leaves it wrote."""

    ca_cert: Path
    ca_key: Path
    ca_created: bool
    leaves: tuple[Written, ...]
    hosts: tuple[str, ...]
    missing: tuple[str, ...] = ()  # roles with no certificate in the folder after this run


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ConfigError(
            f"{name!r} is not a valid name: 1-128 characters of letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return name


def check_host(host: str) -> str:
    """A DNS name (``*.`` allowed first) or an IP address, as a SAN takes it."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host))
    labels = host.removeprefix("*.").split(".")
    if len(host) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(f"{host!r} is neither a DNS name nor an IP address")
    return host.lower()


# -- writing ----------------------------------------------------------------------------------


def issue(
    out: Path,
    identities: Sequence[Identity],
    *,
    hosts: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
    force: bool = False,
    now: dt.datetime | None = None,
    ca_key: Path | None = None,
) -> Report:
    """Write a leaf for each identity into ``out``, signed by ``out/ca.pem`` (made first if
    absent) and the CA's key (``ca_key``, else :func:`ca_key_path`'s). Checks everything
    (names, hosts, days, existing files) before writing anything."""
    wanted = tuple(dict.fromkeys(identities))
    names = _server_names(hosts)
    if days < 1:
        raise ConfigError(f"--days {days}: a certificate must be valid for at least one day")
    if not force:
        _refuse_existing(out, wanted)
    start = (now or dt.datetime.now(dt.UTC)) - _SKEW
    key_path = ca_key or ca_key_path(out)
    _make_folder(out)
    ca_cert, signer, created = _load_or_make_ca(out / "ca.pem", key_path, start)
    until = start + dt.timedelta(days=days)
    if until > ca_cert.not_valid_after_utc:
        raise ConfigError(
            f"--days {days} outlives the CA in {out / 'ca.pem'} (until {ca_cert.not_valid_after_utc:%Y-%m-%d})"
        )
    leaves = tuple(
        _write_leaf(out, who, ca=(ca_cert, signer), hosts=names, start=start, until=until) for who in wanted
    )
    missing = tuple(role for role in ROLES if not any(out.glob(f"{role}-*.pem")))
    return Report(
        ca_cert=out / "ca.pem",
        ca_key=key_path,
        ca_created=created,
        leaves=leaves,
        hosts=names,
        missing=missing,
    )


def ca_key_path(out: Path) -> Path:
    """Where the CA's key is without --ca-key: ``out/private/ca.key``, or ``out/ca.key`` where a
    folder from before keeps it there (and only there)."""
    private, beside = out / PRIVATE / "ca.key", out / "ca.key"
    if beside.exists() and private.exists():
        raise ConfigError(
            f"{out} holds two CA keys, {beside} and {private}: keep one, or name it with --ca-key"
        )
    return beside if beside.exists() else private


def _server_names(hosts: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*ALWAYS_HOSTS, *(check_host(h) for h in hosts)]))


def _refuse_existing(out: Path, identities: Sequence[Identity]) -> None:
    taken = [
        path.name
        for who in identities
        for path in (out / f"{who.stem}.pem", out / f"{who.stem}.key")
        if path.exists()
    ]
    if taken:
        raise ConfigError(f"{out} already holds {', '.join(taken)}: pass --force to replace them")


def _make_folder(out: Path) -> None:
    if not out.exists():
        out.mkdir(parents=True, mode=0o700)
        out.chmod(0o700)  # mkdir's mode is masked by the umask
    elif not out.is_dir():
        raise ConfigError(f"{out} is not a folder")


def _load_or_make_ca(
    cert_path: Path, key_path: Path, start: dt.datetime
) -> tuple[x509.Certificate, CaKey, bool]:
    if cert_path.exists() and key_path.exists():
        cert, key = _load_ca(cert_path, key_path)
        return cert, key, False
    if cert_path.exists() or key_path.exists():
        present, missing = (cert_path, key_path) if cert_path.exists() else (key_path, cert_path)
        raise ConfigError(
            f"{present} exists without {missing}: restore it (or say where it is with --ca-key), or move "
            "both away for a new CA"
        )
    key, cert = _make_ca(start)
    _make_folder(key_path.parent)
    write_atomically(key_path, _key_pem(key), mode=0o600)
    write_atomically(cert_path, _cert_pem(cert), mode=0o644)
    return cert, key, True


def _load_ca(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, CaKey]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read the CA in {cert_path.parent}: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ConfigError(f"{key_path}: only an ECDSA or RSA CA key can sign here")
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(der, spki) != cert.public_key().public_bytes(der, spki):
        raise ConfigError(f"{key_path} is not the key of {cert_path}")
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    if not constraints.ca:
        raise ConfigError(f"{cert_path} is not a CA certificate")
    if key_path.stat().st_mode & 0o077:
        print(f"stratus certs: warning: {key_path} is readable by others; chmod 600 it", file=sys.stderr)
    return cert, key


def _make_ca(start: dt.datetime) -> tuple[EllipticCurvePrivateKey, x509.Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Stratus"),
            x509.NameAttribute(NameOID.COMMON_NAME, "Stratus fleet CA"),
        ]
    )
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _write_leaf(
    out: Path,
    who: Identity,
    *,
    ca: tuple[x509.Certificate, CaKey],
    hosts: Sequence[str],
    start: dt.datetime,
    until: dt.datetime,
) -> Written:
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = _leaf(who, key, ca=ca, hosts=names_for(who.role, hosts), start=start, until=until)
    written = Written(identity=who, cert=out / f"{who.stem}.pem", key=out / f"{who.stem}.key")
    write_atomically(written.key, _key_pem(key), mode=0o600)
    write_atomically(written.cert, _cert_pem(cert), mode=0o644)
    return written


def names_for(role: str, hosts: Sequence[str]) -> tuple[str, ...]:
    """The server names a leaf of ``role`` carries: its role's name, then the --host names (and
    loopback) for a router or the cloud, loopback alone for an agent, nothing for the rest."""
    if role in SERVER_ROLES:
        return (role_server_name(role, TRUST_DOMAIN), *hosts)
    if role in LOCAL_SERVER_ROLES:
        return (role_server_name(role, TRUST_DOMAIN), *ALWAYS_HOSTS)
    return ()


def _leaf(
    who: Identity,
    key: EllipticCurvePrivateKey,
    *,
    ca: tuple[x509.Certificate, CaKey],
    hosts: Sequence[str],
    start: dt.datetime,
    until: dt.datetime,
) -> x509.Certificate:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert, ca_key = ca
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, who.role),
            x509.NameAttribute(NameOID.COMMON_NAME, who.name),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(_san(who, hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )


def _san(who: Identity, hosts: Sequence[str]) -> list[x509.GeneralName]:
    from cryptography import x509

    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(who.spiffe_id)]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _key_pem(key: CaKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)
