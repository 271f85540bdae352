"""The fleet index and the registry that keeps it: agents appear, change, drain, get lost
and are forgotten, and the policy only ever draws among the agents a request may use."""

from __future__ import annotations

import asyncio
import random

import pytest

from router.api.link import AdmissionGate
from router.fleet.index import Pool
from router.fleet.registry import FleetRegistry
from router.fleet.states import FORGET_LOST_S, MISSED_HEARTBEATS, pace_for
from router.policy import Attempt, Target, choose
from stratus.convert.fleet import heartbeat_from_wire
from stratus.convert.hello import hello_from_wire
from stratus.errors import InvalidInput, Overloaded
from stratus.obs.stats import RateMeter
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hello(
    name: str, tier: int = fpb.TIER_DEVICE, *, variant: str = "digits-small", threshold: float = 0.9
) -> fpb.Hello:
    return fpb.Hello(
        agent_id=name,
        tier=tier,
        capacity=2,
        queue_limit=8,
        variants=[fpb.VariantInfo(name=variant, family="digits")],
        families=[
            fpb.FamilyInfo(
                name="digits",
                inputs=[
                    pb.ModelMetadataResponse.TensorMetadata(name="input", datatype="FP32", shape=[-1, 64])
                ],
                thresholds={"device": threshold},
            )
        ],
    )


def registry(clock: Clock | None = None, **kwargs: float) -> FleetRegistry:
    return FleetRegistry(clock=clock or Clock(), **kwargs)


def ids(pool: object) -> set[str]:
    return {a.id for a in pool}  # type: ignore[attr-defined]


def test_pool_adds_removes_and_keeps_random_access_dense() -> None:
    reg = registry()
    handles = [reg.register(hello_from_wire(hello(f"d{i}")), peer="t") for i in range(5)]
    pool: Pool[object] = Pool()
    for h in handles:
        pool.add(h)
        pool.add(h)  # twice is once
    pool.remove(handles[1])
    pool.remove(handles[1])
    assert len(pool) == 4 and ids(pool) == {"d0", "d2", "d3", "d4"}
    assert {pool[i].id for i in range(len(pool))} == ids(pool)  # type: ignore[attr-defined]
    assert handles[1] not in pool and handles[4] in pool


def test_agents_appear_change_drain_get_lost_and_are_forgotten() -> None:
    clock = Clock()
    reg = registry(clock)
    device = reg.register(hello_from_wire(hello("d1")), peer="t")
    edge = reg.register(hello_from_wire(hello("e1", fpb.TIER_EDGE, variant="digits-medium")), peer="t")
    assert ids(reg.index.pools("digits")[Tier.DEVICE]) == {"d1"}
    assert ids(reg.index.pools("digits-medium")[Tier.EDGE]) == {"e1"}
    assert reg.index.tiers("digits") == {Tier.DEVICE, Tier.EDGE}
    assert reg.index.family_of("digits-small") == "digits"

    # change: a heartbeat carries only what changed; the rest is kept
    beat = fpb.Heartbeat(latency=[fpb.LatencyEstimate(variant="digits-small", mean_ms=2.5)])
    reg.heartbeat(device, heartbeat_from_wire(beat))
    reg.heartbeat(device, heartbeat_from_wire(fpb.Heartbeat()))
    assert device.cost_ms("digits", 1) == device.cost_ms("digits-small", 1) == 2.5

    reg.draining(edge)
    assert Tier.EDGE not in reg.index.pools("digits") and reg.index.tiers("digits") == {
        Tier.DEVICE,
        Tier.EDGE,
    }

    reg.lose(device, "test")
    assert not reg.index.any_ready() and not reg.index.serves("digits")
    assert reg.index.tiers("digits") == {Tier.DEVICE, Tier.EDGE}  # lost, still listed

    clock.now += FORGET_LOST_S + 1
    reg.check_heartbeats()
    assert "d1" not in reg.agents and reg.index.tiers("digits") == {Tier.EDGE}
    assert reg.index.family_of("digits-small") is None

    again = reg.register(hello_from_wire(hello("d1")), peer="t")  # the same id comes back
    assert ids(reg.index.pools("digits")[Tier.DEVICE]) == {"d1"} and again.ready


def test_a_reconnect_replaces_the_old_link_in_the_index() -> None:
    reg = registry()
    old = reg.register(hello_from_wire(hello("d1")), peer="t")
    new = reg.register(hello_from_wire(hello("d1")), peer="t")
    pool = reg.index.pools("digits")[Tier.DEVICE]
    assert len(pool) == 1 and pool[0] is new and not old.ready
    assert reg.index.tiers("digits") == {Tier.DEVICE}


def test_a_silent_agent_is_lost_after_missed_heartbeats_at_its_pace() -> None:
    clock = Clock()
    reg = registry(clock)
    handle = reg.register(hello_from_wire(hello("d1")), peer="t")
    clock.now += MISSED_HEARTBEATS * handle.heartbeat_s - 0.1
    reg.check_heartbeats()
    assert handle.ready
    clock.now += 0.2
    reg.check_heartbeats()
    assert not handle.ready and not reg.index.serves("digits")


def test_the_policy_never_picks_a_lost_or_draining_agent() -> None:
    reg = registry()
    handles = [reg.register(hello_from_wire(hello(f"d{i}")), peer="t") for i in range(40)]
    for h in handles[:20]:
        reg.lose(h, "test")
    for h in handles[20:35]:
        reg.draining(h)
    allowed = {h.id for h in handles[35:]}
    attempt = Attempt(model="digits", remaining_ms=None)
    picks = {
        choose(attempt, reg.snapshot("digits"), random.Random(seed)).id  # type: ignore[union-attr]
        for seed in range(200)
    }
    assert picks == allowed


def test_pinned_variants_route_only_to_agents_that_hold_them() -> None:
    reg = registry()
    reg.register(hello_from_wire(hello("d1", variant="digits-small")), peer="t")
    reg.register(hello_from_wire(hello("d2", variant="digits-tiny")), peer="t")
    target = choose(
        Attempt(model="digits-tiny", remaining_ms=None), reg.snapshot("digits-tiny"), random.Random(0)
    )
    assert isinstance(target, Target) and (target.tier, target.id) == (Tier.DEVICE, "d2")


def test_an_agent_describing_a_family_differently_is_refused_until_the_others_leave() -> None:
    reg = registry()
    first = reg.register(hello_from_wire(hello("d1", threshold=0.9)), peer="t")
    with pytest.raises(InvalidInput, match=r"family 'digits' differs .*thresholds"):
        reg.register(hello_from_wire(hello("d2", threshold=0.5)), peer="t")
    assert "d2" not in reg.agents
    reg.lose(first, "gone")
    reg.register(hello_from_wire(hello("d2", threshold=0.5)), peer="t")  # nobody serves the old description now
    assert reg.thresholds("digits") == {Tier.DEVICE: 0.5}


def test_a_variant_claimed_by_another_family_is_refused() -> None:
    reg = registry()
    reg.register(hello_from_wire(hello("d1")), peer="t")
    other = hello("x1")
    other.variants[0].family = "faces"
    other.families[0].name = "faces"
    with pytest.raises(InvalidInput, match="belongs to family 'digits'"):
        reg.register(hello_from_wire(other), peer="t")


def test_pace_doubles_with_the_fleet_and_every_linked_agent_is_told() -> None:
    assert pace_for(10, base_s=1.0, max_per_s=100) == 1.0
    assert pace_for(1000, base_s=1.0, max_per_s=100) == 16.0  # 1000 / 16 = 62.5 heartbeats a second
    assert pace_for(2000, base_s=1.0, max_per_s=100) == 32.0
    reg = registry(max_heartbeats_per_s=2.0)
    first = reg.register(hello_from_wire(hello("d1")), peer="t")
    second = reg.register(hello_from_wire(hello("d2")), peer="t")
    third = reg.register(hello_from_wire(hello("d3")), peer="t")  # 3 agents at 1 s would be 3/s: 2 s
    assert reg.pace_s == 2.0 and all(h.heartbeat_s == 2.0 for h in (first, second, third))
    paces = [m.pace.heartbeat_interval_s for m in first.work.outbox._queue if m is not None and m.HasField("pace")]  # type: ignore[attr-defined]
    assert paces == [2.0]
    reg.lose(third, "gone")  # two agents again: back to 1 s, and the survivors are told
    assert reg.pace_s == 1.0 and first.heartbeat_s == 1.0
    paces = [m.pace.heartbeat_interval_s for m in first.work.outbox._queue if m is not None and m.HasField("pace")]  # type: ignore[attr-defined]
    assert paces == [2.0, 1.0]


def test_admission_gate_lets_a_burst_in_then_spaces_the_rest() -> None:
    clock = Clock()
    gate = AdmissionGate(rate_per_s=100.0, burst=3, max_waiting=10, clock=clock)
    assert [gate.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert gate.take() == pytest.approx(0.01)
    assert gate.take() == pytest.approx(0.02)
    clock.now += 1.0  # a quiet second refills the bucket, never beyond the burst
    assert [gate.take() for _ in range(3)] == [0.0, 0.0, 0.0]


def test_admission_gate_refuses_past_its_waiting_line() -> None:
    async def scenario() -> list[str]:
        gate = AdmissionGate(rate_per_s=10.0, burst=1, max_waiting=2)
        outcomes: list[str] = []

        async def one(name: str) -> None:
            try:
                await gate.admit(name)
                outcomes.append(f"{name} in")
            except Overloaded as exc:
                outcomes.append(f"{name} refused: {exc}")

        await asyncio.gather(*(one(f"a{i}") for i in range(4)))
        return outcomes

    outcomes = asyncio.run(scenario())
    # a0 takes the one token at once; a1 and a2 fill the line of two; a3 is refused
    assert sorted(outcomes) == [
        "a0 in",
        "a1 in",
        "a2 in",
        "a3 refused: the router is admitting 2 other agents; a3 should retry later",
    ]


def test_rate_meter_counts_the_last_seconds_only() -> None:
    clock = Clock()
    meter = RateMeter(window_s=10, clock=clock)
    clock.now += 10
    for _ in range(50):
        meter.add()
    assert meter.per_second() == pytest.approx(5.0)
    clock.now += 20
    assert meter.per_second() == 0.0
