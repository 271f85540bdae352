"""Fleet.Accuracy's reply and `stratus fleet accuracy`'s table: rows per tier, agents ranked."""

from __future__ import annotations

import dataclasses
import random

import pytest

from router.api.accuracy import accuracy_reply
from router.audit.agreement import DRIFTED, IN_LINE, NOT_CALIBRATED, TOO_FEW, AuditKey
from router.audit.auditor import Auditor
from router.fleet.registry import FleetRegistry
from stratus.cli.accuracy import accuracy_json, accuracy_table
from stratus.convert.hello import hello_from_wire
from stratus.errors import NotFound
from stratus.families.audit import TierCalibration
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb


def hello(name: str, tier: int, variant: str) -> fpb.Hello:
    message = fpb.Hello(agent_id=name, tier=tier, capacity=1)  # type: ignore[arg-type]
    message.variants.add(name=variant, family="digits", current=True, line=variant)
    family = message.families.add(name="digits", thresholds={"device": 0.7, "edge": 0.7})
    family.calibrated["device"].CopyFrom(fpb.TierCalibration(accuracy=0.99, agreement=0.995, items=309))
    family.calibrated["edge"].CopyFrom(fpb.TierCalibration(accuracy=0.97, items=6))  # the top, calibrated
    return message


def fleet() -> Auditor:
    """Three device agents and an edge one, no cloud: the edge tier is the top."""
    registry = FleetRegistry()
    for name in ("camera-1", "camera-2", "camera-3"):
        registry.register(hello_from_wire(hello(name, fpb.TIER_DEVICE, "digits-small")), peer="test")
    registry.register(hello_from_wire(hello("edge-1", fpb.TIER_EDGE, "digits-medium")), peer="test")
    audits = Auditor(registry, None, rng=random.Random(1))
    audits.dropped = 7
    for agent, agreed, audited in (("camera-1", 199, 200), ("camera-2", 40, 100), ("camera-3", 3, 3)):
        for index in range(audited):
            audits.book.add(AuditKey("digits", Tier.DEVICE, "digits-small", agent), index < agreed)
    for index in range(10):
        audits.escalated.add(AuditKey("digits", Tier.DEVICE, "digits-small", "camera-1"), index < 6)
    return audits


def test_one_row_per_tier_below_the_top_with_its_calibration_estimate_and_verdict() -> None:
    reply = accuracy_reply(fleet(), "digits", include_agents=False)
    assert reply.top_tier == reply.calibrated_top_tier == fpb.TIER_EDGE
    assert reply.dropped == 7 and not reply.agents
    (device,) = reply.tiers
    assert list(device.variants) == ["digits-small"]
    assert (device.live.audits, device.live.agreed) == (303, 242)
    assert device.live.lower < device.live.agreement < device.live.upper
    assert device.calibrated.agreement == pytest.approx(0.995)
    assert device.verdict == DRIFTED  # 242 of 303 = 0.80: far under 0.945
    assert (device.escalated.audits, device.escalated.agreed) == (10, 6)  # biased, kept apart


def test_agents_are_ranked_with_the_surely_worst_last() -> None:
    reply = accuracy_reply(fleet(), "digits", include_agents=True)
    ranked = [(a.agent, a.verdict) for a in reply.agents]
    # camera-3 agreed 3 of 3 (0.44-1.0): the best it could be is perfect, so it ranks first, yet
    # it is "too few audits"; camera-2's 40 of 100 is surely the worst, so it comes last.
    assert ranked == [("camera-3", TOO_FEW), ("camera-1", IN_LINE), ("camera-2", DRIFTED)]


def recalibrated(audits: Auditor, figures: dict[Tier, TierCalibration]) -> None:
    """The fleet's description of digits from now on, with these calibrated figures."""
    described = audits.registry.families["digits"]
    audits.registry.describe(dataclasses.replace(described, tier_accuracy=figures))


def test_a_tier_without_calibrated_figures_is_not_judged() -> None:
    audits = fleet()
    recalibrated(audits, {t: f for t, f in audits.registry.families["digits"].tier_accuracy.items() if t is not Tier.DEVICE})
    reply = accuracy_reply(audits, "digits", include_agents=True)
    assert reply.tiers[0].verdict == NOT_CALIBRATED and not reply.tiers[0].HasField("calibrated")
    assert {a.verdict for a in reply.agents} == {NOT_CALIBRATED}


def test_figures_calibrated_against_another_top_tier_are_shown_but_not_judged() -> None:
    """Calibrated with the cloud on top, audited in a fleet whose top is the edge: the edge's
    answers are not what the calibrated agreement measured."""
    audits = fleet()
    calibrated = audits.registry.families["digits"].tier_accuracy
    recalibrated(audits, {**calibrated, Tier.CLOUD: TierCalibration(accuracy=0.9, agreement=None, items=5)})
    reply = accuracy_reply(audits, "digits", include_agents=True)
    assert reply.calibrated_top_tier == fpb.TIER_CLOUD and reply.top_tier == fpb.TIER_EDGE
    assert reply.tiers[0].verdict == NOT_CALIBRATED and reply.tiers[0].calibrated.agreement == pytest.approx(
        0.995
    )
    assert {a.verdict for a in reply.agents} == {NOT_CALIBRATED}
    assert "calibrated against the cloud tier, but audits here ask the edge tier" in accuracy_table(reply)


def test_an_unknown_family_is_not_found() -> None:
    with pytest.raises(NotFound, match="no agent serves a family 'letters'"):
        accuracy_reply(fleet(), "letters", include_agents=False)


def test_the_table_and_json_say_the_same() -> None:
    reply = accuracy_reply(fleet(), "digits", include_agents=True)
    found = accuracy_json(reply)
    assert found["top_tier"] == "edge" and found["tiers"][0]["calibrated"]["agreement"] == 0.995
    assert [a["agent"] for a in found["agents"]] == ["camera-3", "camera-1", "camera-2"]
    table = accuracy_table(reply).splitlines()
    device = next(line for line in table if line.startswith("device"))
    assert (
        "digits-small" in device and "0.9950" in device and "drifted" in device and "0.6000 of 10" in device
    )
    agents = [line.split()[0] for line in table if line.startswith("camera-")]
    assert agents == ["camera-3", "camera-1", "camera-2"]
    assert any("dropped so far: 7 audits" in line for line in table)
