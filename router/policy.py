"""The routing policy: a pure function of (attempt, fleet snapshot, random source).

No I/O, no clock reads, no globals: the data plane builds a snapshot and an attempt,
asks where to go, and does the going. Rules, in order:

1. Only tiers above those already tried, within the request's [min_tier, max_tier], and
   only agents that are ready, not excluded (failed for this request) and serve the family
   (or the pinned variant).
2. Never a target whose predicted latency (link RTT + queue wait + service time, from
   moving estimates) exceeds the remaining budget.
3. The lowest such tier; within it, the less loaded of two agents drawn at random
   (power of two choices), which spreads load without herding onto one "best" agent.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from stratus.tiers import Tier


@dataclass(frozen=True, kw_only=True)
class AgentView:
    """The router's narrow view of one agent."""

    id: str
    tier: Tier
    families: frozenset[str]
    variants: frozenset[str]
    ready: bool
    in_flight: int
    capacity: int
    limit: int = 0  # most Work it may hold at once (capacity + queue); 0: no limit
    service_ms: Mapping[str, float] = field(default_factory=dict)  # moving mean per family/variant
    rtt_ms: float = 0.5

    def full(self) -> bool:
        return self.limit > 0 and self.in_flight >= self.limit

    def load(self) -> float:
        return self.in_flight / max(1, self.capacity)

    def serves(self, model: str) -> bool:
        return model in self.families or model in self.variants

    def predicted_ms(self, model: str) -> float:
        """RTT + time waiting for a slot + time running: what a request here should take."""
        service = self.service_ms.get(model, 1.0)
        waves = self.in_flight // max(1, self.capacity)
        return self.rtt_ms + waves * service + service

    def idle_ms(self, model: str) -> float:
        """What a request here would take with no queue in front of it."""
        return self.rtt_ms + self.service_ms.get(model, 1.0)


@dataclass(frozen=True, kw_only=True)
class CloudView:
    available: bool
    families: frozenset[str] = frozenset()
    variants: frozenset[str] = frozenset()
    predicted_ms: float = 5.0

    def serves(self, model: str) -> bool:
        return model in self.families or model in self.variants


@dataclass(frozen=True, kw_only=True)
class FleetSnapshot:
    agents: tuple[AgentView, ...]
    cloud: CloudView | None = None


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One step of one request: what it wants and what it has already tried."""

    model: str  # a family, or a pinned variant
    remaining_ms: float | None
    min_tier: Tier = Tier.DEVICE
    max_tier: Tier = Tier.CLOUD
    above: Tier | None = None  # only tiers strictly above this one
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, kw_only=True)
class Target:
    tier: Tier
    agent_id: str | None  # None: the cloud gateway
    predicted_ms: float


@dataclass(frozen=True, kw_only=True)
class NoTarget:
    """Why nothing can take the attempt: nothing serves it, or nothing fits the budget."""

    reason: str
    too_slow: bool = False
    full: bool = False


def _tier_allowed(tier: Tier, attempt: Attempt) -> bool:
    above = attempt.above is None or tier > attempt.above
    return above and attempt.min_tier <= tier <= attempt.max_tier


def _fits(predicted_ms: float, attempt: Attempt) -> bool:
    return attempt.remaining_ms is None or predicted_ms <= attempt.remaining_ms


def candidates(attempt: Attempt, snapshot: FleetSnapshot) -> list[AgentView]:
    return [
        a
        for a in snapshot.agents
        if a.ready
        and a.id not in attempt.exclude
        and a.serves(attempt.model)
        and _tier_allowed(a.tier, attempt)
    ]


def choose(attempt: Attempt, snapshot: FleetSnapshot, rng: random.Random) -> Target | NoTarget:
    eligible = candidates(attempt, snapshot)
    open_agents = [a for a in eligible if not a.full()]
    fitting = [a for a in open_agents if _fits(a.predicted_ms(attempt.model), attempt)]
    for tier in sorted({a.tier for a in fitting}):
        pick = two_choices([a for a in fitting if a.tier is tier], attempt.model, rng)
        return Target(tier=tier, agent_id=pick.id, predicted_ms=pick.predicted_ms(attempt.model))
    cloud = snapshot.cloud
    cloud_eligible = (
        cloud is not None
        and cloud.available
        and cloud.serves(attempt.model)
        and _tier_allowed(Tier.CLOUD, attempt)
        and "cloud" not in attempt.exclude
    )
    if cloud is not None and cloud_eligible and _fits(cloud.predicted_ms, attempt):
        return Target(tier=Tier.CLOUD, agent_id=None, predicted_ms=cloud.predicted_ms)
    if eligible and not open_agents and not cloud_eligible:
        tiers = "/".join(sorted({a.tier.label for a in eligible}))
        return NoTarget(
            reason=f"every {tiers} agent serving '{attempt.model}' has a full work queue", full=True
        )
    queued_out = [a for a in open_agents if _fits(a.idle_ms(attempt.model), attempt)]
    if queued_out and not cloud_eligible:
        best = min(a.predicted_ms(attempt.model) for a in queued_out)
        tiers = "/".join(sorted({a.tier.label for a in queued_out}))
        return NoTarget(
            reason=f"{tiers} agents' work queues are too long to answer '{attempt.model}' within "
            f"{attempt.remaining_ms:.1f} ms (shortest predicted wait and run: {best:.1f} ms)",
            full=True,
        )
    if open_agents or cloud_eligible:
        return NoTarget(
            reason=f"no tier can answer '{attempt.model}' within {attempt.remaining_ms:.1f} ms", too_slow=True
        )
    return NoTarget(reason=f"nothing in the fleet above the tiers tried can serve '{attempt.model}'")


def two_choices(agents: list[AgentView], model: str, rng: random.Random) -> AgentView:
    """Power of two choices: the less loaded (then faster) of two drawn at random."""
    if len(agents) == 1:
        return agents[0]
    first, second = rng.sample(agents, 2)
    return min((first, second), key=lambda a: (a.load(), a.predicted_ms(model)))


def top_tier(model: str, snapshot: FleetSnapshot, max_tier: Tier) -> Tier | None:
    """The highest tier the fleet has for ``model``, reachable now or not.

    An answer from it is final. Below it, an unsure answer climbs; if nothing above is
    reachable (agents lost or draining, the cloud away) the answer comes back degraded.
    """
    tiers = {a.tier for a in snapshot.agents if a.serves(model) and a.tier <= max_tier}
    if snapshot.cloud is not None and snapshot.cloud.serves(model):
        tiers.add(Tier.CLOUD)
    eligible = [t for t in tiers if t <= max_tier]
    return max(eligible) if eligible else None


def accepts(
    confidence: float,
    tier: Tier,
    *,
    thresholds: Mapping[Tier, float],
    min_confidence: float | None,
) -> bool:
    """Whether an answer from ``tier`` is confident enough to stop climbing."""
    threshold = min_confidence if min_confidence is not None else thresholds.get(tier)
    return threshold is None or confidence >= threshold
