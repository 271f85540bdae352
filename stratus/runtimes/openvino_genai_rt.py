"""OpenVINO GenAI's continuous-batching pipeline as a generative runtime.

It reports each chosen token's log-probability (no alternatives, so no top-2 margin), samples
itself, and opens with the KV-cache precision this CPU's plugin accepts (:data:`KV_CACHE_ORDER`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stratus.errors import ModelLoadError, RuntimeUnavailable
from stratus.families.generation import GenerationParams, Token
from stratus.families.spec import VariantSpec
from stratus.runtimes.base import LoadOptions
from stratus.runtimes.decoding import ended, seed_of
from stratus.runtimes.generative import Emit, Finished, GenerativeRunner

log = logging.getLogger("stratus.runtimes")
_STEP_WAIT_S = 0.05  # a safety net: a waiting generation is notified when the step it waits for ends


class OpenVinoGenAiRunner(GenerativeRunner):
    """OpenVINO GenAI's continuous-batching pipeline, which reports each chosen token's
    log-probability as it steps.

    Generations run together: each asking thread adds its request (``add_request`` may be
    called from any thread), and whichever of them finds the pipeline free runs one
    ``step`` for all of them while the others wait for that step to end, then each reads its
    own tokens. Four to eight at once made 1.1x (arith-small) to 1.4x (arith-large) the
    generations per second of one at a time here (``benchmarks/llm_throughput.py``).
    """

    runtime = "openvino_genai"
    formats = ("gguf",)
    parallel = 8

    def __init__(self, *, variant: VariantSpec, path: Path, options: LoadOptions, context: int) -> None:
        super().__init__(variant=variant, path=path, options=options, context=context)
        genai = _genai()
        scheduler = genai.SchedulerConfig()
        scheduler.cache_size = 1  # GB of KV cache: tiny models, few requests at once

        def open_pipeline(kv_cache: str | None) -> Any:
            return genai.ContinuousBatchingPipeline(str(path), scheduler, "CPU", pipeline_config(kv_cache))

        self._pipe, self.kv_cache_precision = open_with_kv_cache(open_pipeline, path)
        self._tokenizer = self._pipe.get_tokenizer()
        self._eos = int(self._tokenizer.get_eos_token_id())
        self._ids = itertools.count(1)
        self._stepping = threading.Lock()  # held by the thread running a step
        self._stepped = threading.Condition()  # notified after each step
        self._steps = 0

    @staticmethod
    def library() -> Any:
        return _genai()

    def _config(self, params: GenerationParams) -> Any:
        """Log-probabilities of the chosen tokens: with ``logprobs`` set, GenAI's sampler
        reports the raw model's (before temperature and top_p), sampled or not."""
        config = _genai().GenerationConfig()
        config.max_new_tokens = params.max_tokens
        config.do_sample = params.sampled
        if params.sampled:
            config.temperature = params.temperature
            config.top_p = params.top_p
            config.rng_seed = seed_of(params)  # its own generator per request, batched or not
        config.logprobs = 1
        config.apply_chat_template = False
        if params.stop:
            config.stop_strings = set(params.stop)
            config.include_stop_str_in_output = True  # emitted as made; the caller cuts it
        return config

    def generate(
        self, prompt: str, params: GenerationParams, emit: Emit, *, special: bool = False
    ) -> Finished:
        """The prompt is tokenized here (as the pipeline would), for its count; GenAI's
        tokenizer reads a special token's text as that token either way."""
        ids = self._tokenizer.encode(prompt, add_special_tokens=not special).input_ids
        self.check_context(ids.get_size(), params)
        handle = self._pipe.add_request(next(self._ids), ids, self._config(params))
        try:
            return Finished(reason=self._drive(handle, emit, params.max_tokens), prompt_tokens=ids.get_size())
        except BaseException:
            handle.cancel()  # dropped by the pipeline at its next step
            raise

    def _drive(self, handle: Any, emit: Emit, max_tokens: int) -> str:
        running = _genai().GenerationStatus.RUNNING
        ids: list[int] = []
        text = ""
        while True:
            if handle.can_read():
                for output in handle.read().values():
                    for token_id, logprob in zip(
                        output.generated_ids, output.generated_log_probs, strict=False
                    ):
                        ids.append(int(token_id))
                        decoded = self._tokenizer.decode(ids)
                        piece, text = decoded[len(text) :], decoded
                        if not emit(Token(text=piece, logprob=float(logprob))):
                            handle.cancel()
                            return "cancelled"
                continue
            if handle.get_status() != running:
                if handle.can_read():  # another thread's step finished it after our read: the
                    continue  # last tokens came with that step, and are still to be read
                return ended(ids, max_tokens, self._eos)
            self._step_or_wait()

    def _step_or_wait(self) -> None:
        """Run one step for every generation in the pipeline, or, while another thread runs
        one, wait for it to end."""
        with self._stepped:
            seen = self._steps
        if self._stepping.acquire(blocking=False):
            try:
                if self._pipe.has_non_finished_requests():
                    self._pipe.step()
            finally:
                self._stepping.release()
                with self._stepped:
                    self._steps += 1
                    self._stepped.notify_all()
            return
        with self._stepped:
            self._stepped.wait_for(lambda: self._steps != seen, timeout=_STEP_WAIT_S)


# KV-cache precisions OpenVINO GenAI is asked for, best first; None is the plugin's own
# choice of arithmetic and cache. F32 arithmetic with an F32 cache serves arith exactly as
# llama.cpp does on AVX2 and AMX CPUs alike. The CPU plugin's defaults are not that: on
# AVX-512-BF16/AMX it computes in bf16 (86.6% of arith-small's prompts served alike) and then
# refuses an f32 cache ("expect kvcache type bf16"); its default u8 cache moved
# log-probabilities by up to 2e-2. The paged-attention kernel takes only a cache that
# matches its arithmetic, or f16/u8: f16 (99.0% alike) is next, then the plugin's defaults.
KV_CACHE_ORDER: tuple[str | None, ...] = ("f32", "f16", None)


def pipeline_config(kv_cache: str | None) -> dict[str, str]:
    """OpenVINO GenAI's properties for one attempt: F32 arithmetic and the given cache, or,
    for None, nothing (the plugin chooses both)."""
    if kv_cache is None:
        return {}
    return {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": kv_cache}


def open_with_kv_cache(
    open_pipeline: Callable[[str | None], Any], path: Path, order: Sequence[str | None] = KV_CACHE_ORDER
) -> tuple[Any, str]:
    """The pipeline opened with the first KV-cache precision in ``order`` that the plugin
    accepts on this CPU, and that precision ("default" for the plugin's own choice).

    Each refusal costs one failed compile (about 0.3 s here); a file no precision opens is
    a ModelLoadError that says what each attempt answered."""
    refusals = []
    for kv_cache in order:
        try:
            return open_pipeline(kv_cache), kv_cache or "default"
        except Exception as exc:
            refusals.append(f"kv cache {kv_cache or 'default'}: {_first_line(exc)}")
            log.debug("openvino_genai refused %s with kv cache %s: %s", path, kv_cache, exc)
    raise ModelLoadError(f"openvino_genai cannot load {path}: {'; '.join(refusals)}")


def _first_line(exc: BaseException) -> str:
    """OpenVINO's messages run over several lines of source locations; the check is last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _genai() -> Any:
    try:
        import openvino_genai
    except ImportError as exc:
        raise RuntimeUnavailable(f"openvino-genai is not installed ({exc})") from None
    return openvino_genai
