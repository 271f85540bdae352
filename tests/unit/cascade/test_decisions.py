"""``stratus.explain``: the decision record a classifier climb returns (router/offline/decisions.py),
read from the response, for a climb the cloud answered, one it was held back from by the
family's privacy rule, and one it could not take because it was down."""

from __future__ import annotations

import json
from typing import Any

from stratus.convert.parameters import DECISION, parameter_value
from stratus.tiers import Tier

from .fleet_fakes import FAMILY, THRESHOLDS, Fleet, _wire, classifier_family, classify, confidences, fleet

DEVICE, EDGE = Tier.DEVICE, Tier.EDGE
UNSURE_EVERYWHERE = confidences({}, 0.5)  # below both THRESHOLDS


def _decision(response: object) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(str(parameter_value(_wire(response).parameters[DECISION])))  # type: ignore[arg-type]
    return document


def _agents(f: Fleet) -> None:
    f.agent("d1", DEVICE, confidence=UNSURE_EVERYWHERE)
    f.agent("e1", EDGE, confidence=UNSURE_EVERYWHERE)


async def test_no_record_unless_asked() -> None:
    async with fleet() as f:
        _agents(f)
        f.with_cloud()
        response = await f.plane.infer(classify([1]), timeout_s=None)
        assert DECISION not in _wire(response).parameters


async def test_a_climb_the_cloud_answered_records_each_tier_it_passed() -> None:
    async with fleet() as f:
        _agents(f)
        f.with_cloud(confidence=0.99)
        decision = _decision(await f.plane.infer(classify([1, 2], explain=True), timeout_s=None))
        assert (decision["request_id"], decision["family"], decision["model"]) == ("req-1", FAMILY, FAMILY)
        assert (decision["final_tier"], decision["reason"], decision["degraded"]) == ("cloud", "accepted", False)
        assert (decision["provisional"], decision["items"]) == (False, 2)
        device, edge, cloud = decision["hops"]
        assert (device["tier"], device["outcome"], device["target"], device["variant"]) == (
            "device", "unsure", "d1", f"{FAMILY}-small",
        )  # fmt: skip
        assert (device["items"], device["unsure"], device["confidence"], device["threshold"]) == (
            2, 2, 0.5, THRESHOLDS["device"],
        )  # fmt: skip
        assert (edge["tier"], edge["outcome"], edge["unsure"], edge["threshold"]) == (
            "edge", "unsure", 2, THRESHOLDS["edge"],
        )  # fmt: skip
        assert (cloud["tier"], cloud["outcome"], cloud["items"]) == ("cloud", "accepted", 2)


async def test_a_family_kept_on_the_site_records_the_cloud_as_held_back() -> None:
    kept = classifier_family()
    kept.keep_on_site = True
    async with fleet(family=kept) as f:
        _agents(f)
        f.with_cloud()
        decision = _decision(await f.plane.infer(classify([1, 2], explain=True), timeout_s=None))
        assert (decision["final_tier"], decision["degraded"], decision["provisional"]) == ("edge", True, False)
        assert decision["reason"].startswith(f"'{FAMILY}' keeps its inputs on the site")
        assert [hop["tier"] for hop in decision["hops"]] == ["device", "edge", "cloud"]
        cloud = decision["hops"][-1]
        assert (cloud["outcome"], cloud["detail"]) == (
            "held_back", "[privacy] escalate = false: the family's inputs stay on the site",
        )  # fmt: skip


async def test_a_cloud_that_was_down_is_recorded_with_its_state() -> None:
    async with fleet() as f:
        _agents(f)
        f.with_cloud(up=False)
        decision = _decision(await f.plane.infer(classify([1], explain=True), timeout_s=None))
        assert (decision["final_tier"], decision["degraded"]) == ("edge", True)
        assert decision["reason"] != "accepted"
        cloud = decision["hops"][-1]
        assert (cloud["tier"], cloud["outcome"], cloud["detail"]) == ("cloud", "unavailable", "the cloud is down")


async def test_a_cloud_that_does_not_serve_the_family_gets_no_hop() -> None:
    """Not held back and not away: it was never a place this family could go."""
    async with fleet() as f:
        _agents(f)
        f.with_cloud(serves=("other",))
        decision = _decision(await f.plane.infer(classify([1], explain=True), timeout_s=None))
        assert [hop["tier"] for hop in decision["hops"]] == ["device", "edge"]
        assert decision["degraded"] is True
