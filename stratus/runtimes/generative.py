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

:func:`generative_order` says which comes first on each tier.

A chat request's conversation is rendered here, by :meth:`GenerativeRunner.converse`, with
the chat template the variant's own GGUF carries (:mod:`stratus.runtimes.chat_template`, the
same for both runtimes), or, where it carries none, replaced by the last user message.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from stratus.errors import InvalidInput, ModelLoadError, NotFound, RuntimeUnavailable
from stratus.families.chat import Message
from stratus.families.generation import GenerationParams, StopCut, Token
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.runtimes.base import Availability, LoadFailure, LoadOptions, RuntimeDescription, warmed_up
from stratus.runtimes.chat_template import ChatTemplate, chat_template_of
from stratus.tiers import Tier

Emit = Callable[[Token], bool]
log = logging.getLogger("stratus.runtimes")


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
            config.rng_seed = _seed_of(params)  # its own generator per request, batched or not
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
                return _ended(ids, max_tokens, self._eos)
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
        choose = _sampler(params)
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
            if _stop_at(text, params.stop) is not None:
                return "stop"
            self._llama.eval([token_id])
        return "length"


def _ended(ids: list[int], max_tokens: int, eos: int) -> str:
    """Why a finished generation ended: "length" only where it was cut at ``max_tokens``; a
    last token that is the end of the sequence is a stop, even as the max_tokens-th (the
    pipeline counts it among the generated tokens: "198</s>" in 4 was reported as cut)."""
    if ids and ids[-1] == eos:
        return "stop"
    return "length" if len(ids) >= max_tokens else "stop"


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


_GGML_F32 = 0  # ggml's type id of float32
_STEP_WAIT_S = 0.05  # a safety net: a waiting generation is notified when the step it waits for ends


def _log_softmax(logits: Any) -> Any:
    import numpy as np

    values = np.asarray(logits, dtype=np.float64)
    shifted = values - values.max()
    return shifted - np.log(np.exp(shifted).sum())


def _greedy_step(logits: Any) -> tuple[int, Token]:
    """The most likely next token, its log-probability, and its lead over the runner-up."""
    import numpy as np

    logprobs = _log_softmax(logits)
    return int(np.argmax(logprobs)), _scored(logprobs, int(np.argmax(logprobs)))


def _scored(logprobs: Any, chosen: int) -> Token:
    """The chosen token's log-probability, and the step's top-1 minus top-2 probability."""
    import numpy as np

    second, first = np.partition(logprobs, -2)[-2:]
    return Token(text="", logprob=float(logprobs[chosen]), margin=float(np.exp(first) - np.exp(second)))


def _sampled_step(logits: Any, params: GenerationParams, rng: Any) -> tuple[int, Token]:
    """A token drawn from the logits at ``temperature``, among the fewest most likely ones
    whose probabilities reach ``top_p``; scored by the model's own distribution."""
    import numpy as np

    weights = np.exp(_log_softmax(np.asarray(logits, dtype=np.float64) / params.temperature))
    order = np.argsort(-weights, kind="stable")
    kept = order[: int(np.searchsorted(np.cumsum(weights[order]), params.top_p * weights.sum())) + 1]
    chosen = int(rng.choice(kept, p=weights[kept] / weights[kept].sum()))
    return chosen, _scored(_log_softmax(logits), chosen)


def _sampler(params: GenerationParams) -> Callable[[Any], tuple[int, Token]]:
    """Each step's choice for these settings: greedy, or a draw from a generator of its own."""
    if not params.sampled:
        return _greedy_step
    import numpy as np

    rng = np.random.default_rng(_seed_of(params))
    return lambda logits: _sampled_step(logits, params, rng)


def _seed_of(params: GenerationParams) -> int:
    """The request's seed as a runtime takes it (unsigned), or a fresh one."""
    return params.seed % (1 << 64) if params.seed is not None else secrets.randbits(63)


def _stop_at(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string starts in ``text``, if one is there."""
    found = [text.find(stop) for stop in stops if stop and stop in text]
    return min(found) if found else None


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise RuntimeUnavailable(
            f"llama-cpp-python is not installed ({exc}); pip install -e '.[llama]' in the checkout (or 'stratus-router[llama]')"
        ) from None
    return llama_cpp


def _genai() -> Any:
    try:
        import openvino_genai
    except ImportError as exc:
        raise RuntimeUnavailable(f"openvino-genai is not installed ({exc})") from None
    return openvino_genai


GENERATORS: dict[str, type[GenerativeRunner]] = {
    cls.runtime: cls for cls in (OpenVinoGenAiRunner, LlamaCppRunner)
}
# Which runtime first, where both are installed: on a device, llama.cpp (a small library made
# for such machines, and it gives the top-2 margin); on edge servers and in the cloud,
# OpenVINO GenAI (its continuous-batching pipeline, tuned for server CPUs).
_DEVICE_ORDER: tuple[tuple[str, str], ...] = (("llama_cpp", "gguf"), ("openvino_genai", "gguf"))
_SERVER_ORDER: tuple[tuple[str, str], ...] = (("openvino_genai", "gguf"), ("llama_cpp", "gguf"))


def generative_order(tier: Tier) -> tuple[tuple[str, str], ...]:
    """(runtime, file format) pairs in the order a variant of ``tier`` tries them."""
    return _DEVICE_ORDER if tier is Tier.DEVICE else _SERVER_ORDER


def load_generator(
    family: FamilySpec,
    variant: VariantSpec,
    options: LoadOptions,
    *,
    runtimes: Sequence[str] | None = None,
    failures: list[LoadFailure] | None = None,
) -> GenerativeRunner:
    """A generative variant in the first runtime here that runs one of its files, warmed up.

    ``runtimes``: only the generative runtimes it names, in that order (others are ignored).
    A runtime that refuses the file is noted in ``failures`` and the next one is tried."""
    assert family.generation is not None
    reasons = []
    refused = False
    order = generative_order(variant.tier)
    if runtimes is not None:  # only those, in that order (a list of classifier runtimes: none)
        order = tuple(pair for r in runtimes for pair in order if pair[0] == r)
        if not order:
            raise NotFound(f"no generative runtime among the runtimes allowed here ({', '.join(runtimes)})")
    for runtime, fmt in order:
        if fmt not in variant.files:
            continue
        status = GENERATORS[runtime].availability()
        if not status.available:
            reasons.append(f"{runtime}: {status.reason}")
            continue
        try:
            return _warm_generator(GENERATORS[runtime], family, variant, variant.files[fmt], options)
        except ModelLoadError as exc:
            refused = True
            reasons.append(str(exc))
            if failures is not None:
                failures.append(LoadFailure(variant=variant.name, runtime=runtime, reason=str(exc)))
    if not reasons:
        raise NotFound(
            f"variant '{variant.name}' ships no file a generative runtime here reads ({sorted(variant.files)})"
        )
    message = f"no runtime can generate with '{variant.name}' here: {'; '.join(reasons)}"
    raise ModelLoadError(message) if refused else RuntimeUnavailable(message)


def _warm_generator(
    cls: type[GenerativeRunner], family: FamilySpec, variant: VariantSpec, path: Path, options: LoadOptions
) -> GenerativeRunner:
    """A runner that has generated its warm-up token; a failing warm-up is a refusal too."""
    assert family.generation is not None
    runner = cls(variant=variant, path=path, options=options, context=family.generation.context)
    try:  # after the runtime's own reading: a file it refuses says so in its words
        runner.chat = chat_template_of(path)
    except ModelLoadError:
        runner.close()
        raise
    return warmed_up(runner, cls.runtime, path)
