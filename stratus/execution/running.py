"""A variant's batches run on its runtime: on the event loop for a variant known to be tiny,
else on the bounded executor's threads; timed, recorded, scored, split per member.

:class:`~stratus.execution.lineup.Lineup` decides what is loaded and served,
:class:`~stratus.execution.local_models.LocalModels` which variant a name runs on; :class:`Running`
holds the loaded runtimes and runs their batches.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from stratus import datatypes
from stratus.datatypes import Array
from stratus.execution.loading import LocalSettings
from stratus.families.confidence import confidence
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.obs.metrics import ModelMetrics
from stratus.obs.stats import LatencyWindow
from stratus.runtimes import ModelRunner
from stratus.sched.batching import BatchKey, split_counts
from stratus.sched.executor import BoundedExecutor

# Calls between two looks at whether a variant is fast enough to run on the event loop.
INLINE_REVIEW = 64


@dataclass(frozen=True, kw_only=True)
class Part:
    """One member's share of a batch that ran."""

    outputs: dict[str, Array]
    confidences: Array
    service_ms: float
    batch_size: int


@dataclass(frozen=True, kw_only=True)
class LocalRun:
    """Arrays run on a variant here: each output, and each item's confidence, in order."""

    outputs: dict[str, Array]
    variant: VariantSpec
    confidences: tuple[float, ...]
    service_ms: float  # running the batch these items ran in
    queue_ms: float  # waiting for a slot
    batch_size: int  # items in that batch


class Running:
    """The loaded runtimes, by variant, and the runs of their batches. ``variants`` and
    ``families`` are the models' own tables (what each loaded variant is), read here."""

    def __init__(
        self,
        settings: LocalSettings,
        variants: Mapping[str, VariantSpec],
        families: Mapping[str, FamilySpec],
        recorder: ModelMetrics | None,
    ) -> None:
        self.settings = settings
        self.variants, self.families = variants, families
        self.recorder = recorder
        self.runners: dict[str, ModelRunner] = {}
        self.latency: dict[str, LatencyWindow] = {}
        self.runtimes: dict[str, str] = {}  # each runner's runtime, as its metrics label it
        self.inline: set[str] = set()  # variants fast enough to run on the event loop
        self.formed_items = 0  # items of batches formed elsewhere running now (run_formed)
        # Each thread may have one closed batch ready behind the one it runs, so it never
        # waits on the event loop between batches; the batcher holds everything else.
        workers = settings.concurrency
        self.executor = BoundedExecutor(name=settings.executor_name, workers=workers, queue_limit=workers)

    def install(self, name: str, runner: ModelRunner, runtime: str) -> None:
        """``runner`` runs ``name`` from now on, judged afresh (on threads until it has shown it is tiny)."""
        self.runners[name] = runner
        self.latency[name] = LatencyWindow()
        self.runtimes[name] = runtime
        self.inline.discard(name)

    def forget(self, name: str) -> None:
        del self.runners[name]
        self.latency.pop(name, None)

    async def run(self, key: BatchKey, members: Sequence[dict[str, Array]], sizes: Sequence[int]) -> list[Part]:
        """On the executor; or right here when this variant's calls are known to be tiny.

        Handing a call to a thread and back costs two wake-ups and a GIL hand-over, which
        for a model that runs in tens of microseconds is most of the request. Once a
        variant's recent p90 is under ``inline_below_ms``, its batches run on the event loop,
        which they hold for less than that; a variant that slows down goes back to a thread.
        """
        if key.variant in self.inline:
            return self._infer_batch(key, members, sizes)
        return await self.executor.run(self._infer_batch, key, members, sizes)

    async def run_formed(self, key: BatchKey, inputs: dict[str, Array], size: int) -> Part:
        """A batch formed elsewhere (the Batcher in front of the router's own agent, which
        holds its slot), run at once and counted as running."""
        self.formed_items += size
        try:
            (part,) = await self.run(key, (inputs,), (size,))
        finally:
            self.formed_items -= size
        return part

    def _judge_inline(self, variant: str) -> None:
        """Every INLINE_REVIEW calls: may this variant run on the event loop?"""
        window = self.latency[variant]
        if window.count % INLINE_REVIEW:
            return
        # p90, not p99: a call that a busy machine happened to preempt is not the call's cost
        recent = window.percentile(90, last=INLINE_REVIEW)
        fast = self.settings.inline_below_ms > 0 and recent < self.settings.inline_below_ms
        if fast:
            self.inline.add(variant)
        else:
            self.inline.discard(variant)

    def _infer_batch(self, key: BatchKey, members: Sequence[Mapping[str, Array]], sizes: Sequence[int]) -> list[Part]:
        """On an executor thread: join the members' inputs, run once, split per member."""
        variant = self.variants[key.variant]
        family = self.families[variant.family]
        joined = members[0] if len(members) == 1 else _join(members)
        outputs, service_ms = self._timed_infer(key.variant, joined)
        self.latency[key.variant].add(service_ms)
        self._judge_inline(key.variant)
        if self.recorder is not None:
            labels = (key.variant, self.runtimes[key.variant], variant.precision)
            self.recorder.inference_of(*labels).observe(service_ms / 1000.0)
            self.recorder.batch_items_of(key.variant).observe(sum(sizes))
        scores = score(family, variant, outputs)
        wanted = key.outputs or tuple(s.name for s in family.outputs)
        total = sum(sizes)
        return [
            Part(
                outputs={name: outputs[name][start:stop] for name in wanted},
                confidences=scores[start:stop],
                service_ms=service_ms,
                batch_size=total,
            )
            for start, stop in split_counts(total, sizes)
        ]

    def _timed_infer(self, variant: str, inputs: Mapping[str, Array]) -> tuple[dict[str, Array], float]:
        started = time.perf_counter()
        batch = next(iter(inputs.values())).shape[0]
        if batch == 0:
            family = self.families[self.variants[variant].family]
            outputs = {
                s.name: np.zeros((0, *s.shape[1:]), datatypes.numpy_dtype(s.datatype)) for s in family.outputs
            }
        else:
            outputs = self.runners[variant].infer(inputs)
        if self.settings.emulated_extra_ms:
            time.sleep(self.settings.emulated_extra_ms / 1000.0)  # on an executor thread, like real compute
        return outputs, (time.perf_counter() - started) * 1000.0

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        for runner in self.runners.values():
            runner.close()


def score(family: FamilySpec, variant: VariantSpec, outputs: Mapping[str, Array]) -> Array:
    """Each item's confidence, as the family says, at the variant's fitted temperature."""
    spec = family.confidence
    return confidence(
        outputs[spec.output],
        method=spec.method,
        apply_softmax=spec.apply_softmax,
        temperature=variant.temperature,
    )


def batch_key(variant: str, inputs: Mapping[str, Array], outputs: Sequence[str]) -> BatchKey:
    """Requests share a batch only with the same variant, per-item input shapes and outputs."""
    return BatchKey(
        variant=variant,
        inputs=tuple((name, a.dtype.str, tuple(a.shape[1:])) for name, a in inputs.items()),
        outputs=tuple(outputs),
        batchable=all(a.ndim > 0 and a.dtype.kind not in "OSU" for a in inputs.values()),
    )


def _join(members: Sequence[Mapping[str, Array]]) -> dict[str, Array]:
    return {name: np.concatenate([m[name] for m in members]) for name in members[0]}
