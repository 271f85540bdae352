"""How a ``nats://`` site store is reached: the servers of its URL, TLS, and credentials.

A secret is never in the URL (it would show in `fleet status`, logs and a process's argv):
a URL with a user or token before ``@`` is refused, and credentials come from a file.
"""

from __future__ import annotations

import importlib.util
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from stratus.errors import ConfigError
from stratus.serving.channels import TlsSettings

SCHEMES: Final = ("nats", "tls")
DEFAULT_PORT: Final = 4222
JWT_MARK: Final = "-----BEGIN NATS USER JWT-----"


def servers_of(url: str) -> list[str]:
    """``nats://HOST:PORT[,HOST:PORT]`` (each part may repeat the scheme) as nats-py's server list."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES or not rest:
        raise ConfigError(f"{url[:80]!r} is not a NATS URL: nats://HOST:PORT[,HOST:PORT] or tls://HOST:PORT")
    return [_server(scheme, part.strip().removeprefix(f"{scheme}://")) for part in rest.split(",")]


def _server(scheme: str, part: str) -> str:
    if "@" in part:
        raise ConfigError(
            f"{scheme}://…@{part.rpartition('@')[2]}: a site store URL carries no user, password or token "
            "(they would show wherever the URL does); put them in a file and give it as the store's credentials"
        )
    host, colon, port = part.rpartition(":")
    if not colon:
        host, port = part, str(DEFAULT_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{scheme}://{part}: not HOST:PORT (a port from 1 to 65535)")
    return f"{scheme}://{host}:{port}"


def client_context(tls: ssl.SSLContext | TlsSettings | None) -> ssl.SSLContext | None:
    """A client context from the fleet's TLS files: ``ca`` checks the server, ``cert`` and
    ``key`` are presented to a server that asks (mutual TLS)."""
    if tls is None or isinstance(tls, ssl.SSLContext):
        return tls
    context = ssl.create_default_context(cafile=str(tls.ca) if tls.ca else None)
    if tls.cert is not None and tls.key is not None:
        context.load_cert_chain(str(tls.cert), str(tls.key))
    return context


@dataclass(frozen=True, kw_only=True)
class Credentials:
    """What nats-py's connect takes, from one file (repr hides the secrets)."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds_file: str | None = None  # a .creds file: nats-py reads it at each connect


def credentials_of(path: Path | str | None) -> Credentials:
    """A NATS ``.creds`` file (a user JWT and its NKey seed, as ``nsc`` writes it), or a file
    whose first line is ``USER:PASSWORD`` (or a lone token). Read once here, so a missing or
    empty file is refused at start, by name."""
    if path is None:
        return Credentials()
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"NATS credentials file {path} cannot be read ({exc})") from exc
    if JWT_MARK in text:
        if importlib.util.find_spec("nkeys") is None:
            raise ConfigError(
                f"NATS credentials file {path} holds a JWT, which needs nkeys: pip install nkeys"
            )
        return Credentials(creds_file=str(path))
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not line:
        raise ConfigError(
            f"NATS credentials file {path} is empty: write USER:PASSWORD, a token, or a .creds file"
        )
    user, colon, password = line.partition(":")
    return Credentials(user=user, password=password) if colon else Credentials(token=line)
