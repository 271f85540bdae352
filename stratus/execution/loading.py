"""Which variants this machine serves, and loading them: the settings that say so, the
choice per family and tier (named variants, or each line in its best precision here), a
failed child's fallback to its FP32 parent, and the generative variants beside them.
``LocalModels`` (``stratus.execution.local_models``) holds what this loads and serves it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stratus.errors import ConfigError, ModelLoadError, RuntimeUnavailable, StratusError
from stratus.execution.generators import NotLoaded
from stratus.families.cpu import Hardware, this_hardware
from stratus.families.precision import choose_variant, load_verification
from stratus.families.repository import ModelRepository
from stratus.families.spec import FamilySpec, VariantSpec
from stratus.obs.metrics import ModelMetrics
from stratus.runtimes import LoadFailure, LoadOptions, ModelRunner, load_runner
from stratus.sched.batching import DEFAULT_MAX_BATCH, DEFAULT_MAX_DELAY_S
from stratus.tiers import Tier

if TYPE_CHECKING:
    from stratus.execution.generators import LocalGenerators

log = logging.getLogger("stratus.models")


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


@dataclass(frozen=True)
class Chosen:
    """A variant to serve here, why it was chosen, and whether it answers its family's requests."""

    family: FamilySpec
    variant: VariantSpec
    reason: str
    current: bool = True


def select_variants(repository: ModelRepository, settings: LocalSettings) -> list[Chosen]:
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
            chosen.append(Chosen(family, variant, "named", current=current))
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
                chosen.append(Chosen(family, choice.variant, choice.reason, current=current))
    return chosen


def load_generators(
    repository: ModelRepository, settings: LocalSettings, recorder: ModelMetrics | None
) -> LocalGenerators | None:
    """The generative variants of the same tier (or among the named variants), if any."""
    if not any(f.generative for f in repository.families.values()):
        return None
    from stratus.execution.generators import LocalGenerators

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


def load_variant(chosen: Chosen, settings: LocalSettings, failures: list[LoadFailure]) -> ModelRunner:
    options = LoadOptions(
        tier=chosen.variant.tier, cache_dir=settings.cache_dir, concurrency=settings.concurrency
    )
    return load_runner(
        chosen.family,
        chosen.variant,
        options,
        runtimes=settings.runtimes,
        failures=failures,
    )


def load_at_start(
    chosen: Chosen, settings: LocalSettings, failures: list[LoadFailure], unavailable: dict[str, NotLoaded]
) -> tuple[Chosen, ModelRunner] | None:
    """The chosen variant loaded; where no runtime here loads a lower-precision child,
    its FP32 parent; where nothing loads, None, with the family marked unavailable (a
    current variant) so the rest of the process still serves."""
    try:
        return chosen, load_variant(chosen, settings, failures)
    except (ModelLoadError, RuntimeUnavailable) as exc:
        failed = str(exc)
    parent = chosen.variant.parent
    if parent is not None and settings.variants is None:
        fallback = Chosen(
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
            return fallback, load_variant(fallback, settings, failures)
        except (ModelLoadError, RuntimeUnavailable) as exc:
            failed = f"{failed}; {parent}: {exc}"
    if chosen.current:
        unavailable[chosen.family.name] = NotLoaded(
            family=chosen.family.name, variant=chosen.variant.name, reason=failed
        )
    log.error("%s: not serving %s: %s", chosen.family.name, chosen.variant.name, failed)
    return None
