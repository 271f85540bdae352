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

import dataclasses
import enum
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

# Open Inference Protocol tensors for text, as Triton's vLLM backend names them.
TEXT_INPUT: Final = "text_input"
TEXT_OUTPUT: Final = "text_output"
# Request parameters (OIP) / body fields (OpenAI) that shape a generation (see stratus.families.sampling).
MAX_TOKENS: Final = "max_tokens"
STREAM: Final = "stream"
# Response parameters on each streamed chunk, and on the final message.
TOKEN_LOGPROBS: Final = "stratus.token_logprobs"  # JSON list of floats, one per token in the chunk
TOKEN_MARGINS: Final = "stratus.token_margins"  # JSON list of floats or nulls
FINISH_REASON: Final = "stratus.finish_reason"  # "stop" or "length"; only on the final message
# On the final message, where the tier that generated knows them: its tokenizer's count of the
# prompt, and the tokens it generated for this answer (a stop string's and the end-of-text
# token included, as vLLM counts them; text cut at a stop string does not make them fewer).
PROMPT_TOKENS: Final = "stratus.prompt_tokens"
COMPLETION_TOKENS: Final = "stratus.completion_tokens"
FINAL: Final = "triton_final_response"  # Triton's decoupled-model flag, true on the last message


def token_count(value: object) -> int | None:
    """A count of tokens as a peer gave it, or None where it gave none (or no count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


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
    """What a request may set. ``temperature`` 0 (the default) decodes greedily, so an
    answer is reproducible and its confidence is what calibration measured; above 0 the
    tier samples (within ``top_p``), from ``seed`` where one is given."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")

    @property
    def sampled(self) -> bool:
        return self.temperature > 0.0

    def stopping_also_at(self, stops: Sequence[str]) -> GenerationParams:
        """These settings with a family's own stop strings added to the request's."""
        merged = tuple(dict.fromkeys((*self.stop, *stops)))
        return self if merged == self.stop else dataclasses.replace(self, stop=merged)


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """Tokens produced since the previous chunk; the final chunk says why it stopped."""

    tokens: tuple[Token, ...]
    finish_reason: str | None = None  # set on the final chunk only
    prompt_tokens: int | None = None  # on the final chunk, where the tier knows them
    completion_tokens: int | None = None

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

    def usage(self) -> dict[str, int]:
        """The token counts this chunk carries, as OIP int64 parameters."""
        counts = {PROMPT_TOKENS: self.prompt_tokens, COMPLETION_TOKENS: self.completion_tokens}
        return {key: value for key, value in counts.items() if value is not None}

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


class StopCut:
    """A stream of tokens cut at the first stop string, for what a client may be shown.

    The stop string and whatever follows it are never released. Text that could still turn
    out to be the start of a stop string (``"4"`` with a stop ``"48"``) is held back until
    the next tokens settle it, so a stop string split over two chunks is still found; the
    held tail is released by :meth:`finish` once the stream ended without one. Tokens are
    released whole (a token and its log-probability are one), except the token in which a
    stop string begins: its text is cut there and it stays, so the confidence of what is
    kept includes it.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held: list[Token] = []
        self.stopped = False

    def feed(self, tokens: Iterable[Token]) -> tuple[Token, ...]:
        """The tokens that may be shown now."""
        if self.stopped:
            return ()
        self._held.extend(tokens)
        if not self.stops:
            return self._release(len(self._held))
        text = "".join(t.text for t in self._held)
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            return self._cut_at(min(found))
        return self._release(_settled(self._held, len(text) - _open_prefix(text, self.stops, self._longest)))

    def finish(self) -> tuple[Token, ...]:
        """What was held back, now that no more tokens come."""
        return () if self.stopped else self._release(len(self._held))

    def _release(self, count: int) -> tuple[Token, ...]:
        released, self._held = tuple(self._held[:count]), self._held[count:]
        return released

    def _cut_at(self, position: int) -> tuple[Token, ...]:
        kept: list[Token] = []
        start = 0
        for token in self._held:
            if start >= position:
                break
            kept.append(
                token
                if start + len(token.text) <= position
                else dataclasses.replace(token, text=token.text[: position - start])
            )
            start += len(token.text)
        self._held = []
        return tuple(kept)


def _open_prefix(text: str, stops: Sequence[str], longest: int) -> int:
    """The length of the longest end of ``text`` that begins some stop string."""
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[-size:]
        if any(stop.startswith(tail) for stop in stops):
            return size
    return 0


def _settled(tokens: Sequence[Token], boundary: int) -> int:
    """How many of ``tokens``, from the first, end at or before ``boundary`` characters."""
    end = 0
    for count, token in enumerate(tokens):
        end += len(token.text)
        if end > boundary:
            return count
    return len(tokens)
