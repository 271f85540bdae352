"""The routing policy as a pure function: snapshots in, decisions out, no network."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from router.fleet.index import AgentIndex
from router.policy import (
    DRAWS,
    Attempt,
    Candidate,
    FleetSnapshot,
    NoTarget,
    Target,
    choose,
    predicted_ms,
    spare,
    top_tier,
)
from stratus.families.confidence import accepts, settled
from stratus.tiers import Tier


@dataclass(frozen=True, kw_only=True)
class AgentView:
    """A frozen agent for the policy (a Candidate) and the index (Indexed)."""

    id: str
    tier: Tier
    ready: bool = True
    in_flight: int = 0
    capacity: int = 4
    limit: int = 0
    service_ms: Mapping[str, float] = field(default_factory=dict)
    rtt_ms: float = 0.5
    batch: int = 1
    per_item_ms: float | None = None  # extra cost of each item after the first; None: service

    @property
    def variant_families(self) -> Mapping[str, str]:
        return {f"{self.id}-v": "digits"}

    @property
    def model_names(self) -> frozenset[str]:
        return frozenset({f"{self.id}-v", "digits"})

    def max_batch(self, model: str) -> int:
        return self.batch

    def cost_ms(self, model: str, items: int) -> float:
        service = self.service_ms.get(model, 1.0)
        extra = service if self.per_item_ms is None else self.per_item_ms
        return service + extra * (items - 1)


def agent(
    name: str, tier: Tier, *, in_flight: int = 0, service: float = 1.0, ready: bool = True, capacity: int = 4
) -> AgentView:
    return AgentView(
        id=name,
        tier=tier,
        ready=ready,
        in_flight=in_flight,
        capacity=capacity,
        service_ms={"digits": service},
    )


@dataclass(frozen=True, kw_only=True)
class CloudCandidate:
    """The cloud as the router's CloudBackend shows it to the policy: no queue limit, and its
    link's round trip as the whole prediction."""

    id: str = "cloud@gateway:8002"
    tier: Tier = Tier.CLOUD
    ready: bool = True
    in_flight: int = 0
    capacity: int = 64
    limit: int = 0
    rtt_ms: float = 8.0

    def max_batch(self, model: str) -> int:
        return 1 << 20

    def cost_ms(self, model: str, items: int) -> float:
        return 0.0


@dataclass(frozen=True)
class Fleet:
    """Agents as the router's index holds them, plus the cloud: a snapshot per model."""

    agents: tuple[AgentView, ...]
    cloud: CloudCandidate | None = None
    cloud_models: frozenset[str] = frozenset({"digits", "digits-large"})

    def snapshot(self, model: str) -> FleetSnapshot[Candidate]:
        index: AgentIndex[AgentView] = AgentIndex()
        for a in self.agents:
            index.add(a)
            if a.ready:
                index.ready(a)
        pools: dict[Tier, list[Candidate]] = {t: list(p) for t, p in index.pools(model).items()}
        tiers = set(index.tiers(model))
        if self.cloud is not None and model in self.cloud_models:  # as RouterDataPlane.snapshot
            pools[Tier.CLOUD] = [self.cloud]
            tiers.add(Tier.CLOUD)
        return FleetSnapshot(pools=pools, tiers=frozenset(tiers))


CLOUD = CloudCandidate()
FLEET = Fleet(
    agents=(agent("d1", Tier.DEVICE), agent("d2", Tier.DEVICE), agent("e1", Tier.EDGE, service=3.0)),
    cloud=CLOUD,
)


def pick(attempt: Attempt, fleet: Fleet = FLEET, seed: int = 0) -> Target[Candidate] | NoTarget:
    return choose(attempt, fleet.snapshot(attempt.model), random.Random(seed))


def test_starts_on_the_lowest_tier_that_fits() -> None:
    target = pick(Attempt(model="digits", remaining_ms=None))
    assert isinstance(target, Target) and target.tier is Tier.DEVICE and target.id in {"d1", "d2"}


def test_climbs_above_the_tier_already_tried_and_ends_at_the_cloud() -> None:
    edge = pick(Attempt(model="digits", remaining_ms=None, above=Tier.DEVICE))
    assert isinstance(edge, Target) and edge.id == "e1"
    cloud = pick(Attempt(model="digits", remaining_ms=None, above=Tier.EDGE))
    assert isinstance(cloud, Target) and cloud.tier is Tier.CLOUD and cloud.id == CLOUD.id
    nothing = pick(Attempt(model="digits", remaining_ms=None, above=Tier.CLOUD))
    assert isinstance(nothing, NoTarget) and not nothing.too_slow


def test_skips_a_tier_that_cannot_meet_the_budget() -> None:
    busy = Fleet(
        agents=(agent("d1", Tier.DEVICE, in_flight=8, service=5.0), agent("e1", Tier.EDGE)), cloud=CLOUD
    )
    # d1 predicts 0.5 + 2 waves x 5 + 5 = 15.5 ms; e1 predicts 1.5 ms.
    target = pick(Attempt(model="digits", remaining_ms=10.0), busy)
    assert isinstance(target, Target) and target.id == "e1"
    too_tight = pick(Attempt(model="digits", remaining_ms=0.2), busy)
    assert isinstance(too_tight, NoTarget) and too_tight.too_slow


def test_respects_tier_bounds_exclusions_and_readiness() -> None:
    only_device = pick(Attempt(model="digits", remaining_ms=None, above=Tier.DEVICE, max_tier=Tier.DEVICE))
    assert isinstance(only_device, NoTarget)
    from_edge = pick(Attempt(model="digits", remaining_ms=None, min_tier=Tier.EDGE))
    assert isinstance(from_edge, Target) and from_edge.tier is Tier.EDGE
    excluded = pick(Attempt(model="digits", remaining_ms=None, exclude=frozenset({"d1"})))
    assert isinstance(excluded, Target) and excluded.id == "d2"
    draining = Fleet(agents=(agent("d1", Tier.DEVICE, ready=False), agent("e1", Tier.EDGE)))
    assert pick(Attempt(model="digits", remaining_ms=None), draining).id == "e1"  # type: ignore[union-attr]


def test_a_pinned_variant_only_goes_where_it_is_served() -> None:
    target = pick(Attempt(model="d2-v", remaining_ms=None))
    assert isinstance(target, Target) and target.id == "d2"
    cloud = pick(Attempt(model="digits-large", remaining_ms=None))
    assert isinstance(cloud, Target) and cloud.id == CLOUD.id
    assert isinstance(pick(Attempt(model="nothing", remaining_ms=None)), NoTarget)


def test_power_of_two_choices_prefers_the_less_loaded_agent() -> None:
    agents = tuple(agent(f"d{i}", Tier.DEVICE, in_flight=i) for i in range(4))
    picks = Counter(
        pick(Attempt(model="digits", remaining_ms=None), Fleet(agents), seed).id  # type: ignore[union-attr]
        for seed in range(400)
    )
    assert picks["d3"] == 0  # the most loaded agent never wins a pair
    assert picks["d0"] > picks["d1"] > picks["d2"] > 0


def test_top_tier_and_acceptance() -> None:
    assert top_tier(FLEET.snapshot("digits"), Tier.CLOUD) is Tier.CLOUD
    assert top_tier(Fleet(FLEET.agents).snapshot("digits"), Tier.CLOUD) is Tier.EDGE
    assert top_tier(FLEET.snapshot("digits"), Tier.DEVICE) is Tier.DEVICE
    lost_edge = Fleet((agent("d1", Tier.DEVICE), agent("e1", Tier.EDGE, ready=False)))
    assert top_tier(lost_edge.snapshot("digits"), Tier.CLOUD) is Tier.EDGE  # listed, though not ready
    thresholds = {Tier.DEVICE: 0.9}
    assert accepts(0.95, Tier.DEVICE, thresholds=thresholds, min_confidence=None)
    assert not accepts(0.85, Tier.DEVICE, thresholds=thresholds, min_confidence=None)
    assert not accepts(0.95, Tier.DEVICE, thresholds=thresholds, min_confidence=0.99)
    assert accepts(0.6, Tier.DEVICE, thresholds=thresholds, min_confidence=0.5)  # a client may lower it
    assert not accepts(0.4, Tier.EDGE, thresholds=thresholds, min_confidence=0.5)  # and set one where none is
    assert accepts(0.1, Tier.EDGE, thresholds=thresholds, min_confidence=None)  # no threshold: accept


def test_queues_too_long_for_the_budget_are_overload_not_a_missed_deadline() -> None:
    busy = Fleet((agent("d1", Tier.DEVICE, in_flight=8, service=5.0, capacity=1),))
    # Idle, d1 would answer in 5.5 ms; behind 8 queued requests it needs 45.5 ms.
    queued = pick(Attempt(model="digits", remaining_ms=20.0), busy)
    assert isinstance(queued, NoTarget) and queued.full and not queued.too_slow
    assert "work queues are too long" in queued.reason
    hopeless = pick(Attempt(model="digits", remaining_ms=2.0), busy)
    assert isinstance(hopeless, NoTarget) and hopeless.too_slow and not hopeless.full


def test_the_cloud_is_judged_by_the_same_rule_as_any_agent() -> None:
    """A cloud too slow for the budget does not hide queues that are the reason: idle, d1
    would fit, so the answer says to wait (overload), as it does without a cloud."""
    busy = Fleet((agent("d1", Tier.DEVICE, in_flight=8, service=5.0, capacity=1),), cloud=CLOUD)
    queued = pick(Attempt(model="digits", remaining_ms=7.0), busy)  # the cloud's round trip: 8 ms
    assert isinstance(queued, NoTarget) and queued.full and "work queues are too long" in queued.reason
    hopeless = pick(Attempt(model="digits", remaining_ms=2.0), busy)
    assert isinstance(hopeless, NoTarget) and hopeless.too_slow
    reachable = pick(Attempt(model="digits", remaining_ms=9.0), busy)
    assert isinstance(reachable, Target) and reachable.id == CLOUD.id
    down = pick(Attempt(model="digits", remaining_ms=9.0), Fleet(busy.agents, cloud=CloudCandidate(ready=False)))
    assert isinstance(down, NoTarget) and down.full  # a cloud that is down takes nothing


def test_two_choices_are_drawn_only_among_usable_agents_of_a_large_pool() -> None:
    """Among 1,000 agents of which four are usable, every pick is one of the four."""
    crowd = [agent(f"d{i}", Tier.DEVICE, in_flight=4, capacity=1) for i in range(996)]  # 4 waves: too slow
    usable = [agent(f"u{i}", Tier.DEVICE, in_flight=i) for i in range(4)]
    snapshot = Fleet((*crowd[:500], *usable, *crowd[500:])).snapshot("digits")
    picks = Counter(
        choose(Attempt(model="digits", remaining_ms=3.0), snapshot, random.Random(seed)).id  # type: ignore[union-attr]
        for seed in range(300)
    )
    assert set(picks) <= {"u0", "u1", "u2"} and picks["u0"] > picks["u2"]  # u3 (most loaded) never wins


def test_draws_skip_agents_that_are_not_ready_even_when_a_pool_holds_them() -> None:
    pool = [agent(f"d{i}", Tier.DEVICE, ready=i == 7) for i in range(20)]
    snapshot = FleetSnapshot(pools={Tier.DEVICE: pool}, tiers=frozenset({Tier.DEVICE}))
    picks = [
        choose(Attempt(model="digits", remaining_ms=None), snapshot, random.Random(s)) for s in range(50)
    ]
    assert {(t.tier, t.id) for t in picks} == {(Tier.DEVICE, "d7")}  # type: ignore[union-attr]


class Counting(list):  # type: ignore[type-arg]
    """A tier that counts the agents read from it, and refuses to be walked."""

    reads = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        Counting.reads += 1
        return super().__getitem__(index)

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a tier with usable agents is never walked")


def test_a_decision_reads_a_few_agents_whatever_the_size_of_the_tier() -> None:
    for size in (10, 5000):
        Counting.reads = 0
        crowd = Counting(agent(f"d{i}", Tier.DEVICE, in_flight=i % 3) for i in range(size))
        snapshot = FleetSnapshot(pools={Tier.DEVICE: crowd}, tiers=frozenset({Tier.DEVICE}))
        assert isinstance(
            choose(Attempt(model="digits", remaining_ms=None), snapshot, random.Random(1)), Target
        )
        assert Counting.reads <= DRAWS


def test_background_work_goes_only_where_a_slot_is_spare_within_the_share() -> None:
    """Audits take room client work does not need: the least busy target with in_flight + 1
    within its share of capacity; the cloud's share is a quarter of its capacity."""
    rng = random.Random(3)
    busy, idle = agent("d1", Tier.EDGE, in_flight=3), agent("d2", Tier.EDGE, in_flight=1)
    assert spare([busy, idle], rng) == idle
    assert spare([agent("d3", Tier.EDGE, in_flight=4)], rng) is None  # every slot taken
    assert spare([agent("d4", Tier.EDGE, ready=False)], rng) is None
    assert spare([], rng) is None
    cloud = agent("cloud", Tier.CLOUD, capacity=8, in_flight=1)
    assert spare([cloud], rng, share=0.25) == cloud  # 2 of 8 once it is sent
    assert spare([agent("cloud", Tier.CLOUD, capacity=8, in_flight=2)], rng, share=0.25) is None


def test_the_spare_choice_reads_a_few_agents_whatever_the_size_of_the_tier() -> None:
    Counting.reads = 0
    crowd = Counting(agent(f"d{i}", Tier.EDGE, in_flight=4 - i % 2) for i in range(5000))
    found = spare(crowd, random.Random(1))
    assert found is not None and found.in_flight == 3 and Counting.reads == DRAWS


def test_predicted_latency_counts_queued_items_in_batches_at_the_learnt_cost() -> None:
    # 62 items ahead, 2 slots, batches of up to 32 costing 2 ms + 0.1 ms per extra item.
    batching = AgentView(
        id="b",
        tier=Tier.DEVICE,
        in_flight=62,
        capacity=2,
        batch=32,
        per_item_ms=0.1,
        service_ms={"digits": 2.0},
    )
    one_by_one = AgentView(id="s", tier=Tier.DEVICE, in_flight=62, capacity=2, service_ms={"digits": 2.0})
    # each slot works through 32 items (31 ahead + this one): one batch of 32
    assert predicted_ms(batching, "digits") == pytest.approx(0.5 + 2.0 + 0.1 * 31)
    assert predicted_ms(one_by_one, "digits") == pytest.approx(0.5 + 32 * 2.0)
    # a request of 4 items on an idle agent: one batch of 4
    idle = AgentView(
        id="i", tier=Tier.DEVICE, capacity=2, batch=32, per_item_ms=0.1, service_ms={"digits": 2.0}
    )
    assert predicted_ms(idle, "digits", 4) == pytest.approx(0.5 + 2.0 + 0.3)


def test_items_settle_one_by_one_and_a_final_answer_settles_them_all() -> None:
    thresholds = {Tier.DEVICE: 0.9}
    mixed = settled([0.95, 0.5, 0.9], Tier.DEVICE, final=False, thresholds=thresholds, min_confidence=None)
    assert mixed == [True, False, True]
    stricter = settled([0.95, 0.5], Tier.DEVICE, final=False, thresholds=thresholds, min_confidence=0.99)
    assert stricter == [False, False]
    assert settled([0.1, 0.2], Tier.DEVICE, final=True, thresholds=thresholds, min_confidence=None) == [
        True,
        True,
    ]
