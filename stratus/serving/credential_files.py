"""Credentials kept in files an operator edits while the router runs: per-agent tokens and
revoked certificates. Each is read again whenever it changes, so adding or revoking needs no
restart, and fails closed when it stops parsing (:class:`WatchedFile`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from stratus.errors import ConfigError
from stratus.serving.auth import NAME_PATTERN, spiffe_identity
from stratus.serving.revocations import CertificateSerials, certificate_revoked

log = logging.getLogger("stratus.auth")

T = TypeVar("T")


class WatchedFile(Generic[T]):
    """A credentials file read again whenever it changes (its mtime or size), parsed by
    ``parse``. One that stops parsing, or is deleted, fails closed: :meth:`current` is None
    until it is fixed (said as an ERROR once per change), since keeping the last good version
    would silently keep a revoked credential in; at start (``strict``), it is a ConfigError."""

    def __init__(self, path: Path, parse: Callable[[str, Path], T], *, what: str, fails_closed: str) -> None:
        self.path = path
        self._parse = parse
        self.what = what  # the file, in messages: "agent tokens file"
        self.fails_closed = fails_closed  # what a broken file means, in the ERROR line
        self._stamp: tuple[int, int] | None = None
        self._value: T | None = None
        self.broken = ""
        self._refresh(strict=True)

    def current(self) -> T | None:
        """The file as it reads now; None while it is broken or missing."""
        self._refresh(strict=False)
        return self._value

    def _refresh(self, *, strict: bool) -> None:
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp == self._stamp:
                return
            value = self._parse(self.path.read_text(encoding="utf-8"), self.path)
        except (OSError, ConfigError) as exc:
            if strict:
                raise ConfigError(f"{self.what} {self.path}: {exc}") from None
            failed = (-1, -1) if isinstance(exc, OSError) else stamp
            if failed != self._stamp:
                log.error("%s %s: %s; %s", self.what, self.path, exc, self.fails_closed)
            self._stamp, self._value, self.broken = failed, None, str(exc)[:200]
            return
        self._stamp, self._value, self.broken = stamp, value, ""


class AgentTokens:
    """Per-agent tokens: a file of ``AGENT_ID TOKEN`` lines (``#`` comments, blank lines).

    The file is read again whenever it changes, so revoking an agent is deleting its line,
    with no restart: a link whose token is gone ends at its next heartbeat (router/api/link.py).
    A file that stops parsing, or is deleted, fails closed: no agent is admitted, and live
    links end, until it is fixed (said as an ERROR at each change), since keeping the last
    good table would silently keep a revoked agent in (security2 N4).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = WatchedFile(
            path, parse_agent_tokens, what="agent tokens file", fails_closed="no agent is admitted until it is fixed"
        )

    def token_for(self, agent_id: str) -> str | None:
        return (self._file.current() or {}).get(agent_id)


def parse_agent_tokens(text: str, path: Path) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        comment = next((i for i, f in enumerate(fields) if f.startswith("#")), len(fields))
        fields = fields[:comment]  # a '#' starts a comment only where a field starts: tokens may hold one
        if not fields:
            continue
        if len(fields) != 2 or not NAME_PATTERN.fullmatch(fields[0]):
            raise ConfigError(f"{path}:{number}: expected 'AGENT_ID TOKEN'")
        if len(fields[1]) < 16:
            raise ConfigError(f"{path}:{number}: the token of {fields[0]!r} is shorter than 16 characters")
        if fields[0] in tokens:
            raise ConfigError(f"{path}:{number}: {fields[0]!r} is listed twice")
        tokens[fields[0]] = fields[1]
    return tokens


class RevokedCertificates:
    """Certificates no longer trusted, though they chain to the fleet CA: a file of lines, each
    a SPIFFE id (``spiffe://stratus/agent/device-1``: every certificate of that identity) or
    ``serial:HEX`` (one certificate), ``#`` comments. Read again whenever it changes, so a
    revocation takes effect without a restart: the next call is refused, and an agent's live
    link ends at its next heartbeat. A file that stops parsing or is deleted trusts no
    certificate until it is fixed (said as an ERROR), rather than silently dropping a
    revocation (security2 N12)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._parsed = CertificateSerials()
        self._file = WatchedFile(
            path,
            parse_revoked,
            what="revoked certificates file",
            fails_closed="no certificate is trusted until it is fixed",
        )

    def why_revoked(self, auth_context: Mapping[str, Sequence[bytes]]) -> str | None:
        """Why the peer's certificate is not trusted any more, or None."""
        listed = self._file.current()
        if listed is None:
            return (
                f"the revoked certificates file is broken ({self._file.broken}): no certificate is "
                "trusted until it is fixed"
            )
        revoked_ids, serials = listed
        return certificate_revoked(revoked_ids, serials, auth_context, self._parsed)


def parse_revoked(text: str, path: Path) -> tuple[frozenset[str], frozenset[int]]:
    ids: set[str] = set()
    serials: set[int] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if entry.startswith("serial:"):
            try:
                serials.add(int(entry.removeprefix("serial:").replace(":", ""), 16))
            except ValueError:
                raise ConfigError(f"{path}:{number}: a serial is hexadecimal ('serial:1A2B...')") from None
        elif spiffe_identity({"peer_spiffe_id": [entry.encode()]}) is not None:
            ids.add(entry)
        else:
            raise ConfigError(f"{path}:{number}: expected a SPIFFE id (spiffe://DOMAIN/ROLE/NAME) or 'serial:HEX'")
    return frozenset(ids), frozenset(serials)
