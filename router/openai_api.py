"""The OpenAI API at the router: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Served with aiohttp on the router's own event loop (``stratus router --openai HOST:PORT``),
in the shapes vLLM uses, so the ``openai`` SDK works unchanged. Requests go through the
same generation cascade as Open Inference Protocol ones (:mod:`router.generate`): a lower
tier's answer is held until accepted, the final tier streams straight through (SSE,
``data: [DONE]`` at the end), and a client that goes away cancels the generation on the
agent running it.

Stratus's own options travel in the body's ``stratus`` object (the SDK's ``extra_body``):
``budget_ms``, ``min_confidence``, ``max_tier``, ``min_tier``; answers carry a ``stratus``
object (tier, agent, variant, path, confidence, degraded, timings_ms). Decoding is greedy:
``temperature`` other than 0, ``n`` other than 1, and any of ``top_p``, ``seed``, ``stop``,
the penalties, ``logit_bias``, ``best_of``, ``echo``, ``suffix`` and ``stream_options`` asking for
something are refused by name (``param``), not ignored. ``/health`` and ``/v1/models/{id}`` answer
as vLLM's do. A chat
request's prompt is its last user message (the shipped families have no chat template).

Errors come back in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with the status that fits: 400 for a malformed body or a bad value, 404 for an unknown
model, 429 when the router is full, 503 when nothing can serve, 504 past the budget.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from router.generate import Generation
from stratus import codec
from stratus.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    Overloaded,
    PermissionDenied,
    StratusError,
    Unauthenticated,
    Unavailable,
)
from stratus.generation import MAX_TOKENS, TEXT_INPUT, Chunk
from stratus.local_generation import text_array
from stratus.protocol import PREFIX, set_parameter
from stratus.serving import is_loopback
from stratus.wire import inference_pb2 as pb

if TYPE_CHECKING:
    from router.dataplane import RouterDataPlane

log = logging.getLogger("stratus.openai")

_STATUS: Final[dict[type[StratusError], tuple[int, str]]] = {
    InvalidInput: (400, "invalid_request_error"),
    NotFound: (404, "not_found_error"),
    Unauthenticated: (401, "authentication_error"),
    PermissionDenied: (403, "permission_error"),
    Overloaded: (429, "rate_limit_error"),
    Unavailable: (503, "service_unavailable"),
    DeadlineExceeded: (504, "timeout"),
}
_OPTIONS: Final = {"budget_ms": float, "min_confidence": float, "max_tier": str, "min_tier": str}


def error_body(status: int, kind: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class FieldError(InvalidInput):
    """A bad body field, named in the error's ``param`` as OpenAI's API does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# Fields OpenAI's API takes that Stratus does not honour: each refused when it asks for
# something other than its default, never silently ignored. (The tiers decode greedily, and
# a family's stop strings come from its configuration.)
_UNSUPPORTED: Final = {
    "top_p": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "logit_bias": None,
    "seed": None,
    "stop": None,
    "stream_options": None,
}


def error_of(exc: StratusError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body for a Stratus error."""
    status, kind = next((v for cls, v in _STATUS.items() if isinstance(exc, cls)), (500, "internal_error"))
    return status, error_body(status, kind, str(exc), getattr(exc, "param", None))


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    for field, default in _UNSUPPORTED.items():
        value = body.get(field, default)
        if value == default or value in ({}, [], ""):
            continue
        raise FieldError(
            field,
            f"'{field}' is not supported by Stratus (it decodes greedily, with the family's own stop "
            f"strings); leave it out or at {json.dumps(default)}",
        )


def _error_response(exc: StratusError) -> web.Response:
    status, body = error_of(exc)
    return web.json_response(body, status=status)


class OpenAiApi:
    """The OpenAI API in front of the router's data plane.

    ``api_key``: every call must carry ``Authorization: Bearer KEY`` (none needed when
    empty, which only a loopback address allows). Bodies must be ``application/json``: a web
    page can post ``text/plain`` anywhere without a CORS check, so that refusal, with the
    ``Host`` allow-list against DNS rebinding, keeps browsers out."""

    def __init__(self, plane: RouterDataPlane, *, api_key: str = "", hosts: Sequence[str] = ()) -> None:
        self.plane = plane
        self._api_key = api_key
        self._hosts = frozenset(h.lower() for h in hosts)
        self.app = web.Application(client_max_size=1 << 20, middlewares=[self._errors, self._guard])
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model}", self.model)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self._runner: web.AppRunner | None = None

    async def start(self, listen: str) -> str:
        host, _, port = listen.rpartition(":")
        check_listen(listen, self._api_key)
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host or "127.0.0.1", int(port))
        await site.start()
        addresses = self._runner.addresses  # (host, port, ...) of each bound socket
        bound = int(addresses[0][1]) if addresses else int(port)
        return f"{host}:{bound}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except StratusError as exc:
            return _error_response(exc)
        except web.HTTPException as exc:
            return web.json_response(
                error_body(exc.status, "invalid_request_error", exc.reason or "bad request"),
                status=exc.status,
            )

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The key, the Host and the body's type, before anything else is read."""
        if self._api_key:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), self._api_key.encode()):
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

    # -- endpoints ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 while the router serves (vLLM's /health), 503 otherwise."""
        ready = self.plane.ready()
        return web.json_response({"status": "ok" if ready else "unavailable"}, status=200 if ready else 503)

    async def models(self, request: web.Request) -> web.Response:
        """The generative models that can answer now (vLLM lists what it serves)."""
        plane = self.plane
        names = [n for n in plane.model_names() if plane.generative(n) is not None and plane.model_ready(n)]
        return web.json_response({"object": "list", "data": [_model(n) for n in names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if self.plane.generative(name) is None:
            raise NotFound(f"the model '{name[:128]}' does not exist or does not generate text")
        return web.json_response(_model(name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise FieldError("prompt", "'prompt' must be one string (one prompt per request)")
        return await self._answer(request, body, prompt, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise FieldError("messages", "'messages' must be a non-empty list")
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        content = users[-1].get("content") if users else None
        if not isinstance(content, str):
            raise FieldError("messages", "the last user message must have string 'content'")
        return await self._answer(request, body, content, chat=True)

    # -- the shared path -------------------------------------------------------------------------
    async def _answer(
        self, http: web.Request, body: Mapping[str, Any], prompt: str, *, chat: bool
    ) -> web.StreamResponse:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise FieldError("model", "'model' is required")
        info = self.plane.generative(model)
        if info is None:
            raise NotFound(f"the model '{model}' does not exist or does not generate text")
        oip = _oip_request(model, prompt, body, info.max_tokens)
        reply = _Reply(model=model, chat=chat, logprobs=bool(body.get("logprobs")))
        if body.get("stream") is True:
            return await self._stream(http, oip, reply)
        result = await self.plane.generate_text(oip, timeout_s=None)
        return web.json_response(reply.whole(result))

    async def _stream(
        self, http: web.Request, oip: pb.ModelInferRequest, reply: _Reply
    ) -> web.StreamResponse:
        """SSE: a lower tier's text only once accepted; the final tier's as it comes."""
        chunks: asyncio.Queue[Chunk | None] = asyncio.Queue()

        async def sink(chunk: Chunk) -> None:
            chunks.put_nowait(chunk)

        work = asyncio.create_task(self.plane.generate_text(oip, timeout_s=None, sink=sink))
        work.add_done_callback(lambda _: chunks.put_nowait(None))
        response: web.StreamResponse | None = None
        try:
            first = await chunks.get()
            if first is None and work.exception() is not None:
                raise work.exception()  # type: ignore[misc]  # nothing sent yet: a plain error answer
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(http)
            for line in reply.opening():
                await _event(response, line)
            chunk = first
            while chunk is not None:
                await _event(response, reply.piece(chunk))
                chunk = await chunks.get()
            try:
                result = await work
            except StratusError as exc:  # after the stream began: an error event, then the end
                await _event(response, error_of(exc)[1])
            else:
                await _event(response, reply.closing(result))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            work.cancel()  # the client went away: the Cancel reaches the agent


class _Reply:
    """OpenAI's response shapes, for completions or chat, whole or as SSE chunks."""

    def __init__(self, *, model: str, chat: bool, logprobs: bool) -> None:
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, result: Generation) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(result.finish_reason)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
            choice["logprobs"] = _chat_logprobs(result) if self.logprobs else None
        else:
            choice["text"] = result.text
            choice["logprobs"] = _completion_logprobs(result) if self.logprobs else None
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [choice], "stratus": stratus_object(result)}

    def opening(self) -> list[dict[str, Any]]:
        if not self.chat:
            return []
        return [
            {
                **self._head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}],
            }
        ]

    def piece(self, chunk: Chunk) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": {"content": chunk.text}, "finish_reason": None}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        return {
            **self._head("text_completion"),
            "choices": [{"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": None}],
        }

    def closing(self, result: Generation) -> dict[str, Any]:
        finish = _finish(result.finish_reason)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return {**self._head(kind), "choices": [choice], "stratus": stratus_object(result)}


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "stratus"}


def stratus_object(result: Generation) -> dict[str, Any]:
    return {
        "tier": result.tier.label,
        "agent": result.agent,
        "variant": result.variant,
        "path": [t.label for t in result.path],
        "confidence": round(result.confidence, 6),
        "degraded": result.degraded,
        "timings_ms": {t.label: round(ms, 3) for t, ms in result.timings_ms.items()},
        "tokens": {t.label: n for t, n in result.generated.items()},
    }


def _finish(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _completion_logprobs(result: Generation) -> dict[str, Any]:
    return {
        "tokens": [t.text for t in result.tokens],
        "token_logprobs": [t.logprob for t in result.tokens],
        "top_logprobs": None,
        "text_offset": None,
    }


def _chat_logprobs(result: Generation) -> dict[str, Any]:
    return {
        "content": [
            {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()), "top_logprobs": []}
            for t in result.tokens
        ]
    }


def check_listen(listen: str, api_key: str) -> None:
    """Refuse (before anything starts) an OpenAI API off loopback without a key."""
    host = listen.rpartition(":")[0] or "127.0.0.1"
    if not api_key and not is_loopback(host):
        raise ConfigError(
            f"the OpenAI API on {listen} is off loopback: give it a key "
            "(--openai-api-key-file, or STRATUS_OPENAI_API_KEY)"
        )


def _number(key: str, value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer past any double (10**400)
        raise InvalidInput(f"'stratus.{key}' is out of range") from None


def _host_name(host: str) -> str:
    """The Host header without its port: ``[::1]:8080`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0].lower()
    return host.rsplit(":", 1)[0].lower() if host.count(":") == 1 else host.lower()


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # a megabyte of '[': nested past what the parser follows
        raise InvalidInput("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    return body


def _oip_request(model: str, prompt: str, body: Mapping[str, Any], limit: int) -> pb.ModelInferRequest:
    """The OpenAI body as the Open Inference Protocol request the cascade takes, checked."""
    if body.get("n", 1) != 1:
        raise FieldError("n", "'n' must be 1")
    temperature = body.get("temperature", 0)
    if not isinstance(temperature, int | float) or temperature != 0:
        raise FieldError("temperature", "Stratus decodes greedily: 'temperature' must be 0 (or left out)")
    refuse_unsupported(body)
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", limit))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= limit:
        raise FieldError(
            "max_tokens",
            f"'max_tokens' must be an integer between 1 and {limit} for '{model}', not {max_tokens!r}",
        )
    request = pb.ModelInferRequest(model_name=model, id=uuid.uuid4().hex[:16])
    codec.encode_request_inputs(request, {TEXT_INPUT: text_array(prompt)})
    set_parameter(request.parameters, MAX_TOKENS, max_tokens)
    options = body.get("stratus", {})
    if not isinstance(options, dict):
        raise InvalidInput("'stratus' must be an object")
    for key, value in options.items():
        kind = _OPTIONS.get(key)
        if kind is None:
            raise InvalidInput(f"unknown 'stratus' option '{key}'; known: {sorted(_OPTIONS)}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise InvalidInput(f"'stratus.{key}' must be a number")
        if kind is str and not isinstance(value, str):
            raise InvalidInput(f"'stratus.{key}' must be a string")
        set_parameter(request.parameters, f"{PREFIX}{key}", _number(key, value) if kind is float else value)
    return request


async def _event(response: web.StreamResponse, payload: Mapping[str, Any]) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())
