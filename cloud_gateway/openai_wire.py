"""The OpenAI completions API as the cloud gateway speaks it to vLLM (or any compatible server):
the request body, a choice read as a chunk of tokens, server-sent events, the server's error
words and its load gauges. Pure: :mod:`cloud_gateway.upstream` does the I/O.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from stratus.convert.errors import error_from_http
from stratus.errors import StratusError, Unavailable
from stratus.families.generation import Chunk, GenerationParams, Token, token_count

WAITING: Final = "vllm:num_requests_waiting"
RUNNING: Final = "vllm:num_requests_running"
MAX_EVENT_BYTES: Final = 1 << 20
# Alternatives asked for at each step: the top two give the margin p1 - p2.
TOP_LOGPROBS: Final = 2
_SAMPLE: Final = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")


@dataclass(frozen=True, kw_only=True)
class UpstreamLoad:
    """Requests the server holds, as its last /metrics said."""

    waiting: int = 0
    running: int = 0

    @property
    def queue(self) -> int:
        return self.waiting + self.running


def completion_body(model: str, prompt: str, params: GenerationParams, *, stream: bool) -> dict[str, Any]:
    """The request's settings, with each step's top-2 log-probabilities (vLLM's are the raw
    model's, before temperature and top_p), and, streamed, the token counts at the end.
    Stop strings stay in the text (vLLM's ``include_stop_str_in_output``): the gateway cuts
    them, so that their tokens are not left behind with no text."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "logprobs": TOP_LOGPROBS,
        "stream": stream,
    }
    if params.sampled:
        body["top_p"] = params.top_p
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
        body["include_stop_str_in_output"] = True
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def usage_of(data: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(prompt tokens, completion tokens) of an answer's ``usage``, where it has one."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return None, None
    return token_count(usage.get("prompt_tokens")), token_count(usage.get("completion_tokens"))


def chunk_from_choice(choice: Mapping[str, Any]) -> Chunk:
    """One completion choice (a whole answer, or one streamed event) as a chunk of tokens."""
    text = str(choice.get("text") or "")
    logprobs = choice.get("logprobs") or {}
    values = [float(v) for v in logprobs.get("token_logprobs") or []]
    tops = logprobs.get("top_logprobs") or [None] * len(values)
    texts = token_texts(text, logprobs.get("tokens") or [], logprobs.get("text_offset") or [], len(values))
    tokens = tuple(
        Token(text=texts[i], logprob=values[i], margin=margin(tops[i] if i < len(tops) else None))
        for i in range(len(values))
    )
    if not tokens and text:  # a server that sent text without log-probabilities
        tokens = (Token(text=text, logprob=0.0),)
    reason = choice.get("finish_reason")
    return Chunk(tokens=tokens, finish_reason=str(reason) if reason else None)


def token_texts(text: str, tokens: Sequence[str], offsets: Sequence[int], count: int) -> list[str]:
    """Each token's share of ``text``; the shares always join back into ``text``.

    vLLM's token strings include special tokens that the text leaves out (``<s>``), and its
    offsets count them, so neither can be used blindly: the tokens are laid along the text
    where they match it (a special token gets nothing), and where they do not cover it
    (bytes of a character split over tokens), the text is cut at the offsets instead.
    """
    if count == 0:
        return []
    if len(tokens) == count:
        aligned = _aligned(text, tokens)
        if aligned is not None:
            return aligned
    if len(offsets) != count:
        return [text] + [""] * (count - 1)
    base = int(offsets[0])
    bounds = [min(max(int(o) - base, 0), len(text)) for o in offsets[1:]]
    return [text[s:e] if e > s else "" for s, e in zip([0, *bounds], [*bounds, len(text)], strict=True)]


def _aligned(text: str, tokens: Sequence[str]) -> list[str] | None:
    shares, cursor = [], 0
    for token in tokens:
        matches = bool(token) and text.startswith(token, cursor)
        shares.append(token if matches else "")
        cursor += len(token) if matches else 0
    return shares if cursor == len(text) else None


def margin(top: Mapping[str, float] | None) -> float | None:
    """Top-1 minus top-2 probability at one step; None where fewer than two are known
    (two token ids that decode to the same text collapse into one key)."""
    if not top or len(top) < 2:
        return None
    first, second = sorted((float(v) for v in top.values()), reverse=True)[:2]
    return math.exp(first) - math.exp(second)


def parse_metrics(text: str) -> UpstreamLoad:
    """vLLM's waiting and running gauges from Prometheus text, summed over label sets
    (one per engine or model); absent gauges count as zero."""
    totals = {WAITING: 0.0, RUNNING: 0.0}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in totals:
            continue
        with contextlib.suppress(ValueError):
            value = float(match.group(3))
            if math.isfinite(value):
                totals[match.group(1)] += value
    return UpstreamLoad(waiting=round(totals[WAITING]), running=round(totals[RUNNING]))


class SseDecoder:
    """Server-sent events, line by line: the data of each complete event, of at most
    MAX_EVENT_BYTES (an upstream that never ends an event is an error, not a growing list)."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._size = 0

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            data, self._data, self._size = self._data, [], 0
            return "\n".join(data) if data else None
        if line.startswith("data:"):
            self._size += len(line)
            if self._size > MAX_EVENT_BYTES:
                raise Unavailable(f"upstream sent an event of more than {MAX_EVENT_BYTES} bytes")
            self._data.append(line[5:].removeprefix(" "))
        return None  # comments (":") and other fields (event:, id:, retry:) carry nothing here


def error_message(body: bytes | str) -> str:
    """The server's own words: OpenAI's ``{"error": {"message"}}``, vLLM's older
    ``{"message"}``, or the body as text."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:2000] or "(no message)"
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
    return text.strip()[:2000]


def _error_in_event(data: Mapping[str, Any]) -> StratusError | None:
    """vLLM reports an error that happens after a stream began as one more event."""
    error = data.get("error")
    if error is None:
        return None
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) else 500
    return error_from_http(status, error_message(json.dumps(data)))


def parse_event(data: str) -> dict[str, Any]:
    try:
        event = json.loads(data)
    except ValueError:
        raise Unavailable(f"upstream sent an event that is not JSON: {data[:200]!r}") from None
    if not isinstance(event, dict):
        raise Unavailable(f"upstream sent an event that is not an object: {data[:200]!r}")
    error = _error_in_event(event)
    if error is not None:
        raise error
    return event


def event_chunk(event: Mapping[str, Any]) -> Chunk | None:
    choices = event.get("choices") or []
    return chunk_from_choice(choices[0]) if choices else None  # a usage-only event has none


def with_usage(chunk: Chunk, event: Mapping[str, Any]) -> Chunk:
    """``chunk`` with the counts of ``event``'s usage, where it has one."""
    prompt_tokens, completion_tokens = usage_of(event)
    if prompt_tokens is None and completion_tokens is None:
        return chunk
    return dataclasses.replace(chunk, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
