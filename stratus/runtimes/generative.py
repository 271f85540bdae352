"""Generative runtimes: a prompt in, tokens out, each with its log-probability.

A :class:`GenerativeRunner` is a generative variant loaded into one runtime. ``generate``
decodes on the calling (executor) thread and hands each token to ``emit`` as it is
produced; ``emit`` returns False to stop at once (the router cancelled the Work, or the
answer can no longer be accepted). Decoding is greedy unless the request asks for a
temperature: then the runtime samples (within ``top_p``, from ``seed`` where given), and
each token's log-probability is still the model's own (before temperature and ``top_p``),
so a confidence means the same whether an answer was chosen or drawn. A stop string ends
the generation once it is made; its text is still emitted (the caller cuts it, see
:class:`~stratus.families.generation.StopCut`), so one split over several tokens is never lost.
Runtimes, best first where both are installed:

* ``openvino_genai`` (wheels for every platform; a GGUF file in F16): per-token
  log-probabilities of the chosen tokens, no alternatives (so no top-2 margin);
* ``llama_cpp`` (``llama-cpp-python``, the ``llama`` extra, which compiles on install):
  GGUF, stepped token by token from the logits (sampled here, with numpy), so with the
  top-2 margin.

Each runtime's runner is in its own module (``openvino_genai_rt.py``, ``llama_cpp_rt.py``);
:func:`stratus.runtimes.generative_order` says which comes first on each tier, and
:func:`stratus.runtimes.load_generator` loads a variant into the first that takes it.

A chat request's conversation is rendered here, by :meth:`GenerativeRunner.converse`, with
the chat template the variant's own GGUF carries (:mod:`stratus.runtimes.chat_template`, the
same for both runtimes), or, where it carries none, replaced by the last user message.
"""


from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from stratus.errors import InvalidInput, RuntimeUnavailable
from stratus.families.chat import Message
from stratus.families.generation import GenerationParams, StopCut, Token
from stratus.families.spec import VariantSpec
from stratus.runtimes.base import Availability, LoadOptions, RuntimeDescription
from stratus.runtimes.chat_template import ChatTemplate

Emit = Callable[[Token], bool]


@dataclass(frozen=True, kw_only=True)
class Finished:
    """How a generation ended ("stop", "length", or "cancelled" when ``emit`` said stop),
    how many tokens the runtime's tokenizer made of the prompt, and whether that prompt was
    a conversation rendered by the model's chat template."""

    reason: str
    prompt_tokens: int
    templated: bool = False


class GenerativeRunner(abc.ABC):
    runtime: ClassVar[str]
    formats: ClassVar[tuple[str, ...]]
    parallel: ClassVar[int] = 1  # generations it runs at once to good effect
    kv_cache_precision: str = "f32"  # what the runtime keeps its KV cache in, as loaded

    def __init__(self, *, variant: VariantSpec, path: Path, options: LoadOptions, context: int) -> None:
        self.variant = variant
        self.path = path
        self.options = options
        self.context = context
        self.chat: ChatTemplate | None = None  # the GGUF's, read once the runtime took the file

    @staticmethod
    @abc.abstractmethod
    def library() -> Any:
        """The runtime's Python library, imported; RuntimeUnavailable when it is not installed."""

    @classmethod
    def availability(cls) -> Availability:
        try:
            cls.library()
        except RuntimeUnavailable as exc:
            return Availability(available=False, reason=str(exc))
        return Availability(available=True)

    @abc.abstractmethod
    def generate(
        self, prompt: str, params: GenerationParams, emit: Emit, *, special: bool = False
    ) -> Finished:
        """The tokens for ``prompt`` through ``emit``, up to a stop string's last token.

        ``special``: the prompt was rendered by a chat template, so the text of a special
        token in it (``<s>``) is that token, and the tokenizer adds no BOS of its own (the
        template writes it where the model wants it), as transformers tokenizes a rendered
        chat; a plain prompt's text is only text."""

    def converse(
        self, conversation: Sequence[Message], fallback: str, params: GenerationParams, emit: Emit
    ) -> Finished:
        """A chat request's generation: the conversation as this model's chat template
        renders it (on the calling executor thread: a long one is no work for the event
        loop), or, where the GGUF carries none, ``fallback`` as a plain prompt."""
        if self.chat is None or not conversation:
            return self.generate(fallback, params, emit)
        prompt = self.chat.render(conversation)
        return dataclasses.replace(self.generate(prompt, params, emit, special=True), templated=True)

    def describe(self) -> RuntimeDescription:
        return RuntimeDescription(
            runtime=self.runtime,
            device="CPU",
            precisions=(self.variant.precision,),
            dynamic_batch=False,
            kv_cache=self.kv_cache_precision,
        )

    def check_context(self, prompt_tokens: int, params: GenerationParams) -> None:
        """Refuse a prompt that, with the tokens asked for, would not fit the context."""
        if prompt_tokens + params.max_tokens > self.context:
            raise InvalidInput(
                f"the prompt is {prompt_tokens} tokens; with max_tokens {params.max_tokens} it exceeds "
                f"the context of {self.context} tokens"
            )

    def tokens(self, prompt: str, params: GenerationParams) -> list[Token]:
        """Every token of a whole generation, cut at its stop string (calibration,
        verification: nothing streams)."""
        made: list[Token] = []
        cut = StopCut(params.stop)

        def keep(token: Token) -> bool:
            made.extend(cut.feed((token,)))
            return True

        self.generate(prompt, params, keep)
        return made + list(cut.finish())

    def warmup(self) -> None:
        self.generate("1+1=", GenerationParams(max_tokens=1), lambda token: True)

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        pass
