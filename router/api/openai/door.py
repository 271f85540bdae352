"""The OpenAI API's door: who may call (the key, the Host, the body's type), how an error is
said in OpenAI's shape, and what the server itself is held to (its TLS, a key off loopback,
an idle connection's end). :mod:`router.api.openai.api` serves what comes through."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from stratus.convert.errors import http_status
from stratus.errors import ConfigError, StratusError, drop_frames
from stratus.serving.auth import is_loopback, same_secret

log = logging.getLogger("stratus.openai")

# A connection with no request in this long is closed, before its first request as after its last
# (aiohttp's default held a silent TCP connection an hour: security2 N10); a client reconnects.
IDLE_CONNECTION_S = 15.0


def error_body(status: int, kind: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_of(exc: StratusError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body for a Stratus error."""
    status, kind = http_status(exc)
    return status, error_body(status, kind, str(exc), getattr(exc, "param", None))


def error_response(exc: StratusError) -> web.Response:
    status, body = error_of(exc)
    return web.json_response(body, status=status)


class Door:
    """The API's two middlewares: errors become OpenAI's shape, and a call passes only with the
    key (``api_key``; none needed when empty, which only a loopback address allows), a Host of
    loopback or ``hosts`` where there is no key (DNS rebinding), and a JSON body (a page can
    post ``text/plain`` anywhere without a CORS check)."""

    def __init__(self, api_key: str, hosts: Sequence[str]) -> None:
        self._api_key = api_key
        self._hosts = frozenset(h.lower() for h in hosts)

    @web.middleware
    async def errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except StratusError as exc:
            answer = error_response(exc)
            drop_frames(exc)
            return answer
        except web.HTTPException as exc:
            return web.json_response(
                error_body(exc.status, "invalid_request_error", exc.reason or "bad request"),
                status=exc.status,
            )

    @web.middleware
    async def guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The key, the Host and the body's type, before anything else is read."""
        if self._api_key and not _is_probe(request):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            # over digests: the key's length leaks nothing; the scheme is OpenAI's, exactly
            if scheme != "Bearer" or not same_secret(given.strip(), self._api_key):
                return web.json_response(
                    error_body(
                        401, "authentication_error", "a valid API key is needed (Authorization: Bearer KEY)"
                    ),
                    status=401,
                )
        # Without a key (loopback only), a browser on this machine is the risk: its pages may
        # reach 127.0.0.1, or a name rebound to it, so only loopback names (and those given)
        # are served. A key is a header no other site's page can make a browser send.
        host = _host_name(request.host or "")
        if not self._api_key and not (is_loopback(host) or host in self._hosts):
            return web.json_response(
                error_body(421, "invalid_request_error", f"Host {host[:64]!r} is not one this API serves"),
                status=421,
            )
        if request.method == "POST" and request.content_type != "application/json":
            return web.json_response(
                error_body(415, "invalid_request_error", "the body must be Content-Type: application/json"),
                status=415,
            )
        return await handler(request)


# The shortest API key the OpenAI API takes off loopback (security2 N15: a 1-character key was).
MIN_API_KEY_CHARS = 32


def server_tls(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """An HTTPS server context (TLS 1.2 at least) for the API, or None without a certificate."""
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"the OpenAI API's certificate {cert} and key {key} do not load: {exc}") from None
    return context


def check_listen(listen: str, api_key: str) -> None:
    """Refuse (before anything starts) an OpenAI API off loopback without a key of at least
    MIN_API_KEY_CHARS characters."""
    host = listen.rpartition(":")[0] or "127.0.0.1"
    if is_loopback(host):
        return
    if not api_key:
        raise ConfigError(
            f"the OpenAI API on {listen} is off loopback: give it a key "
            "(--openai-api-key-file, or STRATUS_OPENAI_API_KEY)"
        )
    if len(api_key) < MIN_API_KEY_CHARS:
        raise ConfigError(
            f"the OpenAI API on {listen} is off loopback with a key of {len(api_key)} characters: "
            f"give one of at least {MIN_API_KEY_CHARS} (e.g. `openssl rand -hex 32`)"
        )


def _host_name(host: str) -> str:
    """The Host header without its port: ``[::1]:8080`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0].lower()
    return host.rsplit(":", 1)[0].lower() if host.count(":") == 1 else host.lower()


def _is_probe(request: web.Request) -> bool:
    """GET /health: open without the key, as vLLM's is, for load balancers' and kubelets'
    probes; it says only whether the router serves."""
    return request.method in ("GET", "HEAD") and request.path == "/health"
