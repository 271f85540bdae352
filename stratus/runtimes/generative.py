"""Generative runtimes: a prompt in, tokens out, each with its log-probability.

A :class:`GenerativeRunner` is a generative variant loaded into one runtime. ``generate``
runs greedy decoding on the calling (executor) thread and hands each token to ``emit`` as
it is produced; ``emit`` returns False to stop at once (the router cancelled the Work, or
the answer can no longer be accepted). Runtimes, best first where both are installed:

* ``openvino_genai`` (wheels for every platform; a GGUF file in F16): per-token
  log-probabilities of the chosen tokens, no alternatives (so no top-2 margin);
* ``llama_cpp`` (``llama-cpp-python``, an optional extra that compiles on install): GGUF,
  with top-2 alternatives.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from stratus.errors import InvalidInput, ModelLoadError, NotFound, RuntimeUnavailable
from stratus.generation import GenerationParams, Token
from stratus.repository import FamilySpec, VariantSpec
from stratus.runtimes.base import Availability, LoadOptions, RuntimeDescription

Emit = Callable[[Token], bool]


class GenerativeRunner(abc.ABC):
    runtime: ClassVar[str]
    formats: ClassVar[tuple[str, ...]]

    def __init__(self, *, variant: VariantSpec, path: Path, options: LoadOptions, context: int) -> None:
        self.variant = variant
        self.path = path
        self.options = options
        self.context = context

    @classmethod
    @abc.abstractmethod
    def availability(cls) -> Availability: ...

    @abc.abstractmethod
    def generate(self, prompt: str, params: GenerationParams, emit: Emit) -> str:
        """Greedy tokens for ``prompt`` through ``emit``; the finish reason ("stop", "length",
        or "cancelled" when ``emit`` said stop)."""

    def describe(self) -> RuntimeDescription:
        return RuntimeDescription(
            runtime=self.runtime, device="CPU", precisions=(self.variant.precision,), dynamic_batch=False
        )

    def warmup(self) -> None:
        self.generate("1+1=", GenerationParams(max_tokens=1), lambda token: True)

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        pass


class OpenVinoGenAiRunner(GenerativeRunner):
    """OpenVINO GenAI's continuous-batching pipeline, which reports each chosen token's
    log-probability as it steps. One generation at a time per variant: the pipeline is
    stepped by the thread that asked (the agent sizes its executor to match)."""

    runtime = "openvino_genai"
    formats = ("gguf",)

    def __init__(self, *, variant: VariantSpec, path: Path, options: LoadOptions, context: int) -> None:
        super().__init__(variant=variant, path=path, options=options, context=context)
        genai = _genai()
        scheduler = genai.SchedulerConfig()
        scheduler.cache_size = 1  # GB of KV cache: tiny models, few requests at once
        try:
            # An f32 KV cache: the default u8 one moves log-probabilities by up to 2e-2 here and
            # flips near-ties; these models' caches are tiny either way.
            self._pipe = genai.ContinuousBatchingPipeline(str(path), scheduler, "CPU", {"KV_CACHE_PRECISION": "f32"})
        except Exception as exc:
            raise ModelLoadError(f"openvino_genai cannot load {path}: {exc}") from None
        self._tokenizer = self._pipe.get_tokenizer()
        self._lock = threading.Lock()
        self._ids = 0

    @classmethod
    def availability(cls) -> Availability:
        try:
            _genai()
        except RuntimeUnavailable as exc:
            return Availability(available=False, reason=str(exc))
        return Availability(available=True)

    def _config(self, params: GenerationParams) -> Any:
        config = _genai().GenerationConfig()
        config.max_new_tokens = params.max_tokens
        config.do_sample = False
        config.logprobs = 1
        config.apply_chat_template = False
        if params.stop:
            config.stop_strings = set(params.stop)
            config.include_stop_str_in_output = False
        return config

    def generate(self, prompt: str, params: GenerationParams, emit: Emit) -> str:
        prompt_tokens = len(self._tokenizer.encode(prompt).input_ids.data[0])
        if prompt_tokens + params.max_tokens > self.context:
            raise InvalidInput(
                f"the prompt is {prompt_tokens} tokens; with max_tokens {params.max_tokens} it exceeds "
                f"the context of {self.context} tokens"
            )
        with self._lock:
            self._ids += 1
            handle = self._pipe.add_request(self._ids, prompt, self._config(params))
            return self._drive(handle, emit, params.max_tokens)

    def _drive(self, handle: Any, emit: Emit, max_tokens: int) -> str:
        genai = _genai()
        ids: list[int] = []
        text = ""
        while handle.get_status() == genai.GenerationStatus.RUNNING or handle.can_read():
            if self._pipe.has_non_finished_requests():
                self._pipe.step()
            if not handle.can_read():
                continue
            for output in handle.read().values():
                for token_id, logprob in zip(output.generated_ids, output.generated_log_probs, strict=False):
                    ids.append(int(token_id))
                    decoded = self._tokenizer.decode(ids)
                    piece, text = decoded[len(text) :], decoded
                    if not emit(Token(text=piece, logprob=float(logprob))):
                        handle.cancel()
                        self._finish()
                        return "cancelled"
        return "length" if len(ids) >= max_tokens else "stop"

    def _finish(self) -> None:
        while self._pipe.has_non_finished_requests():
            self._pipe.step()


def _genai() -> Any:
    try:
        import openvino_genai
    except ImportError as exc:
        raise RuntimeUnavailable(f"openvino-genai is not installed ({exc})") from None
    return openvino_genai


GENERATORS: dict[str, type[GenerativeRunner]] = {cls.runtime: cls for cls in (OpenVinoGenAiRunner,)}
_ORDER: tuple[tuple[str, str], ...] = (("openvino_genai", "gguf"),)


def load_generator(
    family: FamilySpec, variant: VariantSpec, options: LoadOptions, *, runtimes: Sequence[str] | None = None
) -> GenerativeRunner:
    """A generative variant in the first runtime here that runs one of its files, warmed up."""
    assert family.generation is not None
    reasons = []
    for runtime, fmt in _ORDER:
        if (runtimes is not None and runtime not in runtimes) or fmt not in variant.files:
            continue
        status = GENERATORS[runtime].availability()
        if not status.available:
            reasons.append(f"{runtime}: {status.reason}")
            continue
        runner = GENERATORS[runtime](
            variant=variant, path=variant.files[fmt], options=options, context=family.generation.context
        )
        runner.warmup()
        return runner
    if not reasons:
        raise NotFound(
            f"variant '{variant.name}' ships no file a generative runtime here reads ({sorted(variant.files)})"
        )
    raise RuntimeUnavailable(f"no runtime can generate with '{variant.name}' here: {'; '.join(reasons)}")
