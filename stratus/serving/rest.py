"""The Open Inference Protocol over HTTP/REST (KServe v2's, as Triton serves it on port 8000),
for ``curl``, ``tritonclient.http`` and KServe's REST clients.

It is a second front on the one :class:`~stratus.serving.servicer.InferenceServicer`: every
request becomes the protobuf message a gRPC client would send (:mod:`stratus.convert.rest`)
and is answered by the same servicer method, so both fronts share the data plane, the
per-client limits, the statistics, the bounds on a request and the errors. Errors come back
as ``{"error": MESSAGE}`` with the HTTP status of the error's kind (400 bad input, 401/403
credentials, 404 unknown model, 429 full, 503 nothing can serve, 504 past the budget).

Routes: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2``, ``/v2/models/{m}``,
``/v2/models/{m}/ready``, ``/v2/models/{m}/config``, ``/v2/models/{m}/stats``,
``/v2/models/stats``; ``POST /v2/models/{m}/infer``, ``/v2/models/{m}/generate`` and
``/generate_stream`` (Triton's generate extension, for generative families: JSON fields in,
server-sent events out) and ``POST /v2/repository/index``. Each
``/v2/models/{m}`` route also takes ``/versions/{v}`` as Triton's do.

Credentials are the gRPC front's: with a client token every route but the two health probes
needs ``Authorization: Bearer TOKEN``; under mutual TLS the TLS handshake needs a certificate
of the fleet's CA, and a revoked one (``--revoked-certificates``) is refused each request.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from stratus import __version__
from stratus.convert import rest, rest_answers
from stratus.convert.errors import http_status
from stratus.convert.wire_scan import check_infer_request
from stratus.errors import ConfigError, InvalidInput, StratusError, drop_frames
from stratus.serving.auth import Revocations, same_secret
from stratus.serving.channels import MAX_MESSAGE_BYTES
from stratus.serving.servicer import EXTENSIONS, InferenceServicer
from stratus.wire import inference_pb2 as pb

log = logging.getLogger("stratus.rest")

# A body's most bytes: a request's binary data may be as large as a gRPC message, and JSON
# spends up to four times the bytes on the same numbers.
MAX_BODY_BYTES: Final = 4 * MAX_MESSAGE_BYTES
# A connection with no request in this long is closed (aiohttp's default held one an hour).
IDLE_CONNECTION_S: Final = 15.0
OPEN_PATHS: Final = frozenset({"/v2/health/live", "/v2/health/ready"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RestApi:
    """The REST front of ``servicer``; ``start`` binds it, ``stop`` closes it."""

    def __init__(
        self,
        servicer: InferenceServicer,
        *,
        client_token: str = "",
        tls: ssl.SSLContext | None = None,
        revoked: Revocations | None = None,
    ) -> None:
        self._servicer = servicer
        self._expected = f"Bearer {client_token}" if client_token else ""
        self._tls = tls
        self._revoked = revoked
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._guard])
        self._routes()
        self._runner: web.AppRunner | None = None

    def _routes(self) -> None:
        add = self.app.router
        add.add_get("/v2/health/live", self.live)
        add.add_get("/v2/health/ready", self.ready)
        add.add_get("/v2", self.server_metadata)
        add.add_get("/v2/models/stats", self.statistics)
        add.add_post("/v2/repository/index", self.repository_index)
        for model in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            add.add_get(model, self.model_metadata)
            add.add_get(f"{model}/ready", self.model_ready)
            add.add_get(f"{model}/config", self.model_config)
            add.add_get(f"{model}/stats", self.statistics)
            add.add_post(f"{model}/infer", self.infer)
            add.add_post(f"{model}/generate", self.generate)
            add.add_post(f"{model}/generate_stream", self.generate_stream)

    async def start(self, listen: str, *, reuse_port: bool = False) -> str:
        """Serve on ``HOST:PORT`` (port 0: any free one); the address bound."""
        host, _, port = listen.rpartition(":")
        if not port.isdigit():
            raise ConfigError(f"--http {listen}: expected HOST:PORT")
        self._runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, keepalive_timeout=IDLE_CONNECTION_S
        )
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, host or "127.0.0.1", int(port), ssl_context=self._tls, reuse_port=reuse_port).start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
        addresses = self._runner.addresses
        return f"{host}:{int(addresses[0][1]) if addresses else int(port)}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- middleware ----------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except StratusError as exc:
            status, _ = http_status(exc)
            answer = _error(status, str(exc))
            drop_frames(exc)
            return answer
        except web.HTTPException as exc:
            return _error(exc.status, _reason(exc))

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The client token and a revoked certificate, before anything is read."""
        if request.path in OPEN_PATHS:
            return await handler(request)
        if self._expected and not same_secret(request.headers.get("Authorization", ""), self._expected):
            return _error(401, f"{request.path} needs 'Authorization: Bearer TOKEN' (the client token)")
        if self._revoked is not None:
            why = self._revoked.why_revoked(peer_auth_context(request))
            if why is not None:
                return _error(403, why)
        return await handler(request)

    # -- routes --------------------------------------------------------------------------
    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        answer = await self._servicer.ServerReady(pb.ServerReadyRequest(), None)
        return web.Response(status=200 if answer.ready else 400)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response({"name": "stratus", "version": __version__, "extensions": list(EXTENSIONS)})

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        answer = await self._servicer.ModelMetadata(pb.ModelMetadataRequest(name=name, version=version), None)
        return web.json_response(rest_answers.message_json(answer))

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        answer = await self._servicer.ModelReady(pb.ModelReadyRequest(name=name, version=version), None)
        return web.Response(status=200 if answer.ready else 400)

    async def model_config(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        answer = await self._servicer.ModelConfig(pb.ModelConfigRequest(name=name, version=version), None)
        return web.json_response(rest_answers.message_json(answer.config))

    async def statistics(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        asked = pb.ModelStatisticsRequest(name=name, version=version)
        return web.json_response(rest_answers.message_json(await self._servicer.ModelStatistics(asked, None)))

    async def repository_index(self, request: web.Request) -> web.Response:
        body = await request.read()
        document = rest.parse_json(body) if body.strip() else {}
        ready = document.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput("'ready' must be true or false")
        index = await self._servicer.RepositoryIndex(pb.RepositoryIndexRequest(ready=ready), None)
        return web.json_response([rest_answers.message_json(model) for model in index.models])

    async def infer(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        asked = rest.infer_request(
            name, version, await request.read(), request.headers.get(rest.HEADER_LENGTH)
        )
        check_infer_request(asked.message.SerializeToString())  # the gRPC front's bounds, exactly
        answer = await self._servicer.infer(asked.message, peer=peer_of(request), timeout_s=None)
        body, header_length = rest_answers.infer_response(answer, asked)
        if header_length is None:
            return web.Response(body=body, content_type="application/json")
        return web.Response(
            body=body,
            content_type="application/octet-stream",
            headers={rest.HEADER_LENGTH: str(header_length)},
        )

    async def generate(self, request: web.Request) -> web.Response:
        """Triton's generate extension: the whole text in one answer."""
        name, version = _model(request)
        message = rest.generate_request(name, version, await request.read())
        check_infer_request(message.SerializeToString())
        answer = await self._servicer.infer(message, peer=peer_of(request), timeout_s=None)
        return web.json_response(rest_answers.generate_response(answer))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """... and as server-sent events, one per chunk; an error after the first chunk is an
        event of its own (``{"error": ...}``), as Triton sends it, since the status has left."""
        name, version = _model(request)
        message = rest.generate_request(name, version, await request.read())
        check_infer_request(message.SerializeToString())
        chunks = aiter(self._servicer.generate(message, peer=peer_of(request), timeout_s=None))
        first = await anext(chunks, None)  # a refusal before any text is still a plain HTTP error
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            if first is not None:
                await _event(response, rest_answers.generate_response(first))
            async for chunk in chunks:
                await _event(response, rest_answers.generate_response(chunk))
        except StratusError as exc:
            await _event(response, {"error": str(exc)})
            drop_frames(exc)
        await response.write_eof()
        return response


async def _event(response: web.StreamResponse, document: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n")


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info.get("model", ""), request.match_info.get("version", "")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _reason(exc: web.HTTPException) -> str:
    if exc.status == 413:
        return f"the request body is over {MAX_BODY_BYTES} bytes, the most taken here"
    if exc.status == 404:
        return "no such route: the REST API serves /v2/health/..., /v2, /v2/models/{model}/... and /v2/repository/index"
    return exc.reason or "bad request"


def peer_of(request: web.Request) -> str:
    """The caller as gRPC names a peer (``ipv4:ADDRESS:PORT``), so one client's requests on
    either front count against the same per-client limits."""
    peername: Any = request.transport.get_extra_info("peername") if request.transport else None
    if not peername:
        return "unknown"
    host, port = peername[0], peername[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def peer_auth_context(request: web.Request) -> dict[str, list[bytes]]:
    """The TLS peer's identity in gRPC's auth-context keys (``peer_spiffe_id``,
    ``x509_pem_cert``), so the revocation check reads both fronts alike."""
    ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
    if ssl_object is None:
        return {}
    found: dict[str, list[bytes]] = {}
    certificate = ssl_object.getpeercert()
    uris = [value for kind, value in (certificate or {}).get("subjectAltName", ()) if kind == "URI"]
    if uris:
        found["peer_spiffe_id"] = [uri.encode("ascii", "replace") for uri in uris]
    der = ssl_object.getpeercert(binary_form=True)
    if der:
        found["x509_pem_cert"] = [ssl.DER_cert_to_PEM_cert(der).encode("ascii")]
    return found


def server_context(cert: str, key: str, ca: str | None) -> ssl.SSLContext:
    """HTTPS with the server's certificate; with ``ca``, a client certificate of that CA is
    needed for the handshake (mutual TLS, as the gRPC front asks)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if ca is not None:
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
