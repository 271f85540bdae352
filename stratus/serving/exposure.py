"""What a server may be exposed with: off loopback, TLS and callers who prove who they are (or
the operator's ``--insecure``, then warned about every minute), and secrets long enough and one
per role. Loopback needs nothing, so a demo keeps working with no set-up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Final, Protocol

from stratus.errors import ConfigError
from stratus.serving.auth import is_loopback

log = logging.getLogger("stratus.auth")

INSECURE_WARNING_S: Final = 60.0


class EndpointTls(Protocol):
    """What the exposure checks read of an endpoint's TLS (:class:`stratus.serving.channels.TlsSettings`)."""

    @property
    def cert(self) -> Path | None: ...
    @property
    def mutual(self) -> bool: ...


def check_exposure(
    what: str, listen: str, *, tls: bool, callers_authenticated: bool, insecure: bool, needs: str
) -> None:
    """Refuse to serve plaintext or unauthenticated on an address others can reach.

    Loopback needs nothing (a demo keeps working with no set-up); anything else needs TLS and
    caller authentication (``needs`` says which flags give it), or ``--insecure``."""
    host = listen.rsplit(":", 1)[0]
    if insecure or is_loopback(host):
        return
    missing = [
        m for m, ok in (("TLS (--tls-cert, --tls-key)", tls), (needs, callers_authenticated)) if not ok
    ]
    if missing:
        raise ConfigError(
            f"{what} would listen on {listen} without {' and '.join(missing)}: anyone who reaches it "
            "could use it. Give those (see `stratus certs`), listen on 127.0.0.1, or accept the risk "
            "with --insecure"
        )


# The shortest secret a server reachable off loopback takes (per-agent tokens need as much).
MIN_SECRET_CHARS: Final = 16


def check_secrets(what: str, listen: str, secrets: Mapping[str, str], *, insecure: bool) -> None:
    """Off loopback: every secret at least MIN_SECRET_CHARS long, and no one secret filling two
    roles (``STRATUS_TOKEN`` alone once made every device that held it an operator and a
    rollout peer, security2 N5). ``secrets`` maps a role's flag to its secret ("" for none)."""
    if insecure or is_loopback(listen.rsplit(":", 1)[0]):
        return
    given = {flag: value for flag, value in secrets.items() if value}
    short = sorted(flag for flag, value in given.items() if len(value) < MIN_SECRET_CHARS)
    if short:
        raise ConfigError(
            f"{what} would listen on {listen} with a secret shorter than {MIN_SECRET_CHARS} characters "
            f"({', '.join(short)}): anyone could guess it. Use longer ones, or accept the risk with --insecure"
        )
    by_value: dict[str, list[str]] = {}
    for flag, value in given.items():
        by_value.setdefault(value, []).append(flag)
    shared = [flags for flags in by_value.values() if len(flags) > 1]
    if shared:
        raise ConfigError(
            f"{what} would listen on {listen} with one secret for {', '.join(sorted(shared[0]))}: whoever "
            "holds it has every one of those roles. Give each role its own (STRATUS_TOKEN stands in for "
            "all that have none), or accept the risk with --insecure"
        )


async def warn_insecure_forever(what: str, listen: str, interval_s: float = INSECURE_WARNING_S) -> None:
    """With ``--insecure`` on a reachable address, a warning every minute, so nobody forgets."""
    while True:
        log.warning(
            "%s on %s runs with --insecure: traffic may be plaintext and callers unauthenticated",
            what,
            listen,
        )
        await asyncio.sleep(interval_s)


def exposed_insecurely(listen: str, *, tls: bool, callers_authenticated: bool) -> bool:
    return not is_loopback(listen.rsplit(":", 1)[0]) and not (tls and callers_authenticated)


def insecure_warning(
    what: str, listen: str, *, tls: bool, callers_authenticated: bool
) -> asyncio.Task[None] | None:
    """The every-minute warning, where a server listens off loopback under --insecure."""
    if not exposed_insecurely(listen, tls=tls, callers_authenticated=callers_authenticated):
        return None
    return asyncio.create_task(warn_insecure_forever(what, listen), name="stratus-insecure-warning")


def clients_authenticated(tls: EndpointTls, client_token: str) -> bool:
    """An inference endpoint's callers prove who they are: mutual TLS, or the client token."""
    return tls.mutual or bool(client_token)


def check_endpoint(what: str, listen: str, tls: EndpointTls, *, client_token: str, insecure: bool) -> bool:
    """An inference endpoint (the cloud gateway, an agent's ``--serve``): off loopback it
    needs TLS and client authentication (mutual TLS or a client token), or ``--insecure``.
    Whether its callers are authenticated."""
    authenticated = clients_authenticated(tls, client_token)
    check_exposure(
        what,
        listen,
        tls=tls.cert is not None,
        callers_authenticated=authenticated,
        insecure=insecure,
        needs="client authentication (--tls-ca for mutual TLS, or --client-token-file)",
    )
    return authenticated
