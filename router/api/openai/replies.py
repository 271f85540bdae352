"""The OpenAI API's answers, in the shapes vLLM uses: whole, or as server-sent chunks.

Kept apart from the server (:mod:`router.api.openai.api`) and the reading of bodies
(:mod:`router.api.openai.requests`): these functions only turn what the cascade answered into
JSON.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from router.cascade.generate import Generation
from stratus.families.generation import Chunk


class Reply:
    """OpenAI's response shapes, for completions or chat, whole or as SSE chunks.

    ``usage`` is on every whole answer; in a stream, where ``usage_chunk`` (the request's
    ``stream_options.include_usage``), every chunk has ``usage: null`` and a last one, with no
    choices, has the counts. With one prompt the ``stratus`` object is the answer's; with
    several, each choice has its own."""

    def __init__(
        self, *, model: str, chat: bool, logprobs: bool, usage_chunk: bool, per_prompt: int = 1
    ) -> None:
        self.model = model
        self.per_prompt = per_prompt  # ``n``: each prompt's choices, consecutive
        self.chat = chat
        self.logprobs = logprobs
        self.usage_chunk = usage_chunk
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": choices, **({"usage": None} if self.usage_chunk else {})}

    def whole(self, results: Sequence[Generation]) -> dict[str, Any]:
        choices = [self._choice(i, r, alone=len(results) == 1) for i, r in enumerate(results)]
        kind = "chat.completion" if self.chat else "text_completion"
        answer = {**self._head(kind), "choices": choices, "usage": usage(results, self.per_prompt)}
        return answer | ({"stratus": stratus_object(results[0])} if len(results) == 1 else {})

    def _choice(self, index: int, result: Generation, *, alone: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": _finish(result.finish_reason)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
            choice["logprobs"] = _chat_logprobs(result) if self.logprobs else None
        else:
            choice["text"] = result.text
            choice["logprobs"] = _completion_logprobs(result) if self.logprobs else None
        return choice if alone else {**choice, "stratus": stratus_object(result)}

    def opening(self) -> list[dict[str, Any]]:
        if not self.chat:
            return []
        return [self._chunk([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])]

    def piece(self, index: int, chunk: Chunk) -> dict[str, Any]:
        if self.chat:
            return self._chunk([{"index": index, "delta": {"content": chunk.text}, "finish_reason": None}])
        return self._chunk([{"index": index, "text": chunk.text, "logprobs": None, "finish_reason": None}])

    def closing(self, index: int, result: Generation, *, alone: bool) -> dict[str, Any]:
        finish = _finish(result.finish_reason)
        if self.chat:
            choice: dict[str, Any] = {"index": index, "delta": {}, "finish_reason": finish}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": finish}
        if not alone:
            return self._chunk([{**choice, "stratus": stratus_object(result)}])
        return {**self._chunk([choice]), "stratus": stratus_object(result)}

    def usage(self, results: Sequence[Generation]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage(results, self.per_prompt)}


def usage(results: Sequence[Generation], per_prompt: int = 1) -> dict[str, int | None]:
    """OpenAI's ``usage``, summed over the prompts: the answering tiers' own counts (the
    tokens of tiers climbed past are in ``stratus.tokens``). A prompt's ``n`` choices count
    its tokens once, as OpenAI's do (the first choice's count). A tier that did not count the
    prompt (a foreign cloud) leaves ``prompt_tokens`` and ``total_tokens`` null."""
    firsts = results[::per_prompt]
    known = [r.prompt_tokens for r in firsts if r.prompt_tokens is not None]
    prompt = sum(known) if len(known) == len(firsts) else None
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": None if prompt is None else prompt + completion,
    }


def model_entry(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "stratus"}


# What a chat's answer says where its tier did not render the conversation.
NO_TEMPLATE_NOTE = (
    "the answering variant has no chat template (its GGUF carries none, or its tier does not "
    "render conversations): its prompt was the last user message alone, and the earlier "
    "messages were not seen"
)


def stratus_object(result: Generation) -> dict[str, Any]:
    """Where the answer came from; for a chat, whether its tier rendered the conversation."""
    served = {
        "tier": result.tier.label,
        "agent": result.agent,
        "variant": result.variant,
        "path": [t.label for t in result.path],
        "confidence": round(result.confidence, 6),
        "degraded": result.degraded,
        "timings_ms": {t.label: round(ms, 3) for t, ms in result.timings_ms.items()},
        "tokens": {t.label: n for t, n in result.generated.items()},
    }
    if result.chat_template is None:
        return served
    note = {} if result.chat_template else {"note": NO_TEMPLATE_NOTE}
    return {**served, "chat_template": result.chat_template, **note}


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
