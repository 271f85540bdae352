"""Models loaded on this machine, and the data plane that serves them.

Used by the edge agent (for Work from the router and for its local ``--serve``
endpoint), the cloud gateway and the on-device SDK: decode and check the request, run
the variant on the bounded executor, compute the confidence as the family config says,
encode the answer. A batch's confidence is its least confident item: one unsure item is
reason enough to ask a bigger model about the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stratus import codec
from stratus.audit_config import calibration_info
from stratus.batching import DEFAULT_MAX_BATCH, DEFAULT_MAX_DELAY_S, Batch, Batcher, BatchKey, split_counts
from stratus.codec import Array
from stratus.confidence import confidence
from stratus.convert.fleet import thresholds_to_wire
from stratus.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelLoadError,
    NotFound,
    RuntimeUnavailable,
    StratusError,
    Unavailable,
)
from stratus.executor import BoundedExecutor
from stratus.generation import FINAL, FINISH_REASON, Chunk
from stratus.local_generation import (
    RETIRE_GRACE_S,
    NotLoaded,
    chunk_response,
    generative_config,
    generative_metadata,
    read_usage,
    write_usage,
)
from stratus.metrics import UNKNOWN, Metric, Metrics, ModelMetrics, counted, gauge
from stratus.precision import Hardware, choose_variant, load_verification, this_hardware
from stratus.protocol import BATCH_SIZE, MODEL_VERSION, VARIANT, Served, parameter_value, set_parameter
from stratus.repository import FamilySpec, ModelRepository, VariantSpec
from stratus.runtimes import LoadFailure, LoadOptions, ModelRunner, load_runner
from stratus.serving import DataPlane, tensor_metadata
from stratus.stats import LatencyWindow
from stratus.tensors import MAX_REQUEST_ITEMS, answer_raw, check_request_metadata
from stratus.tiers import Tier
from stratus.wire import fleet_pb2
from stratus.wire import inference_pb2 as pb

log = logging.getLogger("stratus.models")

if TYPE_CHECKING:
    from stratus.local_generation import LocalGenerators, OnChunk

# The most of a load failure's reason an agent's Hello carries.
_REASON_CHARS = 1000
# Calls between two looks at whether a variant is fast enough to run on the event loop.
INLINE_REVIEW = 64
# How long a variant that a reload replaced keeps answering work already addressed to it.


@dataclass(frozen=True, kw_only=True)
class LocalAnswer:
    response: pb.ModelInferResponse
    variant: VariantSpec
    confidences: tuple[float, ...]  # one per item, in order
    service_ms: float  # running the batch this request ran in
    queue_ms: float  # waiting for a slot
    batch_size: int  # items in that batch

    @property
    def confidence(self) -> float:
        """The least confident item's: one unsure item is reason to look again."""
        return min(self.confidences, default=1.0)


@dataclass(frozen=True, kw_only=True)
class _Part:
    """One member's share of a batch that ran."""

    outputs: dict[str, Array]
    confidences: Array
    service_ms: float
    batch_size: int


@dataclass(frozen=True, kw_only=True)
class LocalSettings:
    """Which variants to load, how wide the inference executor is, and how requests batch."""

    tier: Tier | None = None
    variants: Sequence[str] | None = None
    cache_dir: Path = Path.home() / ".cache" / "stratus"
    concurrency: int = 2
    queue_limit: int = 64
    runtimes: Sequence[str] | None = None
    executor_name: str = "stratus-infer"
    # Requests merged into one runtime call while every slot is busy; 1 turns batching off.
    max_batch: int = DEFAULT_MAX_BATCH
    max_batch_delay_s: float = DEFAULT_MAX_DELAY_S
    # Which precision of each family to serve: None picks the fastest that this CPU runs
    # natively and that the family's verification record vouches for; "fp32" etc. forces.
    precision: str | None = None
    hardware: Hardware | None = None  # None: read from this machine's CPU flags
    # A variant whose recent p90 runtime call is under this runs on the event loop, not a
    # thread (the hand-over would cost more than the call); 0: always a thread.
    inline_below_ms: float = 0.2
    # Benchmarks only: hold each inference this much longer, to emulate a slower device.
    emulated_extra_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.queue_limit < 0 or self.max_batch < 1 or self.max_batch_delay_s < 0:
            raise ConfigError("concurrency and max_batch must be >= 1, queue_limit and delay >= 0")


class LocalModels:
    """Variants loaded into their best runtimes here, warmed up before first use.

    One :class:`~stratus.batching.Batcher` owns the queue in front of the runtimes: it
    admits up to ``queue_limit`` waiting requests, runs ``concurrency`` batches at once on
    the executor's threads, and merges requests that wait for a slot.
    """

    def __init__(
        self, repository: ModelRepository, settings: LocalSettings, *, metrics: Metrics | None = None
    ) -> None:
        # Read once: the choice at start, each reload's and the agent's Hello see one CPU.
        self.settings = settings if settings.hardware else replace(settings, hardware=this_hardware())
        settings = self.settings
        self.repository = repository
        self.metrics = metrics
        self.recorder = ModelMetrics(metrics) if metrics is not None else None
        chosen = _select(repository, settings)
        self.generators = _generators(repository, settings, self.recorder)
        if not chosen and not (self.generators and (self.generators.variants or self.generators.unavailable)):
            raise NotFound(f"no variants to load (tier={settings.tier}, variants={settings.variants})")
        self.runners: dict[str, ModelRunner] = {}
        self.latency: dict[str, LatencyWindow] = {}
        self.reasons: dict[str, str] = {}
        self.variants: dict[str, VariantSpec] = {}  # loaded, including any still retiring
        self.families: dict[str, FamilySpec] = {}
        self.served: set[str] = set()  # the variants announced: not retiring
        self.current: set[str] = set()  # served variants that answer their family's requests
        self._stamps: dict[str, tuple[VariantSpec, tuple[tuple[int, int], ...]]] = {}
        self._dynamic_batch: dict[str, bool] = {}
        self._runtime: dict[str, str] = {}
        self._inline: set[str] = set()  # variants fast enough to run on the event loop
        # Every runtime that refused a file, and the families (by name) whose current variant
        # no runtime here could load: those are not ready here, and say why.
        self.load_failures: list[LoadFailure] = []
        self.unavailable: dict[str, NotLoaded] = {}
        loaded = [pair for c in chosen if (pair := self._load_at_start(c)) is not None]
        self._install([c for c, _ in loaded], {c.variant.name: runner for c, runner in loaded})
        self._count_load_failures()
        if not self.runners and not (self.generators and self.generators.runners):
            raise ModelLoadError(
                f"nothing could be loaded here: {self.unavailable_reasons() or 'no variants'}"
            )
        # Each thread may have one closed batch ready behind the one it runs, so it never
        # waits on the event loop between batches; the batcher holds everything else.
        workers = settings.concurrency
        self.executor = BoundedExecutor(name=settings.executor_name, workers=workers, queue_limit=workers)
        self.batcher: Batcher[dict[str, Array], _Part] = Batcher(
            self._run_batch,
            slots=workers,
            depth=2 * workers,
            max_batch=lambda key: self.max_batch(key.variant),
            max_delay_s=settings.max_batch_delay_s,
            queue_limit=settings.queue_limit,
            name=settings.executor_name,
        )
        if metrics is not None:
            metrics.collect_with(self._levels)

    @property
    def hardware(self) -> Hardware:
        """The CPU the precision choice read (the agent says so in its Hello)."""
        assert self.settings.hardware is not None  # set in __init__
        return self.settings.hardware

    def _load(self, chosen: _Chosen) -> ModelRunner:
        options = LoadOptions(
            tier=chosen.variant.tier, cache_dir=self.settings.cache_dir, concurrency=self.settings.concurrency
        )
        return load_runner(
            chosen.family,
            chosen.variant,
            options,
            runtimes=self.settings.runtimes,
            failures=self.load_failures,
        )

    def _load_at_start(self, chosen: _Chosen) -> tuple[_Chosen, ModelRunner] | None:
        """The chosen variant loaded; where no runtime here loads a lower-precision child,
        its FP32 parent; where nothing loads, None, with the family marked unavailable (a
        current variant) so the rest of the process still serves."""
        try:
            return chosen, self._load(chosen)
        except (ModelLoadError, RuntimeUnavailable) as exc:
            failed = str(exc)
        parent = chosen.variant.parent
        if parent is not None and self.settings.variants is None:
            fallback = _Chosen(
                chosen.family,
                chosen.family.variant(parent),
                f"fp32: {chosen.variant.name} did not load ({failed})",
                current=chosen.current,
            )
            log.warning(
                "%s: %s did not load, serving %s instead: %s",
                chosen.family.name,
                chosen.variant.name,
                parent,
                failed,
            )
            try:
                return fallback, self._load(fallback)
            except (ModelLoadError, RuntimeUnavailable) as exc:
                failed = f"{failed}; {parent}: {exc}"
        if chosen.current:
            self.unavailable[chosen.family.name] = NotLoaded(
                family=chosen.family.name, variant=chosen.variant.name, reason=failed
            )
        log.error("%s: not serving %s: %s", chosen.family.name, chosen.variant.name, failed)
        return None

    def _count_load_failures(self) -> None:
        """Each refusal once: in the log, and in ``stratus_model_load_failures_total``."""
        failures = [*self.load_failures, *(self.generators.load_failures if self.generators else ())]
        for failure in failures:
            log.warning("%s: %s refused it: %s", failure.variant, failure.runtime, failure.reason)
            if self.recorder is not None:
                self.recorder.load_failures.labels(failure.variant, failure.runtime).inc()

    def unavailable_families(self) -> dict[str, NotLoaded]:
        """Families meant to be served here that no runtime could load (classifiers and
        generative ones), unless another of their variants serves them here after all."""
        generative = self.generators.unavailable if self.generators is not None else {}
        found = {**self.unavailable, **generative}
        return {name: why for name, why in found.items() if not self._family_served(name)}

    def unavailable_reasons(self) -> str:
        return "; ".join(
            f"{n.family} ({n.variant}): {n.reason}" for n in self.unavailable_families().values()
        )

    def _family_served(self, family: str) -> bool:
        if any(self.variants[name].family == family for name in self.current):
            return True
        return self.generators is not None and any(
            self.generators.variants[name].family == family for name in self.generators.current
        )

    def _install(self, chosen: Sequence[_Chosen], runners: Mapping[str, ModelRunner]) -> None:
        """Serve exactly ``chosen`` from now on; variants left out stay loaded but retiring."""
        for c in chosen:
            name = c.variant.name
            if self.runners.get(name) is not runners[name]:
                self.runners[name] = runners[name]
                self.latency[name] = LatencyWindow()
                self._inline.discard(name)
                described = runners[name].describe()
                self._dynamic_batch[name] = described.dynamic_batch
                self._runtime[name] = described.runtime
            self.variants[name] = c.variant
            self.families[c.family.name] = c.family
            self.reasons[name] = c.reason
            self._stamps[name] = (c.variant, c.variant.file_stamps())
        self.served = {c.variant.name for c in chosen}
        self.current = {c.variant.name for c in chosen if c.current}

    async def reload(self) -> list[str]:
        """Re-read the models folder; load and warm what is new or changed, then serve it.

        Nothing in flight is lost: a variant that is no longer chosen stops being announced
        at once but keeps answering the work already addressed to it for RETIRE_GRACE_S.
        A folder that no longer loads, or a variant that fails to load, leaves everything as
        it was and raises, saying why.
        """
        repository = ModelRepository.load(self.repository.root)
        chosen = _select(repository, self.settings)
        if not chosen and self.generators is None:
            raise NotFound(f"no variants to load from {self.repository.root}")
        loop = asyncio.get_running_loop()
        runners: dict[str, ModelRunner] = {}
        fresh: list[ModelRunner] = []
        try:
            for c in chosen:
                name = c.variant.name
                if name in self.runners and self._stamps.get(name) == (c.variant, c.variant.file_stamps()):
                    runners[name] = self.runners[name]
                    continue
                log.info("loading %s (%s) from %s", name, c.variant.precision, self.repository.root)
                runners[name] = await loop.run_in_executor(None, self._load, c)
                fresh.append(runners[name])
            if self.generators is not None:
                await self.generators.reload(repository)  # all or nothing, like the rest
        except Exception:
            for runner in fresh:
                runner.close()
            raise
        replaced = {n: r for n, r in self.runners.items() if runners.get(n) is not r}
        self.repository = repository
        self._install(chosen, runners)
        for name, runner in replaced.items():
            loop.call_later(RETIRE_GRACE_S, self._retire, name, runner)
        served = sorted({*self.served, *(self.generators.variants if self.generators else ())})
        log.info("reloaded: serving %s", served)
        return served

    def _retire(self, name: str, runner: ModelRunner) -> None:
        """Close a runner replaced by a reload once its grace is over (unless it came back)."""
        if self.runners.get(name) is runner and name not in self.served:
            del self.runners[name], self.variants[name]
            self.latency.pop(name, None)
        if self.runners.get(name) is not runner:
            runner.close()

    def _levels(self) -> list[Metric]:
        """Queue depth and items running (and generations waiting and running), read at each scrape."""
        return [
            gauge("stratus_queue_items", "Items waiting for a runtime slot here.", [], [([], self.batcher.waiting_items)]),
            gauge("stratus_in_flight_items", "Items running in a runtime here.", [], [([], self.batcher.running_items)]),
            *(self.generators.levels() if self.generators is not None else ()),
        ]  # fmt: skip

    def count(self, outcome: str, model_name: str, ran: VariantSpec | None = None) -> None:
        """One request answered here (Work from a router or a direct call): ok, or its error;
        under the family and variant that ran (``ran``), or would have run ``model_name``."""
        if self.recorder is not None:
            self.recorder.count_work(*self.work_labels(model_name, ran), outcome)

    def work_labels(self, model_name: str, ran: VariantSpec | None = None) -> tuple[str, str]:
        """(family, variant) as the model files name them, never as the request did: a
        pinned variant counts under its family, and a name not in the files as ``unknown``,
        so the labels stay as few as the files' variants."""
        if ran is not None:
            return ran.family, ran.name
        with contextlib.suppress(StratusError):
            family, variant = self.variant_for(model_name)
            return family.name, variant.name
        try:
            family, pinned = self.repository.resolve(model_name)
        except NotFound:
            return UNKNOWN, UNKNOWN
        return family.name, pinned.name if pinned is not None else UNKNOWN

    def max_batch(self, variant: str) -> int:
        """What this variant may merge: the setting, where its runtime takes a dynamic batch."""
        return self.settings.max_batch if self._dynamic_batch.get(variant, False) else 1

    def generates(self, model_name: str) -> bool:
        return self.generators is not None and self.generators.serves(model_name)

    def variant_for(self, model_name: str) -> tuple[FamilySpec, VariantSpec]:
        """A family resolves to its highest-tier current variant here; a variant to itself
        (one retiring after a reload still answers the work already addressed to it)."""
        if model_name in self.variants:
            variant = self.variants[model_name]
            return self.families[variant.family], variant
        child = self._child_serving(model_name)
        if child is not None:
            return self.families[child.family], child
        family = self.families.get(model_name)
        local = [v for v in family.variants if v.name in self.current] if family else []
        if family is not None and local:
            return family, max(local, key=lambda v: v.tier)
        if self.generators is not None and self.generators.serves(model_name):
            return self.generators.variant_for(model_name)
        missing = self.unavailable_families().get(model_name)
        if missing is not None:
            raise Unavailable(f"model '{model_name}' could not be loaded here: {missing.reason}")
        raise NotFound(f"model '{model_name}' is not served here; serving {self.model_names()}")

    def follow(self, family: str, tier: Tier, line: str) -> bool:
        """Answer ``family``'s requests on ``tier`` with ``line`` (in the precision chosen for
        it here) from now on, as a router serves it after a promoted rollout; False, changing
        nothing, where that line is not loaded here (its file is not in this folder)."""
        loaded = [
            name
            for name in sorted(self.served)
            if (v := self.variants[name]).family == family and v.tier is tier and (v.parent or v.name) == line
        ]
        if not loaded:
            return False
        others = {n for n in self.current if self.variants[n].family == family and self.variants[n].tier is tier}
        self.current = (self.current - others) | {loaded[0]}
        return True

    def _child_serving(self, line: str) -> VariantSpec | None:
        """The lower-precision variant served here in place of FP32 variant ``line``: its
        name keeps working whatever precision the hardware chose."""
        children = [self.variants[n] for n in self.served if self.variants[n].parent == line]
        return min(children, key=lambda v: v.name not in self.current) if children else None

    def model_names(self) -> list[str]:
        """The families with a current variant here, every variant served, and the FP32
        name of each line served through a lower-precision child."""
        families = {self.variants[name].family for name in self.current}
        lines = {self.variants[name].parent for name in self.served} - {None}
        names = {*families, *self.served, *(line for line in lines if line is not None)}
        if self.generators is not None:
            names |= {v.family for n, v in self.generators.variants.items() if n in self.generators.current}
            names |= set(self.generators.variants) | set(self.generators.lines.values())
        return sorted(names)

    async def answer(self, request: pb.ModelInferRequest) -> LocalAnswer:
        """Decode once, check, wait for a slot (maybe sharing a batch), run, encode."""
        if self.generators is not None and self.generators.serves(request.model_name):
            return await self.generate(request)
        family, variant = self.variant_for(request.model_name)
        check_request_metadata(family.name, family.inputs, request)  # before decoding anything
        inputs = codec.decode_request_inputs(request)
        family.check_inputs(inputs)
        wanted = _requested_outputs(request, family)
        size = next(iter(inputs.values())).shape[0] if inputs else 0
        started = time.perf_counter()
        part = await self.batcher.submit(_key(variant.name, inputs, wanted), inputs, size=size)
        waited_ms = (time.perf_counter() - started) * 1000.0 - part.service_ms
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        codec.encode_response_outputs(response, part.outputs, raw=_answer_raw(request, part.outputs))
        return LocalAnswer(
            response=response,
            variant=variant,
            confidences=tuple(float(c) for c in part.confidences),
            service_ms=part.service_ms,
            queue_ms=max(0.0, waited_ms),
            batch_size=part.batch_size,
        )

    async def generate(self, request: pb.ModelInferRequest, on_chunk: OnChunk | None = None) -> LocalAnswer:
        """A generative request: its text (and each chunk to ``on_chunk`` as it is made)."""
        from stratus.local_generation import text_response

        assert self.generators is not None
        done = await self.generators.generate(request, on_chunk)
        response = text_response(request, done.text)
        set_parameter(response.parameters, FINISH_REASON, done.finish_reason)
        usage = Chunk(tokens=(), prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens)
        write_usage(response, usage)
        return LocalAnswer(
            response=response,
            variant=done.variant,
            confidences=(done.confidence,),
            service_ms=done.service_ms,
            queue_ms=0.0,
            batch_size=1,
        )

    async def _run_batch(self, batch: Batch[dict[str, Array], _Part]) -> list[_Part]:
        """On the executor; or right here when this variant's calls are known to be tiny.

        Handing a call to a thread and back costs two wake-ups and a GIL hand-over, which
        for a model that runs in tens of microseconds is most of the request. Once a
        variant's recent p90 is under ``inline_below_ms``, its batches run on the event loop,
        which they hold for less than that; a variant that slows down goes back to a thread.
        """
        if batch.key.variant in self._inline:
            return self._infer_batch(batch.key, batch.payloads, batch.sizes)
        return await self.executor.run(self._infer_batch, batch.key, batch.payloads, batch.sizes)

    def _judge_inline(self, variant: str) -> None:
        """Every INLINE_REVIEW calls: may this variant run on the event loop?"""
        window = self.latency[variant]
        if window.count % INLINE_REVIEW:
            return
        # p90, not p99: a call that a busy machine happened to preempt is not the call's cost
        recent = window.percentile(90, last=INLINE_REVIEW)
        fast = self.settings.inline_below_ms > 0 and recent < self.settings.inline_below_ms
        if fast:
            self._inline.add(variant)
        else:
            self._inline.discard(variant)

    def _infer_batch(
        self, key: BatchKey, members: Sequence[Mapping[str, Array]], sizes: Sequence[int]
    ) -> list[_Part]:
        """On an executor thread: join the members' inputs, run once, split per member."""
        variant = self.variants[key.variant]
        family = self.families[variant.family]
        joined = members[0] if len(members) == 1 else _join(members)
        outputs, service_ms = self._timed_infer(key.variant, joined)
        self.latency[key.variant].add(service_ms)
        self._judge_inline(key.variant)
        if self.recorder is not None:
            labels = (key.variant, self._runtime[key.variant], variant.precision)
            self.recorder.inference.labels(*labels).observe(service_ms / 1000.0)
            self.recorder.batch_items.labels(key.variant).observe(sum(sizes))
        scores = self.score(family, variant, outputs)
        wanted = key.outputs or tuple(s.name for s in family.outputs)
        total = sum(sizes)
        return [
            _Part(
                outputs={name: outputs[name][start:stop] for name in wanted},
                confidences=scores[start:stop],
                service_ms=service_ms,
                batch_size=total,
            )
            for start, stop in split_counts(total, sizes)
        ]

    @staticmethod
    def score(family: FamilySpec, variant: VariantSpec, outputs: Mapping[str, Array]) -> Array:
        """Each item's confidence, as the family says, at the variant's fitted temperature."""
        spec = family.confidence
        return confidence(
            outputs[spec.output],
            method=spec.method,
            apply_softmax=spec.apply_softmax,
            temperature=variant.temperature,
        )

    def _timed_infer(self, variant: str, inputs: Mapping[str, Array]) -> tuple[dict[str, Array], float]:
        started = time.perf_counter()
        batch = next(iter(inputs.values())).shape[0]
        if batch == 0:
            family = self.families[self.variants[variant].family]
            outputs = {
                s.name: np.zeros((0, *s.shape[1:]), codec.numpy_dtype(s.datatype)) for s in family.outputs
            }
        else:
            outputs = self.runners[variant].infer(inputs)
        if self.settings.emulated_extra_ms:
            time.sleep(self.settings.emulated_extra_ms / 1000.0)  # on an executor thread, like real compute
        return outputs, (time.perf_counter() - started) * 1000.0

    def families_info(self) -> list[fleet_pb2.FamilyInfo]:
        served = {self.variants[name].family for name in self.served}
        generative = list(self.generators.families.values()) if self.generators is not None else []
        return [
            *map(_family_info, generative),
            *[
                fleet_pb2.FamilyInfo(
                    name=f.name,
                    inputs=tensor_metadata(f.inputs),
                    outputs=tensor_metadata(f.outputs),
                    thresholds=thresholds_to_wire(f.thresholds),
                    cloud_variants=cloud_variants(f),
                    calibrated_cloud_share=calibrated_cloud_share(f),
                    **family_info_fields(f),
                )
                for f in self.families.values()
                if f.name in served
            ],
        ]

    def variants_info(self) -> list[fleet_pb2.VariantInfo]:
        infos = []
        for name in sorted(self.served):
            described = self.runners[name].describe()
            infos.append(
                fleet_pb2.VariantInfo(
                    name=name,
                    family=self.variants[name].family,
                    runtime=described.runtime,
                    device=described.device,
                    precision=self.variants[name].precision,
                    dynamic_batch=described.dynamic_batch,
                    max_batch=self.max_batch(name),
                    chosen_because=self.reasons.get(name, ""),
                    line=self.variants[name].parent or name,
                    current=name in self.current,
                )
            )
        if self.generators is not None:
            infos += _generator_infos(self.generators)
        return infos

    def unavailable_info(self) -> list[fleet_pb2.FamilyUnavailable]:
        return [  # bounded: a Hello is checked against a size limit at the router
            fleet_pb2.FamilyUnavailable(family=n.family, variant=n.variant, reason=n.reason[:_REASON_CHARS])
            for n in self.unavailable_families().values()
        ]

    def close(self) -> None:
        if self.generators is not None:
            self.generators.close()
        self.batcher.close(Unavailable("the models here are shutting down"))
        self.executor.shutdown(wait=True)
        for runner in self.runners.values():
            runner.close()


def _select(repository: ModelRepository, settings: LocalSettings) -> list[_Chosen]:
    """Named variants as they are; otherwise, per family and tier, every line (the current
    variant and any other FP32 variant, a rollout's candidate) in its best precision here."""
    if settings.variants:
        chosen = []
        for name in settings.variants:
            variant = repository.variant(name)
            family = repository.family(variant.family)
            if family.generative:
                continue
            current = family.current.get(variant.tier) == (variant.parent or variant.name)
            chosen.append(_Chosen(family, variant, "named", current=current))
        return chosen
    hardware = settings.hardware or this_hardware()
    chosen = []
    for family in repository.families.values():
        if family.generative:
            continue  # LocalGenerators loads those
        tiers = [settings.tier] if settings.tier is not None else family.tiers()
        for tier in tiers:
            for line in family.lines(tier):
                current = line.name == family.current.get(tier)
                try:
                    choice = choose_variant(
                        family,
                        tier,
                        hardware=hardware,
                        record=load_verification(family),
                        override=settings.precision,
                        line=line,
                    )
                except StratusError as exc:
                    if current:
                        raise
                    log.warning("%s on %s: not serving %s: %s", family.name, tier.label, line.name, exc)
                    continue
                role = "current" if current else "not current"
                only = choice.variant.runtimes
                log.info(
                    "%s on %s: %s, %s (%s)%s",
                    family.name,
                    tier.label,
                    choice.variant.name,
                    role,
                    choice.reason,
                    f"; runtimes {', '.join(only)} only (family.toml)" if only else "",
                )
                chosen.append(_Chosen(family, choice.variant, choice.reason, current=current))
    return chosen


def _generators(
    repository: ModelRepository, settings: LocalSettings, recorder: ModelMetrics | None
) -> LocalGenerators | None:
    """The generative variants of the same tier (or among the named variants), if any."""
    if not any(f.generative for f in repository.families.values()):
        return None
    from stratus.local_generation import LocalGenerators

    options = LoadOptions(
        tier=settings.tier or Tier.CLOUD, cache_dir=settings.cache_dir, concurrency=settings.concurrency
    )
    return LocalGenerators(
        repository,
        tier=settings.tier,
        variants=list(settings.variants) if settings.variants else None,
        options=options,
        runtimes=list(settings.runtimes) if settings.runtimes else None,
        emulated_extra_ms=settings.emulated_extra_ms,
        recorder=recorder,
    )


def _family_info(family: FamilySpec) -> fleet_pb2.FamilyInfo:
    """A generative family as the router needs it: its tensors, thresholds and limits."""
    assert family.generation is not None
    return fleet_pb2.FamilyInfo(
        name=family.name,
        inputs=tensor_metadata(family.inputs),
        outputs=tensor_metadata(family.outputs),
        thresholds=thresholds_to_wire(family.thresholds),
        kind="generative",
        confidence_method=family.generation.method.value,
        max_tokens=family.generation.max_tokens,
        stop=family.generation.stop,
        cloud_variants=cloud_variants(family),
        calibrated_cloud_share=calibrated_cloud_share(family),
        **family_info_fields(family),
    )


def calibrated_cloud_share(family: FamilySpec) -> float | None:
    """What calibrate recorded the thresholds send to the cloud; None (the field stays unset,
    and the router exports no baseline) for thresholds never calibrated."""
    return family.calibration.cloud_share if family.calibration is not None else None


def cloud_variants(family: FamilySpec) -> list[str]:
    """The family's cloud-tier variants, its current line first, then that line's children."""
    current = family.current.get(Tier.CLOUD)
    names = [v.name for v in family.variants_for(Tier.CLOUD)]
    return sorted(names, key=lambda n: (n != current, not n.startswith(f"{current}-"), n))


def _generator_infos(generators: LocalGenerators) -> list[fleet_pb2.VariantInfo]:
    return [
        fleet_pb2.VariantInfo(
            name=name,
            family=variant.family,
            runtime=generators.runners[name].runtime,
            device="CPU",
            precision=variant.precision,
            kv_cache=generators.runners[name].kv_cache_precision,
            max_batch=1,
            chosen_because="generative"
            if generators.lines[name] == name
            else f"generative: the {variant.precision} file of {generators.lines[name]}",
            line=generators.lines[name],
            current=name in generators.current,
        )
        for name, variant in sorted(generators.variants.items())
    ]


@dataclass(frozen=True)
class _Chosen:
    family: FamilySpec
    variant: VariantSpec
    reason: str
    current: bool = True


def _requested_outputs(request: pb.ModelInferRequest, family: FamilySpec) -> list[str]:
    known = [s.name for s in family.outputs]
    wanted = [o.name for o in request.outputs] or known
    for name in wanted:
        if name not in known:
            raise InvalidInput(f"model '{family.name}' has no output '{name}'; it gives {known}")
    return wanted


def _answer_raw(request: pb.ModelInferRequest, outputs: Mapping[str, Array]) -> bool:
    return answer_raw(request, (codec.datatype_of(a) for a in outputs.values()))


def _key(variant: str, inputs: Mapping[str, Array], outputs: Sequence[str]) -> BatchKey:
    """Requests share a batch only with the same variant, per-item input shapes and outputs."""
    return BatchKey(
        variant=variant,
        inputs=tuple((name, a.dtype.str, tuple(a.shape[1:])) for name, a in inputs.items()),
        outputs=tuple(outputs),
        batchable=all(a.ndim > 0 and a.dtype.kind not in "OSU" for a in inputs.values()),
    )


def _join(members: Sequence[Mapping[str, Array]]) -> dict[str, Array]:
    return {name: np.concatenate([m[name] for m in members]) for name in members[0]}


class LocalDataPlane(DataPlane):
    """Serves the variants loaded here: the cloud gateway, and an agent's ``--serve``."""

    def __init__(self, models: LocalModels, *, tier: Tier, name: str) -> None:
        self.models = models
        self.tier = tier
        self.name = name

    def ready(self) -> bool:
        return bool(self.models.runners) or bool(self.models.generators and self.models.generators.runners)

    def model_ready(self, name: str) -> bool:
        return name in self.models.model_names()

    def model_names(self) -> list[str]:
        return self.models.model_names()

    def model_metadata(self, name: str) -> pb.ModelMetadataResponse:
        family, variant = self.models.variant_for(name)
        if family.generative:
            return generative_metadata(name, self._runtime(variant.name))
        return pb.ModelMetadataResponse(
            name=name,
            versions=[MODEL_VERSION],
            platform=self._runtime(variant.name),
            inputs=tensor_metadata(family.inputs),
            outputs=tensor_metadata(family.outputs),
        )

    def model_config(self, name: str) -> pb.ModelConfig:
        family, variant = self.models.variant_for(name)
        if family.generative:
            assert family.generation is not None
            max_tokens = family.generation.max_tokens
            return generative_config(name, self._runtime(variant.name), max_tokens, variant=variant.name)
        config = model_config(family, name, self._runtime(variant.name))
        config.parameters[VARIANT].string_value = variant.name  # the variant that answers ``name`` here
        return config

    def _runtime(self, variant: str) -> str:
        generators = self.models.generators
        if generators is not None and variant in generators.runners:
            return generators.runners[variant].runtime
        return self.models.runners[variant].describe().runtime

    def generate(
        self, request: pb.ModelInferRequest, *, timeout_s: float | None
    ) -> AsyncIterator[pb.ModelInferResponse]:
        if not self.models.generates(request.model_name):
            return super().generate(request, timeout_s=timeout_s)
        return self._generate(request)

    async def _generate(self, request: pb.ModelInferRequest) -> AsyncIterator[pb.ModelInferResponse]:
        """Each token as a response as soon as it is made, then a final one with the finish
        reason and who answered; a caller that stops reading stops the generation."""
        chunks: asyncio.Queue[Chunk | None] = asyncio.Queue()

        async def on_chunk(chunk: Chunk) -> None:
            chunks.put_nowait(chunk)

        task = asyncio.create_task(self.models.generate(request, on_chunk))
        task.add_done_callback(lambda _: chunks.put_nowait(None))
        try:
            with counted(lambda outcome: self.models.count(outcome, request.model_name)):
                while (chunk := await chunks.get()) is not None:
                    yield chunk_response(request, chunk)
                answer = await task
        finally:  # the caller went away (cancelled, or stopped reading): stop generating
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        reason = parameter_value(answer.response.parameters[FINISH_REASON])
        prompt_tokens, completion_tokens = read_usage(answer.response.parameters)
        ending = Chunk(
            tokens=(),
            finish_reason=str(reason),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )
        final = chunk_response(request, ending)
        set_parameter(final.parameters, FINAL, True)
        self._served(answer).write(final.parameters)
        yield final

    def _served(self, answer: LocalAnswer) -> Served:
        return Served(
            tier=self.tier,
            agent=self.name,
            variant=answer.variant.name,
            precision=answer.variant.precision,
            confidence=answer.confidence,
            path=(self.tier,),
            timings_ms={self.tier: answer.service_ms},
            queue_ms=answer.queue_ms,
            compute_ms=answer.service_ms,
        )

    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        """Answered within the caller's deadline, or DEADLINE_EXCEEDED: a request whose caller
        has given up holds no slot or queue place here."""
        with counted(lambda outcome: self.models.count(outcome, request.model_name)):
            try:
                async with asyncio.timeout(timeout_s):
                    answer = await self.models.answer(request)
            except TimeoutError:
                raise DeadlineExceeded(f"no answer within the caller's deadline ({timeout_s:g} s)") from None
        self._served(answer).write(answer.response.parameters)
        set_parameter(answer.response.parameters, BATCH_SIZE, answer.batch_size)
        return answer.response


_TYPE_NAMES = {"BOOL": "TYPE_BOOL", "BYTES": "TYPE_STRING"}


def model_config(family: FamilySpec, name: str, backend: str) -> pb.ModelConfig:
    """Triton's ModelConfig for a family: dims without the batch dimension."""

    def data_type(datatype: str) -> pb.DataType.ValueType:
        return pb.DataType.Value(_TYPE_NAMES.get(datatype, f"TYPE_{datatype}"))

    return pb.ModelConfig(
        name=name,
        platform=backend,
        backend=backend,
        max_batch_size=MAX_REQUEST_ITEMS,
        input=[
            pb.ModelInput(name=s.name, data_type=data_type(s.datatype), dims=s.shape[1:])
            for s in family.inputs
        ],
        output=[
            pb.ModelOutput(name=s.name, data_type=data_type(s.datatype), dims=s.shape[1:])
            for s in family.outputs
        ],
    )


def family_info_fields(family: FamilySpec) -> dict[str, Any]:
    """The FamilyInfo fields for a family's audits (keyword arguments of its constructor)."""
    audit = fleet_pb2.AuditSettings(compare=family.audit.compare)
    if family.audit.share is not None:
        audit.share = family.audit.share
    if family.audit.max_per_s is not None:
        audit.max_per_s = family.audit.max_per_s
    calibrated = {tier.label: calibration_info(f) for tier, f in family.tier_accuracy.items()}
    return {"audit": audit, "calibrated": calibrated}
