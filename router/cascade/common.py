"""What both cascades share: the narrow view of the router they run in, and the budget; and
a classifier request's values (its Job, each tier's Answer, a rollout's Arm) and its one send.

A cascade performs the climb that :mod:`router.policy.climb` decides. It needs the fleet
(the registry and the cloud), a clock, a random source, the snapshot of a model and an
observer, not the data plane itself: :class:`CascadeContext` is that view, which
:class:`router.dataplane.RouterDataPlane` satisfies, so the cascades never import it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from router.backends.base import Backend
from router.cloud.pool import CloudTier
from router.fleet.registry import FleetRegistry
from router.observer import RouterObserver
from router.offline import Offline
from router.policy import FleetSnapshot, Target
from router.policy.climb import CloudFacts
from router.rollout.plan import Plan
from router.rollout.plans import Rollouts
from stratus.convert.parameters import RequestOptions
from stratus.convert.tensors import Tensors
from stratus.tiers import Tier

# A request with neither a budget nor a deadline still ends: nothing waits forever on a
# peer that stopped answering without dropping its link.
DEFAULT_BUDGET_MS = 30_000.0
# At most this much of a request's remaining budget is kept back for answering the client.
RETURN_MARGIN_MS = 5.0


class CascadeContext(Protocol):
    """The router as a cascade sees it."""

    @property
    def registry(self) -> FleetRegistry: ...

    @property
    def cloud(self) -> CloudTier | None: ...

    @property
    def rollouts(self) -> Rollouts: ...

    @property
    def offline(self) -> Offline | None:
        """Deferred requests, corrections and decision records (router/offline), where kept."""
        ...

    @property
    def observer(self) -> RouterObserver: ...

    @property
    def fail_without_cloud(self) -> bool: ...

    @property
    def rng(self) -> random.Random: ...

    @property
    def warned_short(self) -> set[str]:
        """Families whose unsure answers had nowhere higher to go (logged once each)."""
        ...

    def now(self) -> float:
        """The router's clock, in seconds."""
        ...

    def snapshot(self, model: str) -> FleetSnapshot[Backend]: ...

    def cloud_serves(self, model: str) -> bool:
        """The cloud serves ``model`` and may be sent its items ([privacy] escalate)."""
        ...

    def escalates(self, model: str) -> bool:
        """Whether ``model``'s family lets its items leave the site."""
        ...

    def background(self, work: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Run ``work`` beside the request (a shadow); False when too many already run."""
        ...


def cloud_facts(context: CascadeContext, model: str) -> CloudFacts | None:
    """What the climb's end needs to know of the cloud, where there is one."""
    cloud = context.cloud
    if cloud is None:
        return None
    return CloudFacts(serves=context.cloud_serves(model), status=cloud.status, fail_without=context.fail_without_cloud)


def request_budget(budget_ms: float | None, timeout_s: float | None) -> float:
    """The tighter of the client's ``stratus.budget_ms`` and its gRPC deadline."""
    limits = [b for b in (budget_ms, timeout_s * 1000.0 if timeout_s is not None else None) if b is not None]
    return min(limits) if limits else DEFAULT_BUDGET_MS


def allowed_ms(remaining_ms: float) -> float:
    """What a tier may take of the remaining budget: a little is kept for the way back, so a
    late tier times out here and the best answer so far still reaches the client in time."""
    return remaining_ms - min(RETURN_MARGIN_MS, remaining_ms * 0.1)


def pinned_options(options: RequestOptions, tiers: frozenset[Tier]) -> RequestOptions:
    """A pinned variant's request: exactly its tier, and whatever it answers."""
    if not tiers:
        return options
    tier = min(tiers)
    return RequestOptions(budget_ms=options.budget_ms, min_confidence=0.0, min_tier=tier, max_tier=tier)


@dataclass(frozen=True, kw_only=True)
class Answer:
    """One tier's answer for the items it was sent."""

    tier: Tier
    agent: str
    variant: str
    outputs: Tensors
    confidences: tuple[float, ...]
    elapsed_ms: float
    precision: str = ""  # of the variant that answered, where it is known
    compute: str = ""  # the arithmetic its runtime computed in, where it is known
    queue_ms: float = 0.0  # of elapsed_ms, waiting for a slot (where the tier said so)
    compute_ms: float = 0.0  # ... and running in a runtime
    arm: Arm | None = None  # the rollout arm it answered for, where a rollout runs on its tier


@dataclass(frozen=True, kw_only=True)
class Job:
    """One client request, checked and converted once at the boundary."""

    id: str
    asked_for: str  # the model name the client used
    family: str
    pinned: str | None
    label: str  # the family its metrics count it under (a variant only the cloud serves: its family's)
    options: RequestOptions
    inputs: Tensors
    outputs: tuple[str, ...]  # requested outputs; empty: all
    raw: bool  # answer with raw buffers (else typed contents, as the client sent)
    budget_ms: float
    started: float

    @property
    def model(self) -> str:
        """What agents and the cloud are asked to run."""
        return self.pinned or self.family


@dataclass(frozen=True, kw_only=True)
class Arm:
    """The rollout arm a step's items went to: the candidate's, or the current line's."""

    plan: Plan
    candidate: bool


async def dispatch(
    context: CascadeContext,
    target: Target[Backend],
    job: Job,
    items: Tensors,
    remaining_ms: float,
    *,
    model: str | None = None,
) -> Answer:
    """Send items to the chosen target (an agent or the cloud); the answer holds one row per
    item. ``model`` is what the target is asked for when it is not the job's own (a
    rollout's line key)."""
    started = context.now()
    answered = await target.candidate.classify(
        items, model=model or job.model, outputs=job.outputs, request_id=job.id, budget_ms=remaining_ms
    )
    return Answer(
        tier=target.tier,
        agent=answered.agent,
        variant=answered.variant,
        outputs=answered.outputs,
        confidences=answered.confidences,
        elapsed_ms=(context.now() - started) * 1000.0,
        precision=answered.precision,
        compute=answered.compute,
        queue_ms=answered.queue_ms,
        compute_ms=answered.compute_ms,
    )
