"""The OpenAI API at the router: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Served with aiohttp on the router's own event loop (``stratus router --openai HOST:PORT``),
in the shapes vLLM uses, so the ``openai`` SDK works unchanged. Requests go through the
same generation cascade as Open Inference Protocol ones (:mod:`router.cascade.generate`): a lower
tier's answer is held until accepted, the final tier streams straight through (SSE,
``data: [DONE]`` at the end), and a client that goes away cancels the generation on the
agent running it.

Stratus's own options travel in the body's ``stratus`` object (the SDK's ``extra_body``):
``budget_ms``, ``min_confidence``, ``max_tier``, ``min_tier``; answers carry a ``stratus``
object (tier, agent, variant, path, confidence, degraded, timings_ms, tokens per tier).
``max_tokens``, ``stop``, ``temperature``, ``top_p`` and ``seed`` are honoured by every tier
(:mod:`stratus.families.sampling`; greedy unless a temperature is given); ``n`` other than 1, the
penalties, ``logit_bias``, ``best_of``, ``echo`` and ``suffix`` asking for something are refused
by name (``param``), not ignored. Every answer carries ``usage`` (the answering tier's own
counts), and a stream with ``stream_options.include_usage`` ends with a chunk of it. A
completion's ``prompt`` may be a list of strings: one choice per prompt, each climbing on its
own (streamed too, chunks by ``index``). ``/health`` and ``/v1/models/{id}`` answer as vLLM's
do.

A chat request's whole conversation (``system``, ``user`` and ``assistant`` messages, in
order; each content a string or a list of ``text`` parts, joined by newlines as vLLM joins
them; any other role, part type, or message field asking for something is a 400 naming
``messages``) goes to every tier it climbs to, and each renders it with its own model's chat
template, where the variant's GGUF carries one (``tokenizer.chat_template``: Jinja2, sandboxed,
``add_generation_prompt`` true, ``bos_token`` and ``eos_token`` given, as transformers renders
it). A variant whose GGUF has none (the shipped arith models) generates from the last user
message alone, as before. Which of the two happened is in the answer: the ``stratus`` object's
``chat_template`` is true where the answering tier rendered the conversation, false where it
did not, with a ``note`` saying that the earlier messages were not seen. A template that
refuses the conversation, or a rendered prompt past the model's context, is a 400 naming
``messages``; ``usage.prompt_tokens`` counts the rendered prompt.

Who may call is :mod:`router.api.openai.door`'s to say; bodies are read and checked by
:mod:`router.api.openai.requests`, answers shaped by :mod:`router.api.openai.replies`; this
module serves them. Errors come back in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with the status that fits: 400 for a malformed body or a bad value, 404 for an unknown
model, 429 when the router is full, 503 when nothing can serve, 504 past the budget.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

from router.api.openai.door import IDLE_CONNECTION_S, Door, check_listen, error_of
from router.api.openai.replies import Reply, model_entry
from router.api.openai.requests import (
    check_fields,
    choice_params,
    choices_of,
    messages_of,
    options_of,
    prompts_of,
    settings_of,
    text_request,
    usage_asked,
)
from router.cascade.generate import Generation, Sink, TextGenerator
from stratus.convert.inference import TextRequest
from stratus.errors import (
    InvalidInput,
    NotFound,
    StratusError,
)
from stratus.families.chat import Message, last_user_message
from stratus.families.generation import Chunk
from stratus.families.sampling import FieldError
from stratus.serving.auth import is_loopback
from stratus.serving.client_limits import ClientLimits
from stratus.serving.rest import peer_of

log = logging.getLogger("stratus.openai")


class OpenAiApi:
    """The OpenAI API in front of the router's data plane.

    ``api_key``: every call must carry ``Authorization: Bearer KEY`` (none needed when
    empty, which only a loopback address allows). Bodies must be ``application/json``: a web
    page can post ``text/plain`` anywhere without a CORS check, so that refusal, with the
    ``Host`` allow-list against DNS rebinding, keeps browsers out."""

    def __init__(
        self,
        plane: TextGenerator,
        *,
        api_key: str = "",
        hosts: Sequence[str] = (),
        tls: ssl.SSLContext | None = None,
        limits: ClientLimits | None = None,
    ) -> None:
        """``limits``: the gRPC port's per-client limits (requests and items in flight), which a
        client's OpenAI calls count against too (security2 F21)."""
        self.plane = plane
        self._limits = limits or ClientLimits(per_client=0)
        self._api_key = api_key
        self._tls = tls
        door = Door(api_key, hosts)
        self.app = web.Application(client_max_size=1 << 20, middlewares=[door.errors, door.guard])
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model}", self.model)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self._runner: web.AppRunner | None = None

    async def start(self, listen: str, *, reuse_port: bool = False) -> str:
        host, _, port = listen.rpartition(":")
        check_listen(listen, self._api_key)
        if self._tls is None and not is_loopback(host or "127.0.0.1"):
            log.warning(
                "the OpenAI API on %s is plain HTTP off loopback: its key and every prompt cross the "
                "network in clear; give --openai-tls-cert/--openai-tls-key, or end TLS in front of it",
                listen,
            )
        self._runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, keepalive_timeout=IDLE_CONNECTION_S
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host or "127.0.0.1", int(port), ssl_context=self._tls, reuse_port=reuse_port)
        await site.start()
        addresses = self._runner.addresses  # (host, port, ...) of each bound socket
        bound = int(addresses[0][1]) if addresses else int(port)
        return f"{host}:{bound}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- endpoints ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 while the router serves (vLLM's /health), 503 otherwise."""
        ready = self.plane.ready()
        return web.json_response({"status": "ok" if ready else "unavailable"}, status=200 if ready else 503)

    async def models(self, request: web.Request) -> web.Response:
        """The generative models that can answer now (vLLM lists what it serves)."""
        plane = self.plane
        names = [n for n in plane.model_names() if plane.generative(n) is not None and plane.model_ready(n)]
        return web.json_response({"object": "list", "data": [model_entry(n) for n in names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if self.plane.generative(name) is None:
            raise NotFound(f"the model '{name[:128]}' does not exist or does not generate text")
        return web.json_response(model_entry(name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        return await self._answer(request, body, prompts_of(body.get("prompt")), chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """The conversation travels to each tier; the last user message is the prompt of a
        variant without a chat template."""
        body = await _body(request)
        messages = messages_of(body.get("messages"))
        return await self._answer(request, body, [last_user_message(messages)], chat=True, messages=messages)

    # -- the shared path -------------------------------------------------------------------------
    async def _answer(
        self,
        http: web.Request,
        body: Mapping[str, Any],
        prompts: Sequence[str],
        *,
        chat: bool,
        messages: tuple[Message, ...] = (),
    ) -> web.StreamResponse:
        check_fields(body, chat=chat)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise FieldError("model", "'model' is required")
        info = self.plane.generative(model)
        if info is None:
            raise NotFound(f"the model '{model}' does not exist or does not generate text")
        params = settings_of(body, model, info.max_tokens)
        options = options_of(body)
        n = choices_of(body, len(prompts))
        requests = [  # choice index = prompt index * n + choice, as OpenAI numbers them
            text_request(model, prompt, choice_params(params, choice), options, messages)
            for prompt in prompts
            for choice in range(n)
        ]
        with self._limits.hold(peer_of(http), items=len(requests)):
            return await self._reply(http, body, requests, model=model, chat=chat, per_prompt=n)

    async def _reply(
        self,
        http: web.Request,
        body: Mapping[str, Any],
        requests: list[TextRequest],
        *,
        model: str,
        chat: bool,
        per_prompt: int,
    ) -> web.StreamResponse:
        stream = body.get("stream") is True
        reply = Reply(
            model=model,
            chat=chat,
            logprobs=bool(body.get("logprobs")),
            usage_chunk=usage_asked(body, stream),
            per_prompt=per_prompt,
        )
        if stream:
            return await self._stream(http, requests, reply)
        works = [asyncio.create_task(self._generate(r), name="stratus-openai-choice") for r in requests]
        try:
            results = await asyncio.gather(*works)
        finally:
            for work in works:
                work.cancel()  # one failed: the others are not answered, so not worth finishing
        return web.json_response(reply.whole(results))

    async def _stream(
        self, http: web.Request, requests: Sequence[TextRequest], reply: Reply
    ) -> web.StreamResponse:
        """SSE: a lower tier's text only once accepted; the final tier's as it comes; each
        prompt's chunks under its own ``index``, each ended by its own closing chunk."""
        events: asyncio.Queue[tuple[int, Chunk | Generation | BaseException]] = asyncio.Queue()
        works = [self._start(index, request, events) for index, request in enumerate(requests)]
        try:
            index, first = await events.get()
            if isinstance(first, BaseException):
                raise first  # nothing sent yet: a plain error answer
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(http)
            for line in reply.opening():
                await _event(response, line)
            results = await self._relay(response, reply, (index, first), events, len(requests))
            if results is not None and reply.usage_chunk:
                await _event(response, reply.usage(results))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            for work in works:
                work.cancel()  # the client went away (or one failed): the Cancel reaches the agent

    def _start(
        self,
        index: int,
        request: TextRequest,
        events: asyncio.Queue[tuple[int, Chunk | Generation | BaseException]],
    ) -> asyncio.Task[Generation]:
        """One prompt's generation, its chunks and then its outcome put on ``events``."""

        async def sink(chunk: Chunk) -> None:
            events.put_nowait((index, chunk))

        work = asyncio.create_task(self._generate(request, sink), name="stratus-openai-stream")
        work.add_done_callback(lambda done: events.put_nowait((index, _outcome(done))))
        return work

    async def _generate(self, request: TextRequest, sink: Sink | None = None) -> Generation:
        """One choice through the tiers. A tier's refusal of a chat's prompt (its template
        raised, or the rendered prompt is past its context) names ``messages``: every other
        field was checked here before any tier saw the request, and a refusal crosses the
        link as a status and a text, without a ``param``."""
        try:
            return await self.plane.generate_text(request, timeout_s=None, sink=sink)
        except InvalidInput as exc:
            if not request.messages or getattr(exc, "param", None) is not None:
                raise
            raise FieldError("messages", str(exc)) from None

    async def _relay(
        self,
        response: web.StreamResponse,
        reply: Reply,
        event: tuple[int, Chunk | Generation | BaseException],
        events: asyncio.Queue[tuple[int, Chunk | Generation | BaseException]],
        count: int,
    ) -> list[Generation] | None:
        """Each event as its chunk until every prompt is answered (their results, in order),
        or one fails (an error event; None)."""
        results: dict[int, Generation] = {}
        while True:
            index, item = event
            if isinstance(item, Chunk):
                await _event(response, reply.piece(index, item))
            elif isinstance(item, Generation):
                results[index] = item
                await _event(response, reply.closing(index, item, alone=count == 1))
                if len(results) == count:
                    return [results[i] for i in range(count)]
            elif isinstance(item, StratusError):  # after the stream began: an error event, then the end
                await _event(response, error_of(item)[1])
                return None
            else:
                raise item
            event = await events.get()


def _outcome(work: asyncio.Task[Generation]) -> Generation | BaseException:
    if work.cancelled():
        return asyncio.CancelledError()
    return work.exception() or work.result()


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


async def _event(response: web.StreamResponse, payload: Mapping[str, Any]) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())
