"""``/metrics``: a process's :class:`~stratus.obs.metrics.Metrics` served over plain HTTP GETs,
bounded (scrapes at once, expositions built a second), behind a scrape token where one is
given, and refused off loopback without one unless the operator says whoever reaches the
port may read it."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import time
from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST

from stratus.errors import ConfigError
from stratus.obs.metrics import Metrics

log = logging.getLogger("stratus.metrics")


def check_metrics_exposure(address: str | None, *, token: str, open_to_all: bool, insecure: bool) -> None:
    """Off loopback, /metrics lists the fleet's agent ids, families, variants and load (past
    --private-status): it needs a scrape token (--metrics-token-file), or the operator's word
    that whoever reaches the port may read it (--metrics-open: a network policy's job), or
    --insecure (security2 N8)."""
    if address is None or token or open_to_all or insecure:
        return
    host = address.rpartition(":")[0].strip("[]").lower()
    if host == "localhost":
        return
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return
    raise ConfigError(
        f"--metrics {address} would serve the fleet's agent ids and load to anyone who reaches it: give "
        "--metrics-token-file (Prometheus sends it as 'authorization: Bearer TOKEN'), or --metrics-open "
        "where a network policy admits only Prometheus, or listen on 127.0.0.1"
    )


# Scrapes answered at once, and how many expositions are built a second: the text is built on
# the event loop, so past that a flood of GETs is answered with the last one built (Prometheus
# and a person asking now and then always get a fresh one).
MAX_SCRAPES: Final = 8
MAX_BUILDS_PER_S: Final = 4


async def serve(metrics: Metrics, address: str, *, token: str = "") -> asyncio.Server:
    """Answer ``GET /metrics`` on ``host:port`` from this process's event loop (no thread);
    with ``token``, only to ``Authorization: Bearer TOKEN``."""
    host, _, port = address.rpartition(":")
    expected = token.encode()
    built: list[float] = []  # when the expositions of the last second were built
    last = b""
    scraping = 0

    def exposition() -> bytes:
        nonlocal last
        now = time.monotonic()
        built[:] = [t for t in built if now - t < 1.0]
        if len(built) < MAX_BUILDS_PER_S or not last:
            built.append(now)
            last = metrics.text()
        return last

    def response(head: bytes) -> tuple[bytes, bytes, bytes]:
        path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
        if not (head.startswith(b"GET ") and path.split(b"?")[0] == b"/metrics"):
            return b"only GET /metrics is served here\n", b"404 Not Found", b"text/plain"
        if expected and not _bearer_matches(head, expected):
            return b"GET /metrics needs 'Authorization: Bearer TOKEN'\n", b"401 Unauthorized", b"text/plain"
        if scraping > MAX_SCRAPES:
            return b"too many scrapes at once\n", b"503 Service Unavailable", b"text/plain"
        return exposition(), b"200 OK", CONTENT_TYPE_LATEST.encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal scraping
        scraping += 1
        try:
            await _answer(reader, writer)
        finally:
            scraping -= 1

    async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # LimitOverrunError: a head past the reader's 64 KiB limit, refused in silence
        with contextlib.suppress(
            ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError
        ):
            async with asyncio.timeout(5.0):
                head = await reader.readuntil(b"\r\n\r\n")
            body, status, kind = response(head)
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
            )  # fmt: skip
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, host or "127.0.0.1", int(port))
    log.info("metrics on http://%s/metrics", address)
    return server


def _bearer_matches(head: bytes, token: bytes) -> bool:
    """Whether the request head carries ``Authorization: Bearer TOKEN`` (the scheme in any case)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"authorization":
            scheme, _, presented = value.strip().partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(presented.strip(), token)
    return False
