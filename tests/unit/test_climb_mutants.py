"""Policy and climb edges the mutation run found untested: budgets met exactly, the reasons
of an empty choice, load and queue arithmetic, batching, tie-breaks and pinned climbs."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from router.policy import (
    Attempt,
    FleetSnapshot,
    NoTarget,
    Target,
    choose,
    idle_ms,
    load,
    predicted_ms,
    run_ms,
    top_tier,
)
from router.policy.climb import ClimbState, Dispatch, next_action
from stratus.tiers import Tier

DEVICE, EDGE, CLOUD = Tier.DEVICE, Tier.EDGE, Tier.CLOUD


@dataclass(frozen=True, kw_only=True)
class Agent:
    """A Candidate serving only "digits": any other model name is a KeyError, so a figure
    asked for the wrong model cannot pass unnoticed."""

    id: str
    tier: Tier = DEVICE
    in_flight: int = 0
    capacity: int = 1
    limit: int = 0
    ready: bool = True
    rtt_ms: float = 0.5
    batch: int = 1
    first_ms: float = 1.0  # one batch of one item
    extra_ms: float = 1.0  # each further item of the batch

    def max_batch(self, model: str) -> int:
        return {"digits": self.batch}[model]

    def cost_ms(self, model: str, items: int) -> float:
        return {"digits": self.first_ms}[model] + self.extra_ms * (items - 1)


def snapshot(*agents: Agent) -> FleetSnapshot[Agent]:
    pools: dict[Tier, list[Agent]] = {}
    for a in agents:
        pools.setdefault(a.tier, []).append(a)
    return FleetSnapshot(pools=pools, tiers=frozenset(pools))


def pick(attempt: Attempt, *agents: Agent, seed: int = 0) -> Target[Agent] | NoTarget:
    return choose(attempt, snapshot(*agents), random.Random(seed))


def test_a_target_predicted_exactly_at_the_budget_fits() -> None:
    """0.5 ms RTT + 1 ms run = 1.5 ms: a budget of 1.5 ms is enough."""
    chosen = pick(Attempt(model="digits", remaining_ms=1.5), Agent(id="d"))
    assert isinstance(chosen, Target) and chosen.id == "d"


def test_idle_time_and_an_attempt_default_to_one_item() -> None:
    """One item unless told: RTT + one batch of one."""
    assert idle_ms(Agent(id="d", rtt_ms=0.5, first_ms=2.0), "digits") == 2.5
    assert ClimbState().attempt("digits", 100.0).items == 1


# -- the arithmetic of load and queues --------------------------------------------------------


def test_load_is_work_per_slot() -> None:
    """3 in flight on 4 slots is 0.75; 1 on 1 is 1.0; no slots count as one."""
    assert load(Agent(id="a", in_flight=3, capacity=4)) == 0.75
    assert load(Agent(id="b", in_flight=1, capacity=1)) == 1.0
    assert load(Agent(id="c", in_flight=2, capacity=0)) == 2.0


def test_the_less_loaded_per_slot_is_chosen() -> None:
    """0.75 per slot beats 1.0 per slot, though it has more work in flight."""
    wide, narrow = Agent(id="wide", in_flight=3, capacity=4), Agent(id="narrow", in_flight=1, capacity=1)
    for seed in range(5):
        chosen = pick(Attempt(model="digits", remaining_ms=None), wide, narrow, seed=seed)
        assert isinstance(chosen, Target) and chosen.id == "wide"


def test_items_ahead_are_rounded_up_per_slot() -> None:
    """2 in flight on 1 slot: 2 ahead; 3 on 2 slots: 2 ahead (ceil 1.5). Each item 1 ms."""
    assert predicted_ms(Agent(id="a", in_flight=2, capacity=1), "digits") == 0.5 + 3.0
    assert predicted_ms(Agent(id="b", in_flight=3, capacity=2), "digits") == 0.5 + 3.0


def test_a_batch_of_one_runs_items_one_by_one() -> None:
    """max_batch 1: three items cost three single batches, not a batch of two and one."""
    single = Agent(id="a", batch=1, first_ms=1.0, extra_ms=0.25)
    assert run_ms(single, "digits", 3) == 3.0


def test_batches_are_the_models_size() -> None:
    """max_batch 4 for the model: 6 items are a batch of 4 (1 + 3 x 0.25) and one of 2."""
    batched = Agent(id="a", batch=4, first_ms=1.0, extra_ms=0.25)
    assert run_ms(batched, "digits", 6) == 1.75 + 1.25


# -- ties and pairs ---------------------------------------------------------------------------


def test_equal_agents_split_their_ties() -> None:
    """Two agents, equally loaded and fast: both are the pair, compared in random order, so a
    tie goes to either. The first listed won every tie once, and at low concurrency (nothing in
    flight at each choice) it took every call: 184 of 200 escalations to one of two gateways."""
    chosen = Counter()
    for seed in range(40):
        target = pick(Attempt(model="digits", remaining_ms=None), Agent(id="first"), Agent(id="second"), seed=seed)
        assert isinstance(target, Target)
        chosen[target.id] += 1
    assert set(chosen) == {"first", "second"} and min(chosen.values()) >= 10, chosen


def test_three_usable_agents_are_two_random_choices_not_the_best_of_all() -> None:
    """Of three, a random pair is compared: the least loaded wins only when drawn (2/3 of
    the time), the most loaded never."""
    agents = [Agent(id="idle", in_flight=0), Agent(id="busy", in_flight=1), Agent(id="busiest", in_flight=2)]
    counts: Counter[str] = Counter()
    for seed in range(300):
        chosen = pick(Attempt(model="digits", remaining_ms=None), *agents, seed=seed)
        assert isinstance(chosen, Target)
        counts[chosen.id] += 1
    assert counts["busiest"] == 0
    assert 50 < counts["busy"] < 150
    assert 150 < counts["idle"] < 250


def test_equal_load_is_broken_by_the_prediction_for_the_requests_items() -> None:
    """Four items: the batching agent (2 ms RTT + one 1 ms batch = 3 ms) beats the one-by-one
    agent (0.5 + 4 = 4.5 ms), though for one item the one-by-one agent would be faster."""
    one_by_one = Agent(id="single", rtt_ms=0.5, batch=1)
    batching = Agent(id="batching", rtt_ms=2.0, batch=4, extra_ms=0.0)
    for seed in range(5):
        many = pick(Attempt(model="digits", remaining_ms=None, items=4), one_by_one, batching, seed=seed)
        assert isinstance(many, Target) and many.id == "batching"
        one = pick(Attempt(model="digits", remaining_ms=None), one_by_one, batching, seed=seed)
        assert isinstance(one, Target) and one.id == "single"


# -- why nothing was chosen -------------------------------------------------------------------


def test_every_full_queue_is_named_by_its_tiers() -> None:
    """Full agents on two tiers: both tiers are named, sorted, joined by '/'."""
    chosen = pick(
        Attempt(model="digits", remaining_ms=None),
        Agent(id="d", tier=DEVICE, in_flight=2, limit=2),
        Agent(id="e", tier=EDGE, in_flight=3, limit=3),
    )
    assert chosen == NoTarget(
        reason="every device/edge agent serving 'digits' has a full work queue", full=True
    )


def test_queues_too_long_name_the_tiers_and_the_shortest_wait_for_the_items() -> None:
    """Two items: the device (4 ahead, 2 ms an item) predicts 0.5 + 6 x 2 = 12.5 ms and the
    edge (5 ahead) 14.5 ms; idle, both fit the 10 ms budget, so waiting is the problem."""
    chosen = pick(
        Attempt(model="digits", remaining_ms=10.0, items=2),
        Agent(id="d", tier=DEVICE, in_flight=4, first_ms=2.0, extra_ms=2.0),
        Agent(id="e", tier=EDGE, in_flight=5, first_ms=2.0, extra_ms=2.0),
    )
    assert chosen == NoTarget(
        reason="device/edge agents' work queues are too long to answer 'digits' within 10.0 ms "
        "(shortest predicted wait and run: 12.5 ms)",
        full=True,
    )


def test_an_agent_too_slow_for_the_requests_items_even_idle_is_a_missed_deadline() -> None:
    """Three items take 0.5 + 3 ms idle, over a 2 ms budget (one item would fit): no queue
    is to blame."""
    chosen = pick(Attempt(model="digits", remaining_ms=2.0, items=3), Agent(id="d"))
    assert chosen == NoTarget(reason="no tier can answer 'digits' within 2.0 ms", too_slow=True)


def test_an_empty_fleet_says_nothing_can_serve_the_model() -> None:
    """Nothing listed at all: the plain reason, neither full nor too slow."""
    chosen = pick(Attempt(model="digits", remaining_ms=None))
    assert chosen == NoTarget(reason="nothing in the fleet above the tiers tried can serve 'digits'")


def test_top_tier_of_nothing_reachable_is_none() -> None:
    """No tier listed, or only tiers above max_tier: no top tier."""
    assert top_tier(FleetSnapshot(pools={}), CLOUD) is None
    assert top_tier(FleetSnapshot(pools={}, tiers=frozenset({CLOUD})), EDGE) is None


# -- the climb --------------------------------------------------------------------------------


def test_a_pinned_dispatch_is_final_below_the_top_tier() -> None:
    """A pinned variant cannot climb: its answer from the device settles the request."""
    fleet = snapshot(Agent(id="d", tier=DEVICE), Agent(id="e", tier=EDGE))
    state = ClimbState()
    action = next_action(state, state.attempt("digits", 100.0), fleet, random.Random(0), pinned=True)
    assert isinstance(action, Dispatch) and action.target.id == "d" and action.final


def test_next_action_draws_a_pair_with_the_climbs_random_source() -> None:
    """Three usable agents need a random pair; the climb's source decides it, reproducibly."""
    fleet = snapshot(Agent(id="a"), Agent(id="b", in_flight=1), Agent(id="c", in_flight=2))
    state = ClimbState()
    ids: set[str] = set()
    for seed in range(30):
        action = next_action(state, state.attempt("digits", 100.0), fleet, random.Random(seed))
        assert isinstance(action, Dispatch)
        again = next_action(state, state.attempt("digits", 100.0), fleet, random.Random(seed))
        assert isinstance(again, Dispatch) and again.target.id == action.target.id
        ids.add(action.target.id)
    assert ids == {"a", "b"}


def test_a_tier_listed_but_not_ready_is_named_as_not_ready() -> None:
    """The cloud's link down (or its breaker open) used to read "nothing in the fleet ... can
    serve", as if no cloud were configured; a degraded answer then carries this reason."""
    chosen = pick(Attempt(model="digits", remaining_ms=None), Agent(id="c", tier=CLOUD, ready=False))
    assert chosen == NoTarget(reason="the cloud tier serving 'digits' is not ready now")
    two = pick(  # listed cloud first: named in tier order all the same
        Attempt(model="digits", remaining_ms=None),
        Agent(id="c", tier=CLOUD, ready=False),
        Agent(id="e", tier=EDGE, ready=False),
    )
    assert two == NoTarget(reason="the edge/cloud tier serving 'digits' is not ready now")


def test_a_tier_not_ready_is_not_named_when_excluded_or_outside_the_attempt() -> None:
    """A target this request already failed on, or a tier its max_tier leaves out, says nothing
    about what could still be tried: the plain reason."""
    plain = NoTarget(reason="nothing in the fleet above the tiers tried can serve 'digits'")
    failed = Attempt(model="digits", remaining_ms=None, exclude=frozenset({"c"}))
    assert pick(failed, Agent(id="c", tier=CLOUD, ready=False)) == plain
    kept_low = Attempt(model="digits", remaining_ms=None, max_tier=EDGE)
    assert pick(kept_low, Agent(id="c", tier=CLOUD, ready=False)) == plain
