"""Revoked credentials, wherever they are listed: a router's own file (``--revoked-certificates``,
:class:`~stratus.serving.credential_files.RevokedCertificates`) or the site's store, where an
operator's ``stratus fleet revoke`` reaches every router of the site at once.

A revoked credential is written one of three ways:

* ``spiffe://DOMAIN/ROLE/NAME``: every certificate of that identity;
* ``serial:HEX``: one certificate;
* ``agent:ID``: the agent id, whatever it proves itself with (a certificate, a per-agent token,
  the fleet token), so a device taken with its token in it is shut out too.

A caller is matched against every list (:class:`AnyRevoked`): the first reason found refuses it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from stratus.errors import InvalidInput
from stratus.serving.auth import NAME_PATTERN, Revocations, spiffe_identity

AGENT_PREFIX: Final = "agent:"
SERIAL_PREFIX: Final = "serial:"
MAX_CREDENTIAL: Final = 512
# Certificates' serials parsed and kept (one per distinct certificate seen): past it, parsed again.
MAX_SERIALS_CACHED: Final = 4096


def parse_credential(text: str) -> str:
    """A revocation's credential, checked and written one way (a serial in lower-case hex
    without colons), or InvalidInput saying the three forms."""
    text = text.strip()
    if len(text) > MAX_CREDENTIAL:
        raise InvalidInput(f"a revoked credential is at most {MAX_CREDENTIAL} characters")
    if text.startswith(SERIAL_PREFIX):
        try:
            return f"{SERIAL_PREFIX}{int(text.removeprefix(SERIAL_PREFIX).replace(':', ''), 16):x}"
        except ValueError:
            raise InvalidInput(f"{text!r}: a serial is hexadecimal ('serial:1A2B...')") from None
    if text.startswith(AGENT_PREFIX):
        agent = text.removeprefix(AGENT_PREFIX)
        if not NAME_PATTERN.fullmatch(agent):
            raise InvalidInput(f"{text!r}: an agent id is letters, digits, '.', '_' and '-' (at most 128)")
        return text
    if spiffe_identity({"peer_spiffe_id": [text.encode()]}) is not None:
        return text
    raise InvalidInput(
        f"{text[:80]!r} is no credential: give a SPIFFE id (spiffe://DOMAIN/ROLE/NAME), "
        "'serial:HEX' (one certificate) or 'agent:ID' (an agent, whatever it proves itself with)"
    )


def credential_key(credential: str) -> str:
    """The credential as one word of a store key (it holds ':' and '/', which keys cannot)."""
    return hashlib.sha256(credential.encode()).hexdigest()[:32]


class CertificateSerials:
    """Each peer certificate's serial, parsed once per certificate; -1 for what does not parse
    (the TLS stack hands over the PEM it verified, so that is never a real peer's)."""

    def __init__(self) -> None:
        self._serial_of: dict[bytes, int] = {}

    def of(self, auth_context: Mapping[str, Sequence[bytes]]) -> list[int]:
        return [self._serial(pem) for pem in auth_context.get("x509_pem_cert") or ()]

    def _serial(self, pem: bytes) -> int:
        if pem not in self._serial_of:
            from cryptography import x509

            if len(self._serial_of) > MAX_SERIALS_CACHED:
                self._serial_of.clear()
            try:
                self._serial_of[pem] = x509.load_pem_x509_certificate(pem).serial_number
            except ValueError:
                self._serial_of[pem] = -1
        return self._serial_of[pem]


def certificate_revoked(
    ids: frozenset[str] | set[str],
    serials: frozenset[int] | set[int],
    auth_context: Mapping[str, Sequence[bytes]],
    parsed: CertificateSerials,
) -> str | None:
    """Why the caller's certificate is revoked by these lists, or None."""
    shown = {v.decode("ascii", "replace") for v in auth_context.get("peer_spiffe_id") or ()}
    if shown & ids:
        return f"certificate {sorted(shown & ids)[0]} is revoked"
    if serials:
        for serial in parsed.of(auth_context):
            if serial in serials:
                return f"certificate serial {serial:x} is revoked"
    return None


@dataclass(frozen=True, kw_only=True)
class Revoked:
    """One revocation in the site's store: what, by whom, when, why."""

    credential: str
    by: str = ""
    at: float = 0.0
    reason: str = ""


class SiteRevocations:
    """The revocations the site's store holds, as this router last read them (by store key)."""

    def __init__(self) -> None:
        self._by_key: dict[str, Revoked] = {}
        self._ids: set[str] = set()
        self._serials: set[int] = set()
        self._agents: set[str] = set()
        self._parsed = CertificateSerials()

    def put(self, key: str, revoked: Revoked) -> None:
        self._by_key[key] = revoked
        self._index()

    def remove(self, key: str) -> None:
        if self._by_key.pop(key, None) is not None:
            self._index()

    def listed(self) -> list[Revoked]:
        return sorted(self._by_key.values(), key=lambda r: (r.at, r.credential))

    def _index(self) -> None:
        credentials = [r.credential for r in self._by_key.values()]
        self._agents = {c.removeprefix(AGENT_PREFIX) for c in credentials if c.startswith(AGENT_PREFIX)}
        self._serials = {int(c.removeprefix(SERIAL_PREFIX), 16) for c in credentials if c.startswith(SERIAL_PREFIX)}
        self._ids = {c for c in credentials if c.startswith("spiffe://")}

    def why_revoked(self, auth_context: Mapping[str, Sequence[bytes]]) -> str | None:
        why = certificate_revoked(self._ids, self._serials, auth_context, self._parsed)
        return f"{why} (site-wide)" if why else None

    def agent_revoked(self, agent_id: str) -> str | None:
        return f"agent {agent_id!r} is revoked (site-wide)" if agent_id in self._agents else None


class AnyRevoked:
    """Several lists as one: the first that revokes the caller says why."""

    def __init__(self, lists: Iterable[Revocations]) -> None:
        self._lists = tuple(lists)

    def why_revoked(self, auth_context: Mapping[str, Sequence[bytes]]) -> str | None:
        return next((why for r in self._lists if (why := r.why_revoked(auth_context)) is not None), None)
