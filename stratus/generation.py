"""Generation: what a generative variant produces, how sure it is, and the chunks that carry it.

A generative family answers a prompt with text, token by token. Each token comes with the
log-probability the model gave it, and where the runtime shows alternatives, the margin
between its top two choices at that step. From those, one number in [0, 1] says how sure
the answer is, as the family's config chooses:

* ``mean_logprob``: exp(mean token log-probability): the geometric mean token probability;
* ``min_logprob``: exp(min token log-probability): the least sure token's probability;
* ``first_margin``: the first token's top-1 minus top-2 probability (where known).

Thresholds on these are chosen by ``stratus models calibrate`` like a classifier's, on
labelled prompts. :class:`RunningConfidence` follows an answer while it is generated, so
the router can give up on a lower tier as soon as its answer can no longer be accepted
(a ``min_logprob`` below the threshold never rises again; a ``first_margin`` is known
after one token) and cancel the rest of that generation.

Chunks travel the same way whoever generates: an agent sends them on its AgentLink as
``Chunk`` messages; the cloud gateway streams them over the Open Inference Protocol's
``ModelStreamInfer`` (``text_output`` plus the parameters named below), as Triton's vLLM
backend does. A stream ends with one final message that carries the finish reason.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

# Open Inference Protocol tensors for text, as Triton's vLLM backend names them.
TEXT_INPUT: Final = "text_input"
TEXT_OUTPUT: Final = "text_output"
# Request parameters (OIP) / body fields (OpenAI) that shape a generation.
MAX_TOKENS: Final = "max_tokens"
STREAM: Final = "stream"
# Response parameters on each streamed chunk, and on the final message.
TOKEN_LOGPROBS: Final = "stratus.token_logprobs"  # JSON list of floats, one per token in the chunk
TOKEN_MARGINS: Final = "stratus.token_margins"  # JSON list of floats or nulls
FINISH_REASON: Final = "stratus.finish_reason"  # "stop" or "length"; only on the final message
FINAL: Final = "triton_final_response"  # Triton's decoupled-model flag, true on the last message


class GenerationMethod(enum.StrEnum):
    MEAN_LOGPROB = "mean_logprob"
    MIN_LOGPROB = "min_logprob"
    FIRST_MARGIN = "first_margin"


@dataclass(frozen=True, kw_only=True)
class Token:
    """One generated token: its text, its log-probability, and its top-2 margin if known."""

    text: str
    logprob: float
    margin: float | None = None


@dataclass(frozen=True, kw_only=True)
class GenerationParams:
    """What a request may set: greedy decoding always (answers must be reproducible)."""

    max_tokens: int
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """Tokens produced since the previous chunk; the final chunk says why it stopped."""

    tokens: tuple[Token, ...]
    finish_reason: str | None = None  # set on the final chunk only

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    def parameters(self) -> dict[str, str]:
        """The chunk's log-probabilities and margins as OIP string parameters."""
        params = {
            TOKEN_LOGPROBS: json.dumps([round(t.logprob, 6) for t in self.tokens]),
            TOKEN_MARGINS: json.dumps(
                [None if t.margin is None else round(t.margin, 6) for t in self.tokens]
            ),
        }
        if self.finish_reason is not None:
            params[FINISH_REASON] = self.finish_reason
        return params

    @classmethod
    def from_parts(cls, text: str, parameters: Mapping[str, str], *, final: bool) -> Chunk:
        """Rebuild a chunk from OIP text and parameters (the text is split over its tokens:
        only the first carries it, since per-token text is not kept on the wire)."""
        logprobs = [float(v) for v in json.loads(parameters.get(TOKEN_LOGPROBS, "[]"))]
        margins_raw: list[Any] = json.loads(parameters.get(TOKEN_MARGINS, "[]")) or [None] * len(logprobs)
        margins = [None if m is None else float(m) for m in margins_raw]
        tokens = tuple(
            Token(text=text if i == 0 else "", logprob=lp, margin=margins[i] if i < len(margins) else None)
            for i, lp in enumerate(logprobs)
        )
        if not tokens and text:
            tokens = (Token(text=text, logprob=0.0),)
        reason = parameters.get(FINISH_REASON) if final else None
        return cls(tokens=tokens, finish_reason=reason or ("stop" if final else None))


@dataclass
class RunningConfidence:
    """An answer's confidence as its tokens arrive, and whether it can still be accepted."""

    method: GenerationMethod
    count: int = 0
    total: float = 0.0
    lowest: float = 0.0
    first_margin: float | None = None
    tokens: list[Token] = field(default_factory=list)

    def add(self, tokens: Iterable[Token]) -> None:
        for token in tokens:
            if self.count == 0:
                self.first_margin = token.margin
            self.count += 1
            self.total += token.logprob
            self.lowest = min(self.lowest, token.logprob)
            self.tokens.append(token)

    @property
    def value(self) -> float:
        """The confidence of what has been generated so far, in [0, 1]."""
        if self.count == 0:
            return 0.0
        if self.method is GenerationMethod.MIN_LOGPROB:
            return math.exp(self.lowest)
        if self.method is GenerationMethod.FIRST_MARGIN:
            if self.first_margin is not None:
                return self.first_margin
            return math.exp(self.tokens[0].logprob)  # no alternatives known: the first token's probability
        return math.exp(self.total / self.count)

    def hopeless(self, threshold: float) -> bool:
        """True once no continuation can bring the confidence back to ``threshold``.

        The minimum never rises and the first token's margin never changes, so both are
        final at once. A mean could still rise with more sure tokens, so it is judged only
        at the end (the caller compares ``value`` then).
        """
        if self.count == 0:
            return False
        if self.method is GenerationMethod.MIN_LOGPROB:
            return math.exp(self.lowest) < threshold
        if self.method is GenerationMethod.FIRST_MARGIN:
            return self.value < threshold
        return False


def confidence_of(tokens: Sequence[Token], method: GenerationMethod) -> float:
    running = RunningConfidence(method)
    running.add(tokens)
    return running.value
