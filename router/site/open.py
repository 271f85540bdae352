"""The store a site-state URL names: ``file:PATH`` or ``nats://HOST:PORT[,HOST:PORT]``.

Its own module, not the package's ``__init__``: the backends import the contract from there,
and an import back from it would make a cycle (tests/unit/test_imports.py counts lazy ones).
NATS's client is imported only for a ``nats://`` URL.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Final

from router.site import SiteState
from router.site.file import FileSiteState
from stratus.errors import ConfigError
from stratus.serving.channels import TlsSettings

FORMS: Final = (
    "file:PATH (a lone router: one JSON file) or nats://HOST:PORT[,HOST:PORT] "
    "(tls://… too: the routers of a site sharing a JetStream key-value bucket)"
)


def open_site_state(
    url: str, *, tls: ssl.SSLContext | TlsSettings | None = None, creds: Path | str | None = None
) -> SiteState:
    """The store, not yet started (``start()`` loads or connects)."""
    if url.startswith("file:"):
        path = url.removeprefix("file://") if url.startswith("file://") else url.removeprefix("file:")
        if not path:
            raise ConfigError(f"site state store {url!r}: no path; {FORMS}")
        if tls is not None or creds is not None:
            raise ConfigError(f"site state store {url}: TLS and credentials are for a nats:// store")
        return FileSiteState(path)
    if url.startswith(("nats://", "tls://")):
        from router.site.nats import NatsSiteState

        return NatsSiteState(url, tls=tls, creds=creds)
    scheme, colon, _ = url.partition(":")  # never the rest (nor a value with no scheme): it may be a secret
    kind = f"{scheme[:16]!r} is not a kind of store" if colon else "a URL needs a scheme"
    raise ConfigError(f"site state store: {kind}; {FORMS}")
