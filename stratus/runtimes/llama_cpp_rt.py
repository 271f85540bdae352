"""llama.cpp (``llama-cpp-python``, the ``llama`` extra) as a generative runtime.

It steps token by token from the logits and chooses each token here
(:mod:`stratus.runtimes.decoding`), so each step has the top-2 margin too.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from stratus.errors import ModelLoadError, RuntimeUnavailable
from stratus.families.generation import GenerationParams, Token
from stratus.families.spec import VariantSpec
from stratus.runtimes.base import LoadOptions
from stratus.runtimes.decoding import sampler, stop_at
from stratus.runtimes.generative import Emit, Finished, GenerativeRunner

_GGML_F32 = 0  # ggml's type id of float32


class LlamaCppRunner(GenerativeRunner):
    """llama.cpp through ``llama-cpp-python``, stepped one token at a time: each token chosen
    here from the logits (greedily, or sampled with numpy), so each step gives the chosen
    token's log-probability and the top-2 margin (``first_margin`` works here). One
    generation at a time per variant."""

    runtime = "llama_cpp"
    formats = ("gguf",)

    def __init__(self, *, variant: VariantSpec, path: Path, options: LoadOptions, context: int) -> None:
        super().__init__(variant=variant, path=path, options=options, context=context)
        llama_cpp = _llama_cpp()
        try:
            self._llama = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=context,
                n_threads=options.threads_per_inference,
                n_batch=context,
                logits_all=True,
                type_k=_GGML_F32,  # an F32 KV cache, as for OpenVINO GenAI: an F16 one moves
                type_v=_GGML_F32,  # log-probabilities enough to flip escalation decisions
                verbose=False,
            )
        except Exception as exc:
            raise ModelLoadError(f"llama_cpp cannot load {path}: {exc}") from None
        self._eos = self._llama.token_eos()
        self._lock = threading.Lock()

    @staticmethod
    def library() -> Any:
        return _llama_cpp()

    def generate(
        self, prompt: str, params: GenerationParams, emit: Emit, *, special: bool = False
    ) -> Finished:
        prompt_ids = self._llama.tokenize(prompt.encode("utf-8"), add_bos=False, special=special)
        self.check_context(len(prompt_ids), params)
        with self._lock:
            self._llama.reset()
            self._llama.eval(prompt_ids)
            return Finished(reason=self._drive(emit, params), prompt_tokens=len(prompt_ids))

    def _drive(self, emit: Emit, params: GenerationParams) -> str:
        choose = sampler(params)
        ids: list[int] = []
        text = ""
        while len(ids) < params.max_tokens:
            token_id, token = choose(self._llama.scores[self._llama.n_tokens - 1])
            if token_id == self._eos:
                return (
                    "stop"
                    if emit(Token(text="", logprob=token.logprob, margin=token.margin))
                    else "cancelled"
                )
            ids.append(token_id)
            decoded = self._llama.detokenize(ids).decode("utf-8", "ignore")
            piece, text = decoded[len(text) :], decoded
            if not emit(Token(text=piece, logprob=token.logprob, margin=token.margin)):
                return "cancelled"
            if stop_at(text, params.stop) is not None:
                return "stop"
            self._llama.eval([token_id])
        return "length"


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise RuntimeUnavailable(
            f"llama-cpp-python is not installed ({exc}); pip install -e '.[llama]' in the checkout (or 'stratus-router[llama]')"
        ) from None
    return llama_cpp
