"""Models loaded on this machine, served: the data plane over them is in
``stratus.execution.dataplane``, choosing and loading them in ``stratus.execution.loading``,
which are loaded and served, and every change to that (a reload, a rollout followed), in
``stratus.execution.lineup``, and what a Hello says about them in ``stratus.execution.describe``.

Used by the edge agent (for Work from the router and for its local ``--serve``
endpoint), the cloud gateway and the on-device SDK: check the request, run the variant
(``stratus.execution.running``: on the bounded executor, or on the loop for a tiny model),
compute the confidence as the family config says, encode the answer. A batch's confidence is its least confident item: one unsure item is
reason enough to ask a bigger model about the batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from stratus import datatypes
from stratus.convert.inference import InferRequest, InferResult
from stratus.convert.text import text_result
from stratus.datatypes import Array
from stratus.errors import NotFound, StratusError, Unavailable
from stratus.execution.generators import NotLoaded
from stratus.execution.lineup import Lineup
from stratus.execution.loading import LocalSettings, load_generators, select_variants
from stratus.execution.running import LocalRun, Part, batch_key
from stratus.families.chat import CHAT_TEMPLATE
from stratus.families.cpu import Hardware, this_hardware
from stratus.families.generation import FINISH_REASON, Chunk
from stratus.families.repository import ModelRepository
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.obs.metrics import UNKNOWN, Metric, Metrics, ModelMetrics, gauge
from stratus.sched.batching import Batch, Batcher
from stratus.tiers import Tier

if TYPE_CHECKING:
    from stratus.execution.generators import OnChunk

@dataclass(frozen=True, kw_only=True)
class LocalAnswer:
    result: InferResult
    variant: VariantSpec
    confidences: tuple[float, ...]  # one per item, in order
    service_ms: float  # running the batch this request ran in
    queue_ms: float  # waiting for a slot
    batch_size: int  # items in that batch

    @property
    def confidence(self) -> float:
        """The least confident item's: one unsure item is reason to look again."""
        return min(self.confidences, default=1.0)


class LocalModels:
    """Variants loaded into their best runtimes here, warmed up before first use: which are
    loaded and served is the :class:`~stratus.execution.lineup.Lineup`'s to change; this
    resolves each request's name against its tables and runs it.

    One :class:`~stratus.sched.batching.Batcher` owns the queue in front of the runtimes: it
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
        chosen = select_variants(repository, settings)
        self.generators = load_generators(repository, settings, self.recorder)
        if not chosen and not (self.generators and (self.generators.variants or self.generators.unavailable)):
            raise NotFound(f"no variants to load (tier={settings.tier}, variants={settings.variants})")
        self.lineup = Lineup(chosen, settings, self.generators, self.recorder)
        # Its tables, read on every request (changed in place; served and current are replaced whole)
        self.variants, self.families = self.lineup.variants, self.lineup.families
        self.reasons, self.computes = self.lineup.reasons, self.lineup.computes
        self.running = self.lineup.running
        self.runners, self.latency = self.running.runners, self.running.latency
        self.executor = self.running.executor
        workers = settings.concurrency
        self.batcher: Batcher[dict[str, Array], Part] = Batcher(
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

    @property
    def served(self) -> set[str]:
        """The variants announced here: not retiring (:class:`Lineup`'s)."""
        return self.lineup.served

    @property
    def current(self) -> set[str]:
        """The served variants that answer their family's requests (:class:`Lineup`'s)."""
        return self.lineup.current

    def unavailable_families(self) -> dict[str, NotLoaded]:
        """Families meant to be served here that no runtime could load (:class:`Lineup`'s)."""
        return self.lineup.unavailable_families()

    async def reload(self) -> list[str]:
        """Re-read the models folder; load and warm what is new or changed, then serve it.

        Nothing in flight is lost: a variant that is no longer chosen stops being announced
        at once but keeps answering the work already addressed to it for RETIRE_GRACE_S.
        A folder that no longer loads, or a variant that fails to load, leaves everything as
        it was and raises, saying why.
        """
        repository = ModelRepository.load(self.repository.root)
        served = await self.lineup.reload(repository)
        self.repository = repository
        return served

    def _levels(self) -> list[Metric]:
        """Queue depth and items running (and generations waiting and running), read at each scrape."""
        return [
            gauge("stratus_queue_items", "Items waiting for a runtime slot here.", [], [([], self.batcher.waiting_items)]),
            gauge("stratus_in_flight_items", "Items running in a runtime here.", [], [([], self.running_items)]),
            *(self.generators.levels() if self.generators is not None else ()),
        ]  # fmt: skip

    @property
    def running_items(self) -> int:
        """Items in a runtime now: batches of this batcher's, and batches formed elsewhere."""
        return self.batcher.running_items + self.running.formed_items

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
        return self.settings.max_batch if self.lineup.dynamic_batch.get(variant, False) else 1

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
        local = [v for v in family.variants if v.name in self.lineup.current] if family else []
        if family is not None and local:
            return family, max(local, key=lambda v: v.tier)
        if self.generators is not None and self.generators.serves(model_name):
            return self.generators.variant_for(model_name)
        missing = self.unavailable_families().get(model_name)
        if missing is not None:
            raise Unavailable(f"model '{model_name}' could not be loaded here: {missing.reason}")
        raise NotFound(f"model '{model_name}' is not served here; serving {self.model_names()}")

    def follow(self, family: str, tier: Tier, line: str) -> bool:
        """Answer ``family``'s requests on ``tier`` with ``line`` from now on, as a router serves
        it after a promoted rollout; False, changing nothing, where that line is not loaded here."""
        return self.lineup.follow(family, tier, line)

    def _child_serving(self, line: str) -> VariantSpec | None:
        """The lower-precision variant served here in place of FP32 variant ``line``: its
        name keeps working whatever precision the hardware chose."""
        children = [self.variants[n] for n in self.lineup.served if self.variants[n].parent == line]
        return min(children, key=lambda v: v.name not in self.lineup.current) if children else None

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

    async def answer(self, request: InferRequest) -> LocalAnswer:
        """Check, view the buffers as arrays, wait for a slot (maybe sharing a batch), run."""
        if self.generators is not None and self.generators.serves(request.model_name):
            return await self.generate(request)
        family, _ = self.variant_for(request.model_name)
        checked = request.checked(family.name, family.inputs, family.outputs)  # before decoding anything
        wanted = [spec.name for spec in checked.wanted(family.outputs)]
        ran = await self.run(request.model_name, checked.inputs.arrays(), wanted)
        raw = request.answer_raw(datatypes.datatype_of(a) for a in ran.outputs.values())
        return LocalAnswer(
            result=InferResult(model_name=request.model_name, id=request.id, outputs=ran.outputs, raw=raw),
            variant=ran.variant,
            confidences=ran.confidences,
            service_ms=ran.service_ms,
            queue_ms=ran.queue_ms,
            batch_size=ran.batch_size,
        )

    async def run(
        self, model_name: str, inputs: dict[str, Array], outputs: Sequence[str], *, batched: bool = False
    ) -> LocalRun:
        """Inputs already checked against the family, on the variant ``model_name`` resolves to:
        wait for a slot (maybe sharing a batch), run. The router's own tier calls this with the
        arrays it holds, with no request message in between (router/fleet/in_process.py), and
        ``batched``: its inputs are a batch the Batcher in front of its agent formed and holds a
        slot for, so they run at once (a second batcher here would only add a hand-over, about
        6% of such a request's cost)."""
        _, variant = self.variant_for(model_name)
        size = next(iter(inputs.values())).shape[0] if inputs else 0
        started = time.perf_counter()
        key = batch_key(variant.name, inputs, outputs)
        if batched:
            part = await self.running.run_formed(key, inputs, size)
        else:
            part = await self.batcher.submit(key, inputs, size=size)
        waited_ms = (time.perf_counter() - started) * 1000.0 - part.service_ms
        return LocalRun(
            outputs=part.outputs,
            variant=variant,
            confidences=tuple(part.confidences.tolist()),  # Python floats, as float() makes them
            service_ms=part.service_ms,
            queue_ms=max(0.0, waited_ms),
            batch_size=part.batch_size,
        )

    async def generate(self, request: InferRequest, on_chunk: OnChunk | None = None) -> LocalAnswer:
        """A generative request: its text (and each chunk to ``on_chunk`` as it is made)."""
        assert self.generators is not None
        done = await self.generators.generate(request, on_chunk)
        result = text_result(request, done.text)
        result.parameters[FINISH_REASON] = done.finish_reason
        if done.chat_template is not None:
            result.parameters[CHAT_TEMPLATE] = done.chat_template
        usage = Chunk(tokens=(), prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens)
        result.parameters.update(usage.usage())
        return LocalAnswer(
            result=result,
            variant=done.variant,
            confidences=(done.confidence,),
            service_ms=done.service_ms,
            queue_ms=0.0,
            batch_size=1,
        )

    async def _run_batch(self, batch: Batch[dict[str, Array], Part]) -> list[Part]:
        return await self.running.run(batch.key, batch.payloads, batch.sizes)

    def runs_inline(self, model_name: str) -> bool:
        """Whether ``model_name``'s batches run on the event loop now (see :meth:`Running.run`)."""
        return self.variant_for(model_name)[1].name in self.running.inline

    def close(self) -> None:
        if self.generators is not None:
            self.generators.close()
        self.batcher.fail_waiting(Unavailable("the models here are shutting down"))
        self.running.close()

