"""Generative variants loaded on this machine, and how a prompt (or a chat's conversation,
rendered by each variant's own chat template where its GGUF has one) becomes a stream of chunks.

Used beside :class:`stratus.execution.local_models.LocalModels` (which owns it) by the edge agent and the
cloud gateway. A generation runs on an executor thread; each token crosses to the event
loop as soon as it is made, so the agent can put it on its AgentLink at once, and a
cancelled Work stops the runtime at its next token. What reaches the caller is cut at the
first stop string (the family's or the request's), text that may begin one held back
until it is settled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from stratus.convert.inference import InferRequest
from stratus.convert.text import conversation_of, prompt_and_params
from stratus.errors import ModelLoadError, NotFound, Overloaded, RuntimeUnavailable
from stratus.families.generation import (
    Chunk,
    StopCut,
    Token,
    confidence_of,
)
from stratus.families.repository import ModelRepository
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.obs.metrics import GenerationTiming, Metric, ModelMetrics, gauge
from stratus.runtimes import load_generator
from stratus.runtimes.base import LoadFailure, LoadOptions
from stratus.runtimes.generative import Finished, GenerativeRunner
from stratus.tiers import Tier

log = logging.getLogger("stratus.generation")

OnChunk = Callable[[Chunk], Awaitable[None]]


@dataclass(frozen=True, kw_only=True)
class Generated:
    """A finished generation: the text and its tokens (cut at a stop string), why it
    stopped, how sure, how long, and what it cost in tokens (the prompt's, and every token
    generated, a stop string's included)."""

    variant: VariantSpec
    text: str
    tokens: tuple[Token, ...]
    finish_reason: str
    confidence: float
    service_ms: float
    prompt_tokens: int
    completion_tokens: int
    chat_template: bool | None = (
        None  # a chat's: rendered by the variant's template (or its last user message)
    )


# Threads for generations; how many run at once per variant is the runtime's ``parallel``
# (OpenVINO GenAI steps several as one batch; llama.cpp takes one at a time).
GENERATIONS_AT_ONCE = 8
# Generations that may wait for a variant's slots; past them, RESOURCE_EXHAUSTED (a router
# retries elsewhere or climbs), not an unbounded queue of prompts in memory.
MAX_WAITING_GENERATIONS = 64
RETIRE_GRACE_S = 10.0  # a variant replaced by a reload keeps answering what is in flight this long


@dataclass(frozen=True, kw_only=True)
class NotLoaded:
    """A family's line that no runtime here could load, and what each one answered."""

    family: str
    variant: str
    reason: str


@dataclass(frozen=True)
class _Loaded:
    family: FamilySpec
    line: VariantSpec
    variant: VariantSpec  # the line, or the lower-precision variant of it that runs here
    runner: GenerativeRunner
    current: bool


_Stamp = tuple[VariantSpec, tuple[tuple[int, int], ...]]


def _stamp(variant: VariantSpec) -> _Stamp:
    """A variant's config entry and files: a reload keeps a runner while both are unchanged."""
    return variant, variant.file_stamps()


class _Clock:
    """When a generation arrived, got its slot, and made its first token."""

    def __init__(self) -> None:
        self.arrived = time.perf_counter()
        self.slot: float | None = None
        self.first: float | None = None

    def started(self) -> None:
        self.slot = time.perf_counter()

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def since_arrival_s(self) -> float:
        return time.perf_counter() - self.arrived

    def timing(self, tokens: int) -> GenerationTiming:
        slot = self.slot if self.slot is not None else self.arrived
        return GenerationTiming(
            queued_s=slot - self.arrived,
            first_token_s=None if self.first is None else self.first - self.arrived,
            running_s=time.perf_counter() - slot,
            tokens=tokens,
        )


class LocalGenerators:
    """The generative lines of one tier (or named variants), each in its runtime here."""

    def __init__(
        self,
        repository: ModelRepository,
        *,
        tier: Tier | None,
        variants: list[str] | None,
        options: LoadOptions,
        runtimes: list[str] | None = None,
        emulated_extra_ms: float = 0.0,
        recorder: ModelMetrics | None = None,
    ) -> None:
        self.emulated_extra_ms = emulated_extra_ms  # tests and benchmarks: a slower device, per token
        self.recorder = recorder
        self._tier, self._names, self._options, self._runtimes = tier, variants, options, runtimes
        self.families: dict[str, FamilySpec] = {}
        self.variants: dict[str, VariantSpec] = {}
        self.runners: dict[str, GenerativeRunner] = {}
        self.current: set[str] = set()
        self.lines: dict[str, str] = {}  # loaded variant -> its line (the FP32 root it was made from)
        self._stamps: dict[str, _Stamp] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._waiting: dict[str, int] = {}  # generations waiting for a slot, by variant
        self._running: dict[str, int] = {}  # generations in their runtime, by variant
        # Every runtime that refused a file (counted by the owner's metrics), and the lines
        # that no runtime here could load, by family: those families are not ready here.
        self.load_failures: list[LoadFailure] = []
        self.unavailable: dict[str, NotLoaded] = {}
        self._install(self._loaded(repository, strict=False))
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(options.concurrency, GENERATIONS_AT_ONCE), thread_name_prefix="stratus-generate"
        )

    def _loaded(self, repository: ModelRepository, *, strict: bool) -> list[_Loaded]:
        """Each line chosen from ``repository``, loaded; what is unchanged since the last load
        (the same config entry and files) keeps its runner.

        A current line that nothing here loads leaves its family unavailable (at start), or,
        when ``strict`` (a reload), fails the whole load so what is served stays as it was."""
        loaded: list[_Loaded] = []
        unavailable: dict[str, NotLoaded] = {}
        try:
            for family, line, current in _select(repository, self._tier, self._names):
                found = self._load_line(family, line)
                if isinstance(found, NotLoaded):
                    if strict and family.name in self.families:
                        raise ModelLoadError(f"{found.variant} no longer loads: {found.reason}")
                    if current:
                        unavailable[family.name] = found
                else:
                    loaded.append(_Loaded(family, line, found[0], found[1], current))
            self.unavailable = unavailable
        except Exception:  # a load that fails leaves what is served as it was: close the new ones
            serving = {id(r) for r in self.runners.values()}
            for item in loaded:
                if id(item.runner) not in serving:
                    item.runner.close()
            raise
        return loaded

    def _load_line(
        self, family: FamilySpec, line: VariantSpec
    ) -> tuple[VariantSpec, GenerativeRunner] | NotLoaded:
        """The line itself where a runtime here runs its files, else the first of its
        lower-precision variants that one does (a cloud's Hugging Face model, served here
        through its GGUF child); why not, when none loads."""
        reasons = []
        for variant in family.line_of(line):
            if self._stamps.get(variant.name) == _stamp(variant) and variant.name in self.runners:
                return variant, self.runners[variant.name]
            try:
                return variant, load_generator(
                    family, variant, self._options, runtimes=self._runtimes, failures=self.load_failures
                )
            except (RuntimeUnavailable, NotFound, ModelLoadError) as exc:
                reasons.append(f"{variant.name}: {exc}")
        log.warning("%s: not serving %s: %s", family.name, line.name, "; ".join(reasons))
        return NotLoaded(family=family.name, variant=line.name, reason="; ".join(reasons))

    def _install(self, loaded: list[_Loaded]) -> list[GenerativeRunner]:
        """Serve exactly ``loaded``; the runners no longer served, for the caller to close."""
        before = dict(self.runners)
        self.families = {item.family.name: item.family for item in loaded}
        self.variants = {item.variant.name: item.variant for item in loaded}
        self.runners = {item.variant.name: item.runner for item in loaded}
        self.lines = {item.variant.name: item.line.name for item in loaded}
        self.current = {item.variant.name for item in loaded if item.current}
        self._stamps = {item.variant.name: _stamp(item.variant) for item in loaded}
        previous = self._slots
        self._slots = {  # a runner kept keeps its slots (and what waits on them)
            item.variant.name: previous[item.variant.name]
            if before.get(item.variant.name) is item.runner
            else asyncio.Semaphore(item.runner.parallel)
            for item in loaded
        }
        for item in loaded:
            if before.get(item.variant.name) is not item.runner:
                log.info(
                    "%s: %s loaded (%s)%s",
                    item.family.name,
                    item.variant.name,
                    item.runner.runtime,
                    "" if item.variant is item.line else f" for {item.line.name}",
                )
        kept = {id(item.runner) for item in loaded}
        return [runner for runner in before.values() if id(runner) not in kept]

    async def reload(self, repository: ModelRepository) -> list[str]:
        """Load what changed in ``repository`` (on a thread), then serve it; a runner that
        is replaced finishes the generations already running on it and is closed after
        RETIRE_GRACE_S. Returns the variants now served."""
        loop = asyncio.get_running_loop()
        loaded = await loop.run_in_executor(None, functools.partial(self._loaded, repository, strict=True))
        for runner in self._install(loaded):
            loop.call_later(RETIRE_GRACE_S, runner.close)
        return sorted(self.variants)

    def serves(self, model: str) -> bool:
        return (
            model in self.variants
            or model in self.lines.values()
            or any(self.variants[name].family == model for name in self.current)
        )

    def variant_for(self, model: str) -> tuple[FamilySpec, VariantSpec]:
        """A family resolves to its current variant here (the highest tier's); a line or a
        variant to what is loaded for it."""
        if model in self.variants:
            variant = self.variants[model]
            return self.families[variant.family], variant
        for name, line in self.lines.items():
            if line == model:
                variant = self.variants[name]
                return self.families[variant.family], variant
        local = [self.variants[n] for n in self.current if self.variants[n].family == model]
        if not local:
            raise NotFound(f"model '{model}' is not a generative model served here")
        variant = max(local, key=lambda v: v.tier)
        return self.families[variant.family], variant

    async def generate(self, request: InferRequest, on_chunk: OnChunk | None = None) -> Generated:
        """Generate for a request (``text_input``, its settings); chunks go to ``on_chunk``
        as tokens are made. Cancelling the caller stops the runtime at its next token."""
        family, variant = self.variant_for(request.model_name)
        assert family.generation is not None
        prompt, params = prompt_and_params(request, family)
        conversation = conversation_of(request)
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[Token | None] = asyncio.Queue()
        stop = threading.Event()

        def emit(token: Token) -> bool:
            if self.emulated_extra_ms:
                time.sleep(self.emulated_extra_ms / 1000.0)  # on the executor thread, like real compute
            loop.call_soon_threadsafe(tokens.put_nowait, token)
            return not stop.is_set()

        def run() -> Finished:
            try:
                return self.runners[variant.name].converse(conversation, prompt, params, emit)
            finally:
                loop.call_soon_threadsafe(tokens.put_nowait, None)

        clock = _Clock()
        future = await self._start(variant.name, run)
        clock.started()
        cut = StopCut(params.stop)
        produced: list[Token] = []
        made = 0
        try:
            while (token := await tokens.get()) is not None:
                made += 1
                clock.token()
                await _pass_on(cut.feed((token,)), produced, on_chunk)
            finished = await future
            await _pass_on(cut.finish(), produced, on_chunk)
        except BaseException:
            stop.set()  # the runtime stops at its next token
            raise
        finally:
            self._record(variant, clock, made)  # what the runtime made, kept or cut
        return Generated(
            variant=variant,
            text="".join(t.text for t in produced),
            tokens=tuple(produced),
            finish_reason="stop" if cut.stopped else finished.reason,
            confidence=confidence_of(produced, family.generation.method),
            service_ms=clock.since_arrival_s() * 1000.0,
            prompt_tokens=finished.prompt_tokens,
            completion_tokens=made,
            chat_template=finished.templated if conversation else None,
        )

    async def _start(self, name: str, run: Callable[[], Finished]) -> asyncio.Future[Finished]:
        """``run`` on the executor once one of the variant's slots is free; past
        MAX_WAITING_GENERATIONS waiting, RESOURCE_EXHAUSTED. The slot is held until the
        runtime is done, not the caller."""
        if self._waiting.get(name, 0) >= MAX_WAITING_GENERATIONS:
            raise Overloaded(
                f"{MAX_WAITING_GENERATIONS} generations wait for {name} here; retry later or elsewhere"
            )
        slots = self._slots[name]
        self._waiting[name] = self._waiting.get(name, 0) + 1
        try:
            await slots.acquire()  # as many at once as the runtime takes; the rest wait here
        finally:
            self._waiting[name] -= 1
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, run)
        except BaseException:
            slots.release()
            raise
        self._running[name] = self._running.get(name, 0) + 1
        future.add_done_callback(lambda _: self._finished(name, slots))
        return future

    def _finished(self, name: str, slots: asyncio.Semaphore) -> None:
        self._running[name] -= 1
        slots.release()

    def _record(self, variant: VariantSpec, clock: _Clock, tokens: int) -> None:
        if self.recorder is not None:
            self.recorder.record_generation(variant.family, variant.name, clock.timing(tokens))

    def levels(self) -> list[Metric]:
        """Generations waiting for a slot and running, per variant, read at each scrape."""
        labels = ["family", "variant"]
        loaded = sorted(self.variants.items())
        waiting = [([v.family, name], float(self._waiting.get(name, 0))) for name, v in loaded]
        running = [([v.family, name], float(self._running.get(name, 0))) for name, v in loaded]
        return [
            gauge("stratus_generation_waiting", "Generations waiting for one of their variant's slots here.", labels, waiting),
            gauge("stratus_generation_running", "Generations running in their runtime here.", labels, running),
        ]  # fmt: skip

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for runner in self.runners.values():
            runner.close()


async def _pass_on(tokens: tuple[Token, ...], produced: list[Token], on_chunk: OnChunk | None) -> None:
    produced.extend(tokens)
    if on_chunk is not None and tokens:
        await on_chunk(Chunk(tokens=tokens))


def _select(
    repository: ModelRepository, tier: Tier | None, names: list[str] | None
) -> list[tuple[FamilySpec, VariantSpec, bool]]:
    """Each generative line to load (named, or of the tier), and whether it is current."""
    chosen = []
    for family in repository.families.values():
        if not family.generative:
            continue
        for variant in family.variants:
            if variant.parent is not None:
                continue
            if names is not None and variant.name not in names:
                continue
            if names is None and tier is not None and variant.tier is not tier:
                continue
            chosen.append((family, variant, family.current.get(variant.tier) == variant.name))
    return chosen
