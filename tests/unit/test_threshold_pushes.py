"""Fleet-wide threshold pushes: versions only grow, a revert walks back one version, and the
registry serves the pushed thresholds (an agent announcing other ones is no longer refused for
them). How a site's routers share them: tests/unit/test_rollout_records.py and the site store's
integration tests."""

from __future__ import annotations

import pytest

from router.fleet.registry import FleetRegistry
from router.thresholds.pushes import (
    ThresholdPushes,
    pushable,
    steer,
    threshold_levels,
    to_wire,
)
from stratus.convert.hello import hello_from_wire
from stratus.errors import Conflict, InvalidInput, NotFound
from stratus.families.confidence import PASS_ALL
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from tests.unit.test_index import hello

DEVICE, EDGE = Tier.DEVICE, Tier.EDGE


def pushes(router_id: str = "a", now: float = 1000.0) -> ThresholdPushes:
    return ThresholdPushes(router_id=router_id, wall_clock=lambda: now)


def test_versions_grow_and_each_says_who_why_and_what_it_replaced() -> None:
    book = pushes()
    first = book.apply("digits", {DEVICE: 0.8}, author="ana", reason="recalibrated")
    second = book.apply("digits", {DEVICE: 0.95, EDGE: 0.7}, author="bo", reason="drift")
    assert (first.version, first.base, second.version, second.base) == (1, 0, 2, 1)
    assert (second.author, second.reason, second.origin, second.updated) == ("bo", "drift", "a", 1000.0)
    assert book.in_force("digits") == {DEVICE: 0.95, EDGE: 0.7}


def test_revert_walks_back_one_version_each_time_then_to_the_agents_own() -> None:
    book = pushes()
    book.apply("digits", {DEVICE: 0.8}, author="ana", reason="one")
    book.apply("digits", {DEVICE: 0.9}, author="ana", reason="two")
    back = book.revert("digits", author="bo", reason="too many climbs")
    assert (back.version, dict(back.thresholds), back.base) == (3, {DEVICE: 0.8}, 0)
    again = book.revert("digits", author="bo", reason="back to calibration")
    assert (again.version, dict(again.thresholds)) == (4, {})
    assert book.in_force("digits") == {}
    with pytest.raises(InvalidInput, match="nothing to revert"):
        book.revert("digits", author="bo", reason="once more")


def test_a_stale_expected_version_is_refused() -> None:
    book = pushes()
    book.apply("digits", {DEVICE: 0.8}, author="ana", reason="one")
    with pytest.raises(Conflict, match="at threshold version 1, not 3"):
        book.apply("digits", {DEVICE: 0.9}, author="bo", reason="late", expected=3)
    assert book.apply("digits", {DEVICE: 0.9}, author="bo", reason="read", expected=1).version == 2


@pytest.mark.parametrize(
    "named", [{"device": 1.5}, {"device": 1.0002}, {"device": -0.1}, {"device": float("nan")}, {"moon": 0.5}]
)
def test_thresholds_outside_zero_to_one_or_of_no_tier_are_refused(named: dict[str, float]) -> None:
    with pytest.raises(InvalidInput):
        pushable(named)


def test_a_tier_can_be_pushed_to_pass_every_request_up() -> None:
    assert pushable({"device": PASS_ALL}) == {DEVICE: PASS_ALL}
    with pytest.raises(InvalidInput, match=r"is not in \[0, 1\] \(or 1.0001: the tier passes every request up\)"):
        pushable({"device": 1.5})


def test_the_cloud_threshold_is_not_pushed() -> None:
    with pytest.raises(InvalidInput, match="cloud tier answers"):
        pushable({"cloud": 0.5})


def test_the_registry_serves_the_pushed_thresholds_and_its_agents_own_after_a_revert() -> None:
    reg = FleetRegistry()
    reg.register(hello_from_wire(hello("d1", threshold=0.5)), peer="t")
    reg.override_thresholds("digits", {DEVICE: 1.0})
    assert reg.thresholds("digits") == {DEVICE: 1.0}
    info = reg.family("digits")
    assert info is not None and dict(info.thresholds) == {DEVICE: 1.0}  # what every cascade reads
    assert reg.own_thresholds("digits") == {DEVICE: 0.5}
    reg.override_thresholds("digits", {})
    assert reg.thresholds("digits") == {DEVICE: 0.5}


def test_an_agent_with_other_thresholds_is_refused_without_a_push_and_served_with_one() -> None:
    reg = FleetRegistry()
    reg.register(hello_from_wire(hello("d1", threshold=0.5)), peer="t")
    with pytest.raises(InvalidInput, match="thresholds differ"):
        reg.register(hello_from_wire(hello("d2", threshold=0.7)), peer="t")
    reg.override_thresholds("digits", {DEVICE: 0.9})
    served = reg.register(hello_from_wire(hello("d3", threshold=0.7)), peer="t")
    assert not served.unavailable
    assert reg.thresholds("digits") == {DEVICE: 0.9}


def test_steer_refuses_an_unknown_family_and_reports_what_is_in_force() -> None:
    reg = FleetRegistry()
    reg.register(hello_from_wire(hello("d1", threshold=0.5)), peer="t")
    book = pushes()
    book.listeners.append(reg.override_thresholds)
    apply = fpb.ThresholdsRequest(
        family="digits", action=fpb.THRESHOLDS_ACTION_APPLY, thresholds={"device": 0.75}
    )
    answer = steer(book, reg, apply)
    assert dict(answer.in_force) == {"device": 0.75} and dict(answer.agents) == {"device": 0.5}
    assert [v.version for v in answer.history] == [1] and "version 1 in force" in answer.message
    with pytest.raises(NotFound):
        steer(book, reg, fpb.ThresholdsRequest(family="other", action=fpb.THRESHOLDS_ACTION_APPLY))


def test_a_push_naming_a_tier_the_family_does_not_have_is_refused() -> None:
    """``--apply edge=0.5`` for a family of device agents with a device threshold only was kept
    (version 1) and never read; now it is refused, naming the tiers it has."""
    reg = FleetRegistry()
    reg.register(hello_from_wire(hello("d1", threshold=0.5)), peer="t")
    book = pushes()
    book.listeners.append(reg.override_thresholds)

    def apply(**named: float) -> fpb.ThresholdsReply:
        request = fpb.ThresholdsRequest(family="digits", action=fpb.THRESHOLDS_ACTION_APPLY, thresholds=named)
        return steer(book, reg, request)

    with pytest.raises(InvalidInput) as refused:
        apply(device=0.6, edge=0.5)
    assert str(refused.value) == (
        "'digits' has no edge tier (no agent of it there, no threshold of its own there): push "
        "thresholds for device"
    )
    assert book.record("digits") is None  # nothing kept
    assert dict(apply(device=0.6).in_force) == {"device": 0.6}
    reg.register(hello_from_wire(hello("e1", tier=fpb.TIER_EDGE, threshold=0.5)), peer="t")  # an edge agent joins
    assert dict(apply(device=0.6, edge=0.5).in_force) == {"device": 0.6, "edge": 0.5}


def test_the_version_and_thresholds_in_force_are_exported_and_shown_with_the_accuracy() -> None:
    from stratus.cli.accuracy import accuracy_table

    reg = FleetRegistry()
    reg.register(hello_from_wire(hello("d1", threshold=0.5)), peer="t")
    book = pushes()
    book.listeners.append(reg.override_thresholds)
    book.apply("digits", {DEVICE: 0.8}, author="ana", reason="one")
    book.apply("digits", {DEVICE: 0.9}, author="ana", reason="drift on line 3")
    version, in_force = threshold_levels(book, reg)
    assert [(s.labels, s.value) for s in version.samples] == [({"family": "digits"}, 2.0)]
    assert [(s.labels, s.value) for s in in_force.samples] == [({"family": "digits", "tier": "device"}, 0.9)]
    record = book.record("digits")
    assert record is not None
    reply = fpb.AccuracyReply(family="digits", top_tier=fpb.TIER_EDGE, pushed=to_wire(record.current))
    assert (
        "thresholds: pushed version 2 in force (device=0.9), by ana on a: drift on line 3"
        in accuracy_table(reply)
    )
    assert "pushed version" not in accuracy_table(fpb.AccuracyReply(family="digits", top_tier=fpb.TIER_EDGE))


def recalibrated(name: str) -> fpb.Hello:
    """An agent whose folder was recalibrated: other thresholds, figures and cloud share."""
    made = hello(name, threshold=0.8)
    family = made.families[0]
    family.thresholds["edge"] = 0.65
    family.calibrated["device"].CopyFrom(fpb.TierCalibration(accuracy=0.97, agreement=0.98, items=300))
    family.calibrated_cloud_share = 0.07
    return made


def test_a_recalibrated_agent_is_refused_without_a_push_and_joins_under_one() -> None:
    reg = FleetRegistry()
    first = hello("d1", threshold=0.5)
    first.families[0].thresholds["edge"] = 0.6
    reg.register(hello_from_wire(first), peer="t")
    with pytest.raises(InvalidInput, match="refused until they leave"):
        reg.register(hello_from_wire(recalibrated("d2")), peer="t")
    reg.override_thresholds("digits", {DEVICE: 0.9})
    joined = reg.register(hello_from_wire(recalibrated("d3")), peer="t")
    assert not joined.unavailable
    # the pushed tier, the first agents' other tier; and no calibrated baseline while the push holds
    assert reg.thresholds("digits") == {DEVICE: 0.9, EDGE: 0.6}
    info = reg.family("digits")
    assert info is not None and info.calibrated_cloud_share is None and not info.tier_accuracy
    reg.override_thresholds("digits", {})
    assert reg.thresholds("digits") == {DEVICE: 0.5, EDGE: 0.6}
