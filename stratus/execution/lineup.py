"""Which classifier variants are loaded here and which of them serve, and every change to that:
the load at start, a reload, a rollout followed, a replaced runner retired after its grace.

:class:`~stratus.execution.local_models.LocalModels` resolves each request's name against the
tables kept here (read on every request) and runs it; only :class:`Lineup` changes them,
and rarely, so the request path never holds the code that swaps what it reads. Each loaded
variant's runner is installed in the :class:`~stratus.execution.running.Running` kept here,
which runs its batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from stratus.errors import ModelLoadError, NotFound
from stratus.execution.generators import RETIRE_GRACE_S, LocalGenerators, NotLoaded
from stratus.execution.loading import Chosen, LocalSettings, load_at_start, load_variant, select_variants
from stratus.execution.running import Running
from stratus.families.repository import ModelRepository
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.obs.metrics import ModelMetrics
from stratus.runtimes import LoadFailure, ModelRunner
from stratus.tiers import Tier

log = logging.getLogger("stratus.models")


class Lineup:
    """The classifier variants loaded here (those still retiring after a reload included),
    which of them are announced (``served``) and which answer their family (``current``).

    Filled at start from ``chosen``; swapped by :meth:`reload`, all or nothing together with
    the generative variants (``generators``, which keep their own tables). The dicts are only
    ever changed in place, so a reader may hold them; ``served`` and ``current`` are replaced
    whole, so they are read through this object.
    """

    def __init__(
        self,
        chosen: Sequence[Chosen],
        settings: LocalSettings,
        generators: LocalGenerators | None,
        recorder: ModelMetrics | None,
    ) -> None:
        self.settings = settings
        self.generators = generators
        self.recorder = recorder
        self.reasons: dict[str, str] = {}  # why each variant was chosen (a Hello says it)
        self.variants: dict[str, VariantSpec] = {}  # loaded, including any still retiring
        self.families: dict[str, FamilySpec] = {}
        self.served: set[str] = set()  # the variants announced: not retiring
        self.current: set[str] = set()  # served variants that answer their family's requests
        self._stamps: dict[str, tuple[VariantSpec, tuple[tuple[int, int], ...]]] = {}
        # What each loaded variant's runtime says of itself (RuntimeDescription): whether it
        # takes a dynamic batch, and the arithmetic it computes in.
        self.dynamic_batch: dict[str, bool] = {}
        self.computes: dict[str, str] = {}
        # Every runtime that refused a file, and the families (by name) whose current variant
        # no runtime here could load: those are not ready here, and say why.
        self.load_failures: list[LoadFailure] = []
        self.unavailable: dict[str, NotLoaded] = {}
        self.running = Running(settings, self.variants, self.families, recorder)
        loaded = [
            pair
            for c in chosen
            if (pair := load_at_start(c, settings, self.load_failures, self.unavailable)) is not None
        ]
        self._install([c for c, _ in loaded], {c.variant.name: runner for c, runner in loaded})
        self._count_load_failures()
        if not self.running.runners and not (generators and generators.runners):
            raise ModelLoadError(
                f"nothing could be loaded here: {self.unavailable_reasons() or 'no variants'}"
            )

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

    def _install(self, chosen: Sequence[Chosen], runners: Mapping[str, ModelRunner]) -> None:
        """Serve exactly ``chosen`` from now on; variants left out stay loaded but retiring."""
        for c in chosen:
            name = c.variant.name
            if self.running.runners.get(name) is not runners[name]:
                described = runners[name].describe()
                self.running.install(name, runners[name], described.runtime)
                self.dynamic_batch[name] = described.dynamic_batch
                self.computes[name] = described.compute
            self.variants[name] = c.variant
            self.families[c.family.name] = c.family
            self.reasons[name] = c.reason
            self._stamps[name] = (c.variant, c.variant.file_stamps())
        self.served = {c.variant.name for c in chosen}
        self.current = {c.variant.name for c in chosen if c.current}

    async def reload(self, repository: ModelRepository) -> list[str]:
        """Serve what ``repository`` chooses now: what is new or changed is loaded and warmed
        first (an unchanged variant keeps its runner); a runner replaced is retired after
        RETIRE_GRACE_S. Nothing changes where anything fails to load, generative or not.
        Returns every variant now served."""
        chosen = select_variants(repository, self.settings)
        if not chosen and self.generators is None:
            raise NotFound(f"no variants to load from {repository.root}")
        loop = asyncio.get_running_loop()
        runners: dict[str, ModelRunner] = {}
        fresh: list[ModelRunner] = []
        try:
            for c in chosen:
                name = c.variant.name
                if self._unchanged(c):
                    runners[name] = self.running.runners[name]
                    continue
                log.info("loading %s (%s) from %s", name, c.variant.precision, repository.root)
                runners[name] = await loop.run_in_executor(
                    None, load_variant, c, self.settings, self.load_failures
                )
                fresh.append(runners[name])
            if self.generators is not None:
                await self.generators.reload(repository)  # all or nothing, like the rest
        except Exception:
            for runner in fresh:
                runner.close()
            raise
        replaced = {n: r for n, r in self.running.runners.items() if runners.get(n) is not r}
        self._install(chosen, runners)
        for name, runner in replaced.items():
            loop.call_later(RETIRE_GRACE_S, self._retire, name, runner)
        served = sorted({*self.served, *(self.generators.variants if self.generators else ())})
        log.info("reloaded: serving %s", served)
        return served

    def _unchanged(self, c: Chosen) -> bool:
        """Whether ``c`` is loaded here already, from the same config entry and files."""
        loaded = c.variant.name in self.running.runners
        return loaded and self._stamps.get(c.variant.name) == (c.variant, c.variant.file_stamps())

    def _retire(self, name: str, runner: ModelRunner) -> None:
        """Close a runner replaced by a reload once its grace is over (unless it came back)."""
        if self.running.runners.get(name) is runner and name not in self.served:
            self.running.forget(name)
            del self.variants[name]
        if self.running.runners.get(name) is not runner:
            runner.close()

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
        others = {
            n for n in self.current if self.variants[n].family == family and self.variants[n].tier is tier
        }
        self.current = (self.current - others) | {loaded[0]}
        return True
