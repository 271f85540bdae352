"""The routing policy as a pure function: snapshots in, decisions out, no network."""

from __future__ import annotations

import random
from collections import Counter

from router.policy import (
    AgentView,
    Attempt,
    CloudView,
    FleetSnapshot,
    NoTarget,
    Target,
    accepts,
    choose,
    top_tier,
)
from stratus.tiers import Tier


def agent(
    name: str, tier: Tier, *, in_flight: int = 0, service: float = 1.0, ready: bool = True, capacity: int = 4
) -> AgentView:
    return AgentView(
        id=name,
        tier=tier,
        families=frozenset({"digits"}),
        variants=frozenset({f"{name}-v"}),
        ready=ready,
        in_flight=in_flight,
        capacity=capacity,
        service_ms={"digits": service},
        rtt_ms=0.5,
    )


CLOUD = CloudView(
    available=True, families=frozenset({"digits"}), variants=frozenset({"digits-large"}), predicted_ms=8.0
)
FLEET = FleetSnapshot(
    agents=(agent("d1", Tier.DEVICE), agent("d2", Tier.DEVICE), agent("e1", Tier.EDGE, service=3.0)),
    cloud=CLOUD,
)


def pick(attempt: Attempt, snapshot: FleetSnapshot = FLEET, seed: int = 0) -> Target | NoTarget:
    return choose(attempt, snapshot, random.Random(seed))


def test_starts_on_the_lowest_tier_that_fits() -> None:
    target = pick(Attempt(model="digits", remaining_ms=None))
    assert isinstance(target, Target) and target.tier is Tier.DEVICE and target.agent_id in {"d1", "d2"}


def test_climbs_above_the_tier_already_tried_and_ends_at_the_cloud() -> None:
    edge = pick(Attempt(model="digits", remaining_ms=None, above=Tier.DEVICE))
    assert isinstance(edge, Target) and edge.agent_id == "e1"
    cloud = pick(Attempt(model="digits", remaining_ms=None, above=Tier.EDGE))
    assert isinstance(cloud, Target) and cloud.tier is Tier.CLOUD and cloud.agent_id is None
    nothing = pick(Attempt(model="digits", remaining_ms=None, above=Tier.CLOUD))
    assert isinstance(nothing, NoTarget) and not nothing.too_slow


def test_skips_a_tier_that_cannot_meet_the_budget() -> None:
    busy = FleetSnapshot(
        agents=(agent("d1", Tier.DEVICE, in_flight=8, service=5.0), agent("e1", Tier.EDGE)), cloud=CLOUD
    )
    # d1 predicts 0.5 + 2 waves x 5 + 5 = 15.5 ms; e1 predicts 1.5 ms.
    target = pick(Attempt(model="digits", remaining_ms=10.0), busy)
    assert isinstance(target, Target) and target.agent_id == "e1"
    too_tight = pick(Attempt(model="digits", remaining_ms=0.2), busy)
    assert isinstance(too_tight, NoTarget) and too_tight.too_slow


def test_respects_tier_bounds_exclusions_and_readiness() -> None:
    only_device = pick(Attempt(model="digits", remaining_ms=None, above=Tier.DEVICE, max_tier=Tier.DEVICE))
    assert isinstance(only_device, NoTarget)
    from_edge = pick(Attempt(model="digits", remaining_ms=None, min_tier=Tier.EDGE))
    assert isinstance(from_edge, Target) and from_edge.tier is Tier.EDGE
    excluded = pick(Attempt(model="digits", remaining_ms=None, exclude=frozenset({"d1"})))
    assert isinstance(excluded, Target) and excluded.agent_id == "d2"
    draining = FleetSnapshot(
        agents=(agent("d1", Tier.DEVICE, ready=False), agent("e1", Tier.EDGE)), cloud=None
    )
    assert pick(Attempt(model="digits", remaining_ms=None), draining).agent_id == "e1"  # type: ignore[union-attr]


def test_a_pinned_variant_only_goes_where_it_is_served() -> None:
    target = pick(Attempt(model="d2-v", remaining_ms=None))
    assert isinstance(target, Target) and target.agent_id == "d2"
    cloud = pick(Attempt(model="digits-large", remaining_ms=None))
    assert isinstance(cloud, Target) and cloud.agent_id is None
    assert isinstance(pick(Attempt(model="nothing", remaining_ms=None)), NoTarget)


def test_power_of_two_choices_prefers_the_less_loaded_agent() -> None:
    agents = tuple(agent(f"d{i}", Tier.DEVICE, in_flight=i) for i in range(4))
    snapshot = FleetSnapshot(agents=agents)
    picks = Counter(
        pick(Attempt(model="digits", remaining_ms=None), snapshot, seed).agent_id  # type: ignore[union-attr]
        for seed in range(400)
    )
    assert picks["d3"] == 0  # the most loaded agent never wins a pair
    assert picks["d0"] > picks["d1"] > picks["d2"] > 0


def test_top_tier_and_acceptance() -> None:
    assert top_tier("digits", FLEET, Tier.CLOUD) is Tier.CLOUD
    assert top_tier("digits", FleetSnapshot(agents=FLEET.agents), Tier.CLOUD) is Tier.EDGE
    assert top_tier("digits", FLEET, Tier.DEVICE) is Tier.DEVICE
    thresholds = {Tier.DEVICE: 0.9}
    assert accepts(0.95, Tier.DEVICE, thresholds=thresholds, min_confidence=None)
    assert not accepts(0.85, Tier.DEVICE, thresholds=thresholds, min_confidence=None)
    assert not accepts(0.95, Tier.DEVICE, thresholds=thresholds, min_confidence=0.99)
    assert accepts(0.1, Tier.EDGE, thresholds=thresholds, min_confidence=None)  # no threshold: accept


def test_queues_too_long_for_the_budget_are_overload_not_a_missed_deadline() -> None:
    busy = FleetSnapshot(agents=(agent("d1", Tier.DEVICE, in_flight=8, service=5.0, capacity=1),))
    # Idle, d1 would answer in 5.5 ms; behind 8 queued requests it needs 45.5 ms.
    queued = pick(Attempt(model="digits", remaining_ms=20.0), busy)
    assert isinstance(queued, NoTarget) and queued.full and not queued.too_slow
    assert "work queues are too long" in queued.reason
    hopeless = pick(Attempt(model="digits", remaining_ms=2.0), busy)
    assert isinstance(hopeless, NoTarget) and hopeless.too_slow and not hopeless.full
