"""What the registry keeps of what agents tell it is bounded (the security review's F12,
F16, F19): family descriptions leave with their last agent, lost agents are capped, Watch
calls are capped, declared sizes and reported confidences are clamped."""

from __future__ import annotations

import math

import pytest

from router.backends.agent import PATIENCE_FACTOR, PATIENCE_FLOOR_MS, split_result
from router.catalog import listing
from router.fleet import registry as registry_module
from router.fleet import states as states_module
from router.fleet.agent_handle import FIRST_WINDOW
from router.fleet.states import FORGET_LOST_S
from router.fleet.watchers import MAX_OPERATOR_WATCHERS, MAX_WATCHERS, MAX_WATCHERS_PER_ADDRESS
from stratus.convert.fleet import heartbeat_from_wire
from stratus.convert.hello import hello_from_wire
from stratus.convert.work import WorkResult, result_from_wire
from stratus.errors import InvalidInput, Overloaded
from stratus.obs.stats import LatencySummary
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb

from .test_index import Clock, hello, registry


def test_a_family_description_leaves_with_its_last_agent() -> None:
    clock = Clock()
    reg = registry(clock)
    first, second = (reg.register(hello_from_wire(hello(name)), peer="t") for name in ("d1", "d2"))
    reg.lose(first, "gone")
    clock.now += FORGET_LOST_S + 1
    reg.check_heartbeats()
    assert "digits" in reg.families  # d2 still serves it
    reg.lose(second, "gone")
    clock.now += FORGET_LOST_S + 1
    reg.check_heartbeats()
    assert reg.agents == {} and reg.families == {}


def test_lost_agents_past_the_cap_are_forgotten_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(states_module, "MAX_LOST", 3)
    clock = Clock()
    reg = registry(clock)
    for index in range(5):
        clock.now += 1
        reg.lose(reg.register(hello_from_wire(hello(f"d{index}")), peer="t"), "gone")
    assert sorted(reg.agents) == ["d2", "d3", "d4"]


def test_watch_calls_past_the_cap_are_refused_but_operators_keep_places() -> None:
    reg = registry()
    queues = [reg.watch(address=f"ipv4:10.0.0.{n}") for n in range(MAX_WATCHERS)]
    with pytest.raises(Overloaded, match=f"{MAX_WATCHERS} Watch calls are open"):
        reg.watch(address="ipv4:10.0.1.1")
    operators = [reg.watch(address="ipv4:10.0.9.9", operator=True) for _ in range(MAX_OPERATOR_WATCHERS - MAX_WATCHERS)]
    with pytest.raises(Overloaded, match=f"{MAX_OPERATOR_WATCHERS} Watch calls are open"):
        reg.watch(address="ipv4:10.0.9.9", operator=True)
    for queue in [*queues, *operators]:
        reg.unwatch(queue)
    one = [reg.watch(address="ipv4:10.0.0.1") for _ in range(MAX_WATCHERS_PER_ADDRESS)]
    with pytest.raises(Overloaded, match=f"this address holds {MAX_WATCHERS_PER_ADDRESS} Watch calls"):
        reg.watch(address="ipv4:10.0.0.1")
    reg.watch(address="ipv4:10.0.0.2")  # another address is not held back
    reg.unwatch(one[0])
    reg.watch(address="ipv4:10.0.0.1")  # a place came free


def test_declared_sizes_are_clamped() -> None:
    greedy = hello("greedy")
    greedy.capacity, greedy.queue_limit = 4_000_000_000, 4_000_000_000
    greedy.variants[0].max_batch = 1_000_000
    handle = registry().register(hello_from_wire(greedy), peer="t")
    assert (handle.declared, handle.queue_limit, handle.max_batch("digits-small")) == (1024, 4096, 1024)
    assert handle.capacity == FIRST_WINDOW  # what it is trusted with until it serves more


def test_a_declared_capacity_is_earned_by_serving_it_and_lost_by_missing_deadlines() -> None:
    """security2 N3: the slots an agent is trusted with grow only while every one is busy and
    answers come in time (a window's worth of answers for one more), up to what it declared;
    a budget it lets run out halves them."""
    greedy = hello("greedy")
    greedy.capacity = 1024
    handle = registry().register(hello_from_wire(greedy), peer="t")
    assert handle.work.batcher.slots == FIRST_WINDOW
    for _ in range(100):
        handle.work.learnt(WorkResult(request_id="r", variant="digits-small"), 1.0, saturated=False)
    assert handle.capacity == FIRST_WINDOW, "answers while slots stood idle prove nothing"
    answers = 0
    while handle.capacity == FIRST_WINDOW:
        handle.work.learnt(WorkResult(request_id="r", variant="digits-small"), 1.0, saturated=True)
        answers += 1
    assert FIRST_WINDOW <= answers <= 2 * FIRST_WINDOW  # about a window's worth for one more slot
    assert handle.capacity == FIRST_WINDOW + 1 and handle.work.batcher.slots == FIRST_WINDOW + 1
    handle.work.missed()
    assert handle.capacity == (FIRST_WINDOW + 1) // 2 and handle.work.batcher.slots == handle.capacity
    for _ in range(20):
        handle.work.missed()
    assert handle.capacity == 1
    small = hello("small")
    small.capacity = 2
    honest = registry().register(hello_from_wire(small), peer="t")
    for _ in range(1000):
        honest.work.learnt(WorkResult(request_id="r", variant="digits-small"), 1.0, saturated=True)
    assert honest.capacity == 2, "never past what it declared"


def test_reported_confidences_are_clamped_to_what_the_policy_compares() -> None:
    handle = registry().register(hello_from_wire(hello("d1")), peer="t")
    result = fpb.Result(request_id="r1", variant="digits-small", confidences=[math.nan, 7.0, -1.0, 0.5])
    result.response.outputs.add(name="probabilities", datatype="FP32", shape=[4, 1])
    result.response.raw_output_contents.append(b"\0" * 16)
    (part,) = split_result(handle.id, result_from_wire(result, "agent d1"), [4])
    assert part.confidences == (0.0, 1.0, 0.0, 0.5)


def test_error_messages_list_a_bounded_number_of_names() -> None:
    names = [f"m{i:03}" for i in range(300)]  # 6 characters each, with the ", " after it
    shown = 1024 // 6
    assert listing(names) == (
        "[" + ", ".join(names[:shown]) + f", and {300 - shown} more (RepositoryIndex lists them all)]"
    )
    assert listing(names[:3]) == "[m000, m001, m002]"
    assert listing(["x" * 2000, "short"]) == "[and 2 more (RepositoryIndex lists them all)]"
    assert len(listing([f"{'n' * 127}{i}" for i in range(5000)])) < 1024 + 64


def test_an_agent_that_describes_one_family_differently_still_serves_the_others() -> None:
    """A rogue that registered first must not lock a real agent out of every family (F2):
    only the family described differently is refused, and the agent says so."""
    reg = registry()
    reg.register(hello_from_wire(hello("first", threshold=0.9)), peer="t")
    both = hello("second", threshold=0.5)  # digits unlike the fleet's, defects new
    both.variants.add(name="defects-small", family="defects")
    both.families.add(name="defects", thresholds={"device": 0.8})
    handle = reg.register(hello_from_wire(both), peer="t")
    assert sorted(handle.variants) == ["defects-small"]
    (refused,) = handle.unavailable
    assert (refused.family, refused.variant) == ("digits", "digits-small")
    assert refused.reason.startswith("refused by the router: differs from the one ready agents serve (thresholds differ)")
    assert reg.thresholds("digits") == {Tier.DEVICE: 0.9} and reg.thresholds("defects") == {Tier.DEVICE: 0.8}


def test_a_status_lists_agents_up_to_its_size_limit_linked_ones_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.api import fleet_status

    reg = registry()
    for index in range(10):
        handle = reg.register(hello_from_wire(hello(f"d{index}")), peer="t")
        if index < 5:
            reg.lose(handle, "gone")
    one = fleet_status.agent_status(reg.agents["d5"], 0.0).ByteSize() + 8
    monkeypatch.setattr(fleet_status, "MAX_STATUS_BYTES", one * 7)
    status = fleet_status.fleet_status(reg, None, include_agents=True)
    assert [a.id for a in status.agents][:5] == ["d5", "d6", "d7", "d8", "d9"]  # the linked ones first
    assert len(status.agents) == 7 and status.omitted_agents == 3
    assert all(a.state == fpb.AGENT_STATE_LOST for a in status.agents[5:])


def test_a_watch_lists_less_than_a_status(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.api import fleet_service, fleet_status

    reg = registry()
    for index in range(6):
        reg.register(hello_from_wire(hello(f"d{index}")), peer="t")
    one = fleet_status.agent_status(reg.agents["d0"], 0.0).ByteSize() + 8
    monkeypatch.setattr(fleet_service, "MAX_WATCH_STATUS_BYTES", one * 2)
    watched = fleet_service.FleetServicer(reg, None)._shared_status(include_agents=True)
    assert (len(watched.agents), watched.omitted_agents) == (2, 4)
    assert len(fleet_status.fleet_status(reg, None, include_agents=True).agents) == 6  # Status lists all


def calibrated(reg: registry_module.FleetRegistry) -> dict[str, float]:
    """The router's calibrated-share gauge, as a scrape would read it."""
    from router.api.fleet_status import calibrated_shares

    return {sample.labels["family"]: sample.value for sample in calibrated_shares(reg).samples}


def test_each_familys_calibrated_cloud_share_is_exported_as_its_agents_said() -> None:
    """Only families whose Hello carries a share have a sample: one never calibrated has no
    baseline, so no cloud-share alert; the share leaves with the family's last agent."""
    clock = Clock()
    reg = registry(clock)
    with_share = hello("d1")
    with_share.families[0].calibrated_cloud_share = 0.0159
    uncalibrated = hello("d2", variant="defects-small")
    uncalibrated.variants[0].family = uncalibrated.families[0].name = "defects"
    first = reg.register(hello_from_wire(with_share), peer="t")
    reg.register(hello_from_wire(uncalibrated), peer="t")
    assert calibrated(reg) == {"digits": 0.0159}
    zero = hello("d3", variant="letters-small")
    zero.variants[0].family = zero.families[0].name = "letters"
    zero.families[0].calibrated_cloud_share = 0.0  # nothing reached the cloud: a share, not none
    reg.register(hello_from_wire(zero), peer="t")
    assert calibrated(reg) == {"digits": 0.0159, "letters": 0.0}
    reg.lose(first, "gone")
    clock.now += FORGET_LOST_S + 1
    reg.check_heartbeats()
    assert calibrated(reg) == {"letters": 0.0}


@pytest.mark.parametrize("share", [math.nan, 1.5, -0.01])
def test_a_calibrated_share_that_is_no_share_is_refused(share: float) -> None:
    bad = hello("d1")
    bad.families[0].calibrated_cloud_share = share
    with pytest.raises(InvalidInput, match=r"digits's calibrated_cloud_share .* must lie between 0 and 1"):
        registry().register(hello_from_wire(bad), peer="t")


def test_an_agent_whose_calibration_differs_is_refused_saying_so() -> None:
    reg = registry()
    first = hello("first")
    first.families[0].calibrated_cloud_share = 0.02
    reg.register(hello_from_wire(first), peer="t")
    other = hello("second")
    other.families[0].calibrated_cloud_share = 0.05
    other.variants.add(name="defects-small", family="defects")
    other.families.add(name="defects", thresholds={"device": 0.8})
    (refused,) = reg.register(hello_from_wire(other), peer="t").unavailable
    assert "(calibrated_cloud_share differ)" in refused.reason


def test_an_agent_that_would_let_a_kept_family_leave_the_site_is_refused() -> None:
    """[privacy] escalate is part of a family's description: an agent saying otherwise than the
    fleet (a device whose files lost the setting) cannot widen where its items may go."""
    reg = registry()
    first = hello("first")
    first.families[0].keep_on_site = True
    reg.register(hello_from_wire(first), peer="t")
    assert reg.family("digits") is not None and not reg.family("digits").escalate  # type: ignore[union-attr]
    other = hello("second")
    other.variants.add(name="defects-small", family="defects")
    other.families.add(name="defects", thresholds={"device": 0.8})
    (refused,) = reg.register(hello_from_wire(other), peer="t").unavailable
    assert "(escalate differ)" in refused.reason


def test_thresholds_are_read_once_at_the_hello_and_leave_with_the_family() -> None:
    clock = Clock()
    reg = registry(clock)
    agent = reg.register(hello_from_wire(hello("d1", threshold=0.75)), peer="t")
    assert reg.thresholds("digits") == {Tier.DEVICE: 0.75}
    reg.lose(agent, "gone")
    clock.now += FORGET_LOST_S + 1
    reg.check_heartbeats()
    assert reg.thresholds("digits") == {}


def test_a_reload_brings_its_thresholds_when_no_other_agent_holds_the_family() -> None:
    reg = registry()
    agent = reg.register(hello_from_wire(hello("d1", threshold=0.75)), peer="t")
    reg.reannounce(agent, hello_from_wire(hello("d1", threshold=0.5)))
    assert reg.thresholds("digits") == {Tier.DEVICE: 0.5}


def test_a_hello_with_a_threshold_for_no_tier_is_refused() -> None:
    sky = hello("d1")
    sky.families[0].thresholds["sky"] = 0.5
    with pytest.raises(InvalidInput, match="Hello from d1: family 'digits': thresholds: unknown tier 'sky'"):
        registry().register(hello_from_wire(sky), peer="t")


def test_heartbeat_latency_is_kept_as_figures_for_served_variants_only() -> None:
    """A heartbeat's estimates become numbers the policy may add (NaN, infinite and negative
    times read as unknown), and names the agent does not serve are not kept: a peer sending
    a new name in every heartbeat would otherwise grow its handle without bound."""
    reg = registry()
    handle = reg.register(hello_from_wire(hello("d1")), peer="t")
    beat = fpb.Heartbeat(received=1)
    beat.latency.add(variant="digits-small", mean_ms=math.nan, p50_ms=math.inf, p99_ms=-3.0, count=5)
    beat.latency.extend(fpb.LatencyEstimate(variant=f"made-up-{i}", mean_ms=1.0) for i in range(50))
    reg.heartbeat(handle, heartbeat_from_wire(beat))
    assert list(handle.latency) == ["digits-small"]
    figures = handle.latency["digits-small"]
    assert (figures.mean_ms, figures.p50_ms, figures.p99_ms, figures.count) == (0.0, 0.0, 0.0, 5)
    assert handle.cost_ms("digits", 3) == 3.0  # an unknown mean: 1 ms an item, as before any Result
    beat = fpb.Heartbeat(received=2)
    beat.latency.add(variant="digits-small", mean_ms=2.5, p50_ms=2.0, p99_ms=9.0, count=6)
    reg.heartbeat(handle, heartbeat_from_wire(beat))
    assert handle.cost_ms("digits", 2) == 5.0


def test_an_agent_earns_patience_by_what_it_is_measured_to_take_never_by_what_it_reports() -> None:
    """security2 N3: a Work a black hole holds costs its requests the agent's patience, not their
    budget; only batches this router timed raise it above the floor."""
    handle = registry().register(hello_from_wire(hello("slow")), peer="t")
    assert handle.patience_ms("digits-small", 8) == PATIENCE_FLOOR_MS  # nothing measured yet
    handle.update_latency({"digits-small": LatencySummary(mean_ms=5_000.0, p50_ms=0.0, p99_ms=0.0, count=100)})
    assert handle.cost_ms("digits-small", 1) == 5_000.0  # the policy reads the report ...
    assert handle.patience_ms("digits-small", 1) == PATIENCE_FLOOR_MS  # ... patience does not
    for _ in range(20):
        handle.learn(WorkResult(request_id="r", variant="digits-small", batch_size=8, service_ms=400.0), 401.0)
    assert handle.patience_ms("digits-small", 8) == pytest.approx(PATIENCE_FACTOR * (handle.rtt_ms + 400.0), rel=0.05)


def test_patience_holds_only_where_the_requests_have_somewhere_else_to_go() -> None:
    """An agent alone with its family is waited for the whole budget, slow or not; beside another
    agent of the family, or a cloud that serves it, its Works are bounded by its patience."""
    reg = registry()
    alone = reg.register(hello_from_wire(hello("d1")), peer="t")
    assert not alone.work.settings.elsewhere("digits-small")
    reg.cloud_serves = lambda family: family == "digits"
    assert alone.work.settings.elsewhere("digits-small")
    reg.cloud_serves = lambda family: False
    reg.register(hello_from_wire(hello("d2")), peer="t")
    assert alone.work.settings.elsewhere("digits-small")
