"""The cloud's generative tier: a vLLM server (or any OpenAI-compatible one) behind the gateway.

The gateway forwards a generative escalation to the server's ``/v1/completions`` (greedy
unless the request asks for a temperature, with the top-2 log-probabilities of each step,
and the server's token counts: ``usage``) and turns its answer, whole or streamed as
server-sent events, into :class:`~stratus.families.generation.Chunk`\\ s. The server's HTTP errors
become Stratus errors here, once. Its ``/health`` is the gateway's readiness and its
``vllm:num_requests_waiting``/``running`` gauges are the gateway's queue: both are polled
every second, so readiness is answered without I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import aiohttp

from cloud_gateway.openai_wire import (
    SseDecoder,
    UpstreamLoad,
    chunk_from_choice,
    completion_body,
    error_message,
    event_chunk,
    parse_event,
    parse_metrics,
    usage_of,
    with_usage,
)
from stratus.convert.errors import error_from_http
from stratus.errors import (
    ConfigError,
    DeadlineExceeded,
    Unavailable,
)
from stratus.families.generation import Chunk, GenerationParams
from stratus.obs.stats import LatencyWindow

log = logging.getLogger("stratus.upstream")
_T = TypeVar("_T")

# Readiness: vLLM's /health; servers without one (llama.cpp's) answer /v1/models while they serve.
HEALTH_PATH: Final = "/health"
MODELS_PATH: Final = "/v1/models"
# The most the gateway reads of one upstream answer: a whole completion, an error body, the
# /metrics page; and of one streamed event. A server past them is answering wrongly.
MAX_BODY_BYTES: Final = 4 << 20


@dataclass(frozen=True, kw_only=True)
class UpstreamSettings:
    """Where the server is, which of its models to ask, and how long to wait for it."""

    url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str
    timeout_s: float = 120.0  # a request that brings no deadline of its own
    connect_timeout_s: float = 5.0
    poll_interval_s: float = 1.0
    poll_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"upstream URL must start with http:// or https://, got {self.url!r}")
        if min(self.timeout_s, self.connect_timeout_s, self.poll_interval_s, self.poll_timeout_s) <= 0:
            raise ConfigError("upstream timeouts and poll interval must be > 0")

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url.removesuffix("/v1")


async def served_model(url: str, *, timeout_s: float = 10.0) -> str:
    """The first model an OpenAI-compatible server lists at ``/v1/models``."""
    base = UpstreamSettings(url=url, model="").base
    try:
        async with (
            aiohttp.ClientSession() as session,
            asyncio.timeout(timeout_s),
            session.get(base + "/v1/models") as response,
        ):
            if response.status != 200:
                raise error_from_http(response.status, error_message(await _capped(response)))
            models = (await response.json())["data"]
            return str(models[0]["id"])
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise Unavailable(
            f"cannot ask {base} which model it serves (give --upstream-model): {exc!r}"
        ) from None
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise Unavailable(f"{base}/v1/models lists no model (give --upstream-model): {exc!r}") from None


# --- the client ---------------------------------------------------------------------------------


class OpenAIUpstream:
    """An asyncio client of one OpenAI-compatible server, on the caller's event loop.

    ``start()`` checks the server once and then polls its health and load every
    ``poll_interval_s``; ``healthy`` and ``load`` are the latest answers. A request that
    cannot reach the server marks it unhealthy at once, without waiting for the poll.
    """

    def __init__(self, settings: UpstreamSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self.healthy = False
        self._health_path = HEALTH_PATH
        self.load = UpstreamLoad()
        self.latency = LatencyWindow()
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.connect_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, raise_for_status=False)
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever(), name="stratus-upstream-poll")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise Unavailable("the upstream client is not started")
        return self._session

    # health and load

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            await self.poll()

    async def poll(self) -> None:
        """Ask for health and ``/metrics`` once; remember what they said."""
        was = self.healthy
        self.healthy = await self._healthy()
        if self.healthy != was:
            log.info("upstream %s is %s", self.settings.base, "healthy" if self.healthy else "unhealthy")
        text = await self._get("/metrics") if self.healthy else None
        self.load = parse_metrics(text) if text is not None else UpstreamLoad()

    async def _healthy(self) -> bool:
        """vLLM's ``/health``; a server without one (404: llama.cpp's, LiteLLM's) is healthy
        while it lists its models at ``/v1/models``, which is then asked from here on."""
        status, _ = await self._fetch(self._health_path)
        if status == 404 and self._health_path == HEALTH_PATH:
            log.info("upstream %s has no %s: %s tells its health", self.settings.base, HEALTH_PATH, MODELS_PATH)
            self._health_path = MODELS_PATH
            status, _ = await self._fetch(self._health_path)
        return status == 200

    async def _get(self, path: str) -> str | None:
        """The body of a 200 answer; None for anything else, failures included."""
        status, body = await self._fetch(path)
        return body if status == 200 else None

    async def _fetch(self, path: str) -> tuple[int | None, str | None]:
        """(status, body of a 200 answer); (None, None) when the server cannot be reached."""
        try:
            async with asyncio.timeout(self.settings.poll_timeout_s):
                async with self.session.get(self.settings.base + path) as response:
                    body = (await _capped(response)).decode(errors="replace") if response.status == 200 else None
                    return response.status, body
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None, None

    # generation

    async def complete(self, prompt: str, params: GenerationParams, *, timeout_s: float | None) -> Chunk:
        """The whole answer as one chunk (with its finish reason)."""
        deadline = self._deadline(timeout_s)
        started = self._clock()
        body = completion_body(self.settings.model, prompt, params, stream=False)
        async with self._request(body, deadline) as response:
            data = await self._read(deadline, _capped(response))
        try:
            answer = json.loads(data)
            chunk = chunk_from_choice(answer["choices"][0])
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise Unavailable(f"upstream answered something that is not a completion: {exc!r}") from None
        self.latency.add((self._clock() - started) * 1000.0)
        prompt_tokens, completion_tokens = usage_of(answer)
        return dataclasses.replace(chunk, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)

    async def stream(
        self, prompt: str, params: GenerationParams, *, timeout_s: float | None
    ) -> AsyncIterator[Chunk]:
        """The answer as it is generated: one chunk per event, the last with its finish reason."""
        deadline = self._deadline(timeout_s)
        started = self._clock()
        body = completion_body(self.settings.model, prompt, params, stream=True)
        async with self._request(body, deadline) as response:
            made = 0
            async for chunk in self._chunks(response, deadline):
                made += len(chunk.tokens)
                if made > params.max_tokens + 1:  # the tokens asked for, and an end-of-text one
                    raise Unavailable(f"upstream sent {made} tokens for max_tokens {params.max_tokens}")
                yield chunk
        self.latency.add((self._clock() - started) * 1000.0)

    async def _chunks(self, response: aiohttp.ClientResponse, deadline: float) -> AsyncIterator[Chunk]:
        """Chunks up to the one with the finish reason, which is held until the stream ends
        (``[DONE]``) so that it carries the counts of the usage event; what comes after it is
        read (so that the connection can be used again) but not yielded."""
        decoder, final = SseDecoder(), None
        usage: Mapping[str, Any] = {}  # the last event with a usage
        while line := await self._read(deadline, response.content.readline()):
            data = decoder.feed(line.decode(errors="replace"))
            if data is None:
                continue
            if data.strip() == "[DONE]":
                break
            event = parse_event(data)
            usage = event if event.get("usage") else usage
            chunk = event_chunk(event)
            if final is None and chunk is not None and chunk.finish_reason is None:
                yield chunk
            elif final is None and chunk is not None:
                final = chunk
        else:
            if final is None:
                raise Unavailable("upstream ended the stream before its final event")
        # every stream ends with a final chunk, even a server's that forgot (its [DONE] ends it)
        yield with_usage(final or Chunk(tokens=(), finish_reason="stop"), usage)

    def _deadline(self, timeout_s: float | None) -> float:
        return self._clock() + (self.settings.timeout_s if timeout_s is None else timeout_s)

    @contextlib.asynccontextmanager
    async def _request(
        self, body: Mapping[str, Any], deadline: float
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST a completion; a non-200 answer is raised as the error it maps to."""
        url = self.settings.base + "/v1/completions"
        async with contextlib.AsyncExitStack() as stack:
            response = await self._read(
                deadline, stack.enter_async_context(self.session.post(url, json=body))
            )
            if response.status != 200:
                raise error_from_http(
                    response.status, error_message(await self._read(deadline, _capped(response)))
                )
            yield response

    async def _read(self, deadline: float, step: Awaitable[_T]) -> _T:
        """Await one I/O step within the deadline, mapping transport failures."""
        remaining = deadline - self._clock()
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                return await step
        except TimeoutError:
            if asyncio.iscoroutine(step):
                step.close()
            raise DeadlineExceeded(
                f"upstream {self.settings.base} (model {self.settings.model}) did not answer in time"
            ) from None
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, ConnectionError) as exc:
            self.healthy = False
            raise Unavailable(f"upstream {self.settings.base} unreachable: {exc}") from None
        except aiohttp.ClientError as exc:
            raise Unavailable(f"upstream {self.settings.base}: {type(exc).__name__}: {exc}") from None
        except ValueError as exc:  # aiohttp's "Chunk too big": a line past its buffer
            raise Unavailable(f"upstream {self.settings.base} sent a line too long: {exc}") from None


async def _capped(response: aiohttp.ClientResponse) -> bytes:
    """The whole body, refused (Unavailable) past MAX_BODY_BYTES before more is held."""
    cap = MAX_BODY_BYTES
    parts, size = [], 0
    async for part in response.content.iter_chunked(64 * 1024):
        size += len(part)
        if size > cap:
            raise Unavailable(f"upstream {response.url.host} answered more than {cap} bytes")
        parts.append(part)
    return b"".join(parts)


