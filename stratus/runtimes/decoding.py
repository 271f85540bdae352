"""How a generative runtime chooses each token and says why a generation ended.

llama.cpp hands over the logits of each step and leaves the choice here: greedy, or drawn at
the request's temperature within its ``top_p`` (numpy, from the request's seed where given).
Either way the chosen token is scored by the model's own distribution (before temperature and
``top_p``), with the step's top-1 minus top-2 probability as its margin, so a confidence
means the same whether the answer was chosen or drawn. OpenVINO GenAI samples itself and
takes only the seed (:func:`seed_of`) and the end of a generation (:func:`ended`) from here.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

from stratus.families.generation import GenerationParams, Token


def log_softmax(logits: Any) -> Any:
    import numpy as np

    values = np.asarray(logits, dtype=np.float64)
    shifted = values - values.max()
    return shifted - np.log(np.exp(shifted).sum())


def greedy_step(logits: Any) -> tuple[int, Token]:
    """The most likely next token, its log-probability, and its lead over the runner-up."""
    import numpy as np

    logprobs = log_softmax(logits)
    return int(np.argmax(logprobs)), scored(logprobs, int(np.argmax(logprobs)))


def scored(logprobs: Any, chosen: int) -> Token:
    """The chosen token's log-probability, and the step's top-1 minus top-2 probability."""
    import numpy as np

    second, first = np.partition(logprobs, -2)[-2:]
    return Token(text="", logprob=float(logprobs[chosen]), margin=float(np.exp(first) - np.exp(second)))


def sampled_step(logits: Any, params: GenerationParams, rng: Any) -> tuple[int, Token]:
    """A token drawn from the logits at ``temperature``, among the fewest most likely ones
    whose probabilities reach ``top_p``; scored by the model's own distribution."""
    import numpy as np

    weights = np.exp(log_softmax(np.asarray(logits, dtype=np.float64) / params.temperature))
    order = np.argsort(-weights, kind="stable")
    kept = order[: int(np.searchsorted(np.cumsum(weights[order]), params.top_p * weights.sum())) + 1]
    chosen = int(rng.choice(kept, p=weights[kept] / weights[kept].sum()))
    return chosen, scored(log_softmax(logits), chosen)


def sampler(params: GenerationParams) -> Callable[[Any], tuple[int, Token]]:
    """Each step's choice for these settings: greedy, or a draw from a generator of its own."""
    if not params.sampled:
        return greedy_step
    import numpy as np

    rng = np.random.default_rng(seed_of(params))
    return lambda logits: sampled_step(logits, params, rng)


def seed_of(params: GenerationParams) -> int:
    """The request's seed as a runtime takes it (unsigned), or a fresh one."""
    return params.seed % (1 << 64) if params.seed is not None else secrets.randbits(63)


def stop_at(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string starts in ``text``, if one is there."""
    found = [text.find(stop) for stop in stops if stop and stop in text]
    return min(found) if found else None


def ended(ids: list[int], max_tokens: int, eos: int) -> str:
    """Why a finished generation ended: "length" only where it was cut at ``max_tokens``; a
    last token that is the end of the sequence is a stop, even as the max_tokens-th (the
    pipeline counts it among the generated tokens: "198</s>" in 4 was reported as cut)."""
    if ids and ids[-1] == eos:
        return "stop"
    return "length" if len(ids) >= max_tokens else "stop"
