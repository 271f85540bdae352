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

The snapshot holds, per tier, the ready agents that serve the model, straight from the
router's index, and the cloud (when it serves the model) as one more candidate on
``Tier.CLOUD``: every target is chosen by the same rules. A decision draws from the pools
and so costs the same at any fleet size.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from stratus.tiers import Tier

# Random draws from a tier's pool before the policy falls back to walking all of it: with
# half of a tier usable, eight draws miss a second usable agent once in about 30 times.
DRAWS = 8


class Candidate(Protocol):
    """The router's narrow view of one target (an agent, or the cloud): enough to predict and
    compare, nothing else."""

    @property
    def id(self) -> str: ...

    @property
    def tier(self) -> Tier: ...

    @property
    def ready(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def limit(self) -> int:
        """Most Work it may hold at once (capacity + queue); 0: no limit (the cloud's queue
        is the gateway's, which refuses for itself)."""
        ...

    @property
    def rtt_ms(self) -> float: ...

    def max_batch(self, model: str) -> int:
        """Most items it runs as one batch of this model."""
        ...

    def cost_ms(self, model: str, items: int) -> float:
        """Expected time to run one batch of ``items`` of this model (learnt per batch size)."""
        ...


def full(agent: Candidate) -> bool:
    return agent.limit > 0 and agent.in_flight >= agent.limit


def load(agent: Candidate) -> float:
    return agent.in_flight / max(1, agent.capacity)


def predicted_ms(agent: Candidate, model: str, items: int = 1) -> float:
    """RTT + time waiting for a slot + time running: what a request here should take.

    The items ahead of it share the agent's slots; the slot it lands on works through its
    share of them and then this request's items (which run together, never split), in
    batches of up to ``max_batch``, at the cost learnt for each size.
    """
    ahead = -(-agent.in_flight // max(1, agent.capacity))
    return agent.rtt_ms + run_ms(agent, model, ahead + items)


def run_ms(agent: Candidate, model: str, items: int) -> float:
    """Time to run ``items`` back to back in batches of at most ``max_batch``."""
    largest = max(1, agent.max_batch(model))
    full, rest = divmod(items, largest)
    cost = full * agent.cost_ms(model, largest) if full else 0.0
    return cost + (agent.cost_ms(model, rest) if rest else 0.0)


def idle_ms(agent: Candidate, model: str, items: int = 1) -> float:
    """What a request here would take with no queue in front of it."""
    return agent.rtt_ms + run_ms(agent, model, items)


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True, kw_only=True)
class FleetSnapshot(Generic[C]):
    """What the fleet has for one model, read from the index at one instant.

    ``pools`` holds the targets serving the model, by tier: the ready agents, and the cloud
    (ready or not) when it serves the model. ``tiers`` holds every tier with a listed target
    (an agent ready, draining or lost; the cloud, up or down), which is what decides whether
    an answer is final. Neither grows a decision's cost with the size of the fleet.
    """

    pools: Mapping[Tier, Sequence[C]]
    tiers: frozenset[Tier] = frozenset()


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One step of one request: what it wants and what it has already tried."""

    model: str  # a family, or a pinned variant
    remaining_ms: float | None
    items: int = 1  # the request's items still to answer
    min_tier: Tier = Tier.DEVICE
    max_tier: Tier = Tier.CLOUD
    above: Tier | None = None  # only tiers strictly above this one
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, kw_only=True)
class Target(Generic[C]):
    """The chosen target: an agent, or the cloud, alike."""

    tier: Tier
    candidate: C

    @property
    def id(self) -> str:
        return self.candidate.id


@dataclass(frozen=True, kw_only=True)
class NoTarget:
    """Why nothing can take the attempt: nothing serves it, or nothing fits the budget."""

    reason: str
    too_slow: bool = False
    full: bool = False


def _tier_allowed(tier: Tier, attempt: Attempt) -> bool:
    above = attempt.above is None or tier > attempt.above
    return above and attempt.min_tier <= tier <= attempt.max_tier


def _fits(predicted: float, attempt: Attempt) -> bool:
    return attempt.remaining_ms is None or predicted <= attempt.remaining_ms


def _open(agent: Candidate, attempt: Attempt) -> bool:
    """Ready, not failed for this request, and with room in its queue."""
    return agent.ready and agent.id not in attempt.exclude and not full(agent)


def usable(agent: Candidate, attempt: Attempt) -> bool:
    return _open(agent, attempt) and _fits(predicted_ms(agent, attempt.model, attempt.items), attempt)


def choose(attempt: Attempt, snapshot: FleetSnapshot[C], rng: random.Random) -> Target[C] | NoTarget:
    for tier in sorted(snapshot.pools):
        if not _tier_allowed(tier, attempt):
            continue
        pick = two_choices(snapshot.pools[tier], attempt, rng)
        if pick is not None:
            return Target(tier=tier, candidate=pick)
    return _why_not(attempt, snapshot)


def two_choices(pool: Sequence[C], attempt: Attempt, rng: random.Random) -> C | None:
    """Power of two choices among the usable agents: the less loaded (then faster) of two.

    Two usable agents are drawn at random (rejection sampling keeps the draw uniform over
    the usable ones), so a decision costs the same with ten agents or ten thousand. Only
    when the draws find fewer than two, because most of the tier is full, failed or too
    slow for the budget, does it walk the pool: the one case where a rare usable agent
    matters more than the cost of finding it.
    """
    size = len(pool)
    if size == 0:
        return None
    drawn: dict[str, C] = {}
    if size > DRAWS:
        for _ in range(DRAWS):
            agent = pool[rng.randrange(size)]
            if agent.id not in drawn and usable(agent, attempt):
                drawn[agent.id] = agent
                if len(drawn) == 2:
                    break
    found = list(drawn.values()) if len(drawn) == 2 else [a for a in pool if usable(a, attempt)]
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    pair = rng.sample(found, 2)  # in random order: an exact tie goes to either, never to the first listed
    return min(pair, key=lambda a: (load(a), predicted_ms(a, attempt.model, attempt.items)))


def spare(pool: Sequence[C], rng: random.Random, *, share: float = 1.0) -> C | None:
    """A target with room for background work (an audit, a row of thresholds) that client
    work does not need: ready, with ``in_flight + 1`` within ``share`` of its capacity; the
    least busy of a bounded draw, drawn as :func:`two_choices` draws; None when none has room.
    The cloud's share is smaller (``AuditPolicy.cloud_spare``): its room is every router's."""
    drawn = [pool[rng.randrange(len(pool))] for _ in range(DRAWS)] if len(pool) > DRAWS else pool
    roomy = [target for target in drawn if target.ready and target.in_flight + 1 <= target.capacity * share]
    return min(roomy, key=lambda target: target.in_flight) if roomy else None


def _why_not(attempt: Attempt, snapshot: FleetSnapshot[C]) -> NoTarget:
    """The most useful reason nothing was chosen: every target's queue full; queues too long
    for the budget (though a target would fit it idle, so waiting helps); or a budget too
    tight for any target even idle."""
    model = attempt.model
    seen = [
        a
        for tier, pool in sorted(snapshot.pools.items())
        if _tier_allowed(tier, attempt)
        for a in pool
        if a.ready and a.id not in attempt.exclude
    ]
    open_agents = [a for a in seen if not full(a)]
    if seen and not open_agents:
        tiers = "/".join(sorted({a.tier.label for a in seen}))
        return NoTarget(reason=f"every {tiers} agent serving '{model}' has a full work queue", full=True)
    queued_out = [a for a in open_agents if _fits(idle_ms(a, model, attempt.items), attempt)]
    if queued_out:
        best = min(predicted_ms(a, model, attempt.items) for a in queued_out)
        tiers = "/".join(sorted({a.tier.label for a in queued_out}))
        return NoTarget(
            reason=f"{tiers} agents' work queues are too long to answer '{model}' within "
            f"{attempt.remaining_ms:.1f} ms (shortest predicted wait and run: {best:.1f} ms)",
            full=True,
        )
    if open_agents:
        return NoTarget(
            reason=f"no tier can answer '{model}' within {attempt.remaining_ms:.1f} ms", too_slow=True
        )
    down = [
        tier.label
        for tier, pool in sorted(snapshot.pools.items())
        if _tier_allowed(tier, attempt) and any(not a.ready and a.id not in attempt.exclude for a in pool)
    ]
    if down:  # listed, none ready: the cloud's link down or its breaker open, agents draining
        return NoTarget(reason=f"the {'/'.join(down)} tier serving '{model}' is not ready now")
    return NoTarget(reason=f"nothing in the fleet above the tiers tried can serve '{model}'")


def top_tier(snapshot: FleetSnapshot[C], max_tier: Tier) -> Tier | None:
    """The highest tier the fleet has for the model, reachable now or not.

    An answer from it is final. Below it, an unsure answer climbs; if nothing above is
    reachable (agents lost or draining, the cloud away) the answer comes back degraded.
    """
    eligible = [t for t in snapshot.tiers if t <= max_tier]
    return max(eligible) if eligible else None
