"""--auto-thresholds: bounded steps toward the audits' suggestion, upward only, never past the
cloud share cap, each one a pushed version (author "auto") that --revert undoes, and counted."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from router.fleet.registry import FleetRegistry
from router.thresholds.auto import (
    CAPPED,
    HELD,
    IN_LINE,
    STEPPED,
    WAITING,
    AutoPolicy,
    AutoThresholds,
    auto_levels,
    parse_goals,
    plan_step,
)
from router.thresholds.pushes import ThresholdPushes
from stratus.convert.hello import hello_from_wire
from stratus.errors import ConfigError
from stratus.families.suggest import AuditRow, TierAnswer
from stratus.tiers import Tier
from stratus.tools.calibrate.from_audits import suggest
from tests.unit.test_index import hello
from tests.unit.test_threshold_suggestion import audited_rows

DEVICE, EDGE = Tier.DEVICE, Tier.EDGE


def no_cloud(thresholds: object) -> float:
    return 0.0


def test_a_step_moves_each_threshold_at_most_max_step_toward_the_suggestion() -> None:
    step = plan_step({DEVICE: 0.5, EDGE: 0.6}, {DEVICE: 0.9, EDGE: 0.61}, max_step=0.02, max_cloud_share=1.0,
                     cloud_share=no_cloud)  # fmt: skip
    assert step.outcome == STEPPED and step.thresholds == {DEVICE: 0.52, EDGE: 0.61}
    assert "device 0.5000 -> 0.5200" in step.reason


def test_a_lower_suggestion_is_held_for_an_operator() -> None:
    step = plan_step({DEVICE: 0.8}, {DEVICE: 0.6}, max_step=0.05, max_cloud_share=1.0, cloud_share=no_cloud)
    assert (step.outcome, step.thresholds) == (HELD, None)
    assert "device 0.8000 -> 0.6000" in step.reason
    assert plan_step({DEVICE: 0.8}, {DEVICE: 0.8}, max_step=0.05, max_cloud_share=1.0,
                     cloud_share=no_cloud).outcome == IN_LINE  # fmt: skip


def test_a_step_past_the_cloud_share_cap_is_not_taken() -> None:
    step = plan_step(
        {DEVICE: 0.5}, {DEVICE: 0.9}, max_step=0.02, max_cloud_share=0.1, cloud_share=lambda t: 0.12
    )
    assert (step.outcome, step.thresholds) == (CAPPED, None) and "12.0%" in step.reason


def test_goals_and_bounds_are_checked() -> None:
    assert parse_goals("digits=target_accuracy:0.98,defects=max_escalation:0.05") == {
        "digits": "target_accuracy 0.98",
        "defects": "max_escalation 0.05",
    }
    for bad in ("digits", "digits=target_accuracy"):
        with pytest.raises(ConfigError):
            parse_goals(bad)
    with pytest.raises(ConfigError):
        AutoPolicy(goals="digits=cheapest:0.5")
    with pytest.raises(ConfigError):
        AutoPolicy(max_step=0.0)


def kept_rows() -> list[AuditRow]:
    """The auditor's rows of test_threshold_suggestion, as the router keeps them."""
    return [
        AuditRow(lower=tuple(TierAnswer(Tier.parse(a.tier), a.confidence, a.answer) for a in r.tiers),
            top=Tier.parse(r.top_tier), label=r.label)
        for r in audited_rows()[0]
    ]  # fmt: skip


def steered(
    policy: AutoPolicy, chosen: Mapping[str, str] | None = None
) -> tuple[AutoThresholds, ThresholdPushes, FleetRegistry]:
    """A controller over one digits device agent (threshold 0.5) whose pushes reach the registry."""
    rows = kept_rows()
    registry = FleetRegistry()
    registry.register(hello_from_wire(hello("d1", threshold=0.5)), peer="t")
    pushes = ThresholdPushes(router_id="a")
    pushes.listeners.append(registry.override_thresholds)
    auto = AutoThresholds(policy, pushes, registry, lambda family: rows, lambda: dict(chosen or {}))
    return auto, pushes, registry


def controller(goal: str, **policy: float) -> tuple[AutoThresholds, ThresholdPushes, FleetRegistry]:
    return steered(AutoPolicy(goals=f"digits={goal.replace(' ', ':')}", **policy))


def test_the_controller_steps_up_to_the_suggestion_each_step_a_version_and_reverts() -> None:
    auto, pushes, registry = controller("target_accuracy 0.95", max_step=0.1, max_cloud_share=1.0)
    target = suggest(audited_rows()[0], target_accuracy=0.95).thresholds[DEVICE]
    seen = [auto.step_once("digits").outcome for _ in range(5)]
    assert seen[:3] == [STEPPED, STEPPED, STEPPED] and seen[-1] == IN_LINE  # 0.5 -> 0.6 -> 0.7 -> target
    assert registry.thresholds("digits") == {DEVICE: target}
    record = pushes.record("digits")
    assert record is not None
    assert [round(dict(v.thresholds)[DEVICE], 4) for v in record.history] == [0.6, 0.7, target]
    assert {v.author for v in record.history} == {"auto"}
    assert all("toward target_accuracy 0.95" in v.reason for v in record.history)
    pushes.revert("digits", author="ana", reason="too many climbs")
    assert registry.thresholds("digits") == {DEVICE: 0.7}
    (counter,) = auto_levels(auto)
    counted = {s.labels["outcome"]: s.value for s in counter.samples if s.name.endswith("_total")}
    assert counted == {STEPPED: 3.0, IN_LINE: 2.0}


def test_the_controller_never_lowers_and_never_passes_the_cap() -> None:
    lowering, pushes, _ = controller("max_escalation 0.1")  # suggests a device threshold far below 0.5
    assert lowering.step_once("digits").outcome == HELD and pushes.record("digits") is None
    capped, pushes, _ = controller("target_accuracy 0.98", max_cloud_share=0.0)
    assert capped.step_once("digits").outcome == CAPPED and pushes.record("digits") is None


def test_without_enough_rows_the_controller_waits() -> None:
    registry = FleetRegistry()
    pushes = ThresholdPushes(router_id="a")
    auto = AutoThresholds(
        AutoPolicy(goals="digits=target_accuracy:0.9"), pushes, registry, lambda family: []
    )
    step = auto.step_once("digits")
    assert step.outcome == WAITING and "no audit rows yet" in step.reason


def test_with_families_in_the_list_a_family_s_own_goal_steps_and_the_router_s_goal_wins() -> None:
    chosen = {"digits": "target_accuracy 0.95", "defects": "max_escalation 0.05"}
    policy = AutoPolicy(goals="families", max_step=0.1, max_cloud_share=1.0)
    assert policy.enabled and policy.by_family == {}
    auto, pushes, _ = steered(policy, chosen)
    assert auto.goals() == chosen
    assert auto.step_once("digits").outcome == STEPPED
    record = pushes.record("digits")
    assert record is not None and "toward target_accuracy 0.95" in record.history[-1].reason
    named = AutoPolicy(goals="families,digits=target_accuracy:0.99")
    assert named.goals_with(chosen)["digits"] == "target_accuracy 0.99"
    # without "families", a family's [audit] auto steps nothing: the operator starts controllers
    assert AutoPolicy(goals="defects=max_escalation:0.1").goals_with(chosen) == {"defects": "max_escalation 0.1"}
    assert not AutoPolicy().enabled
