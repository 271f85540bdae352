"""Each cloud gateway is a backend of the cloud tier, chosen and retried by the policy that
chooses agents (issue 33 §4): through ``RouterDataPlane.infer``, with a pool of fake gateways.
Thresholds: device 0.8."""

from __future__ import annotations

from collections import Counter

import pytest

from router.cloud.pool import CloudPool
from stratus.errors import Unavailable
from stratus.tiers import Tier

from .fleet_fakes import MARK, CloudBehaviour, FakeCloud, Fleet, classify, confidences, fleet, scores, served

DEVICE, CLOUD = Tier.DEVICE, Tier.CLOUD
BROKE = CloudBehaviour(error=Unavailable("the cloud link broke"))


def gateways(built: Fleet, behaviours: dict[str, CloudBehaviour]) -> dict[str, FakeCloud]:
    """A cloud pool of fake gateways, one per address, as the router's cloud tier (before its
    data plane is built). Adopted as ``start`` would adopt them, without dialling anyone."""
    links = {address: FakeCloud(built.clock, behaviour=behaviour) for address, behaviour in behaviours.items()}
    for address, link in links.items():
        link.address = address
    pool = CloudPool(",".join(links), lambda address, _server_name: links[address])
    pool.links = dict(links)
    built.cloud = pool  # type: ignore[assignment]
    return links


async def test_an_escalation_one_gateway_fails_is_answered_by_another() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5), latency_ms=2.0)
        links = gateways(f, {"a:1": BROKE, "b:2": CloudBehaviour(confidence=0.97)})
        links["b:2"].latency.add(40.0)  # predicted slower than a:1, which is chosen first
        response = await f.plane.infer(classify([3]), timeout_s=None)
        said = served(response)
        assert scores(response) == [MARK[CLOUD] + 3]
        assert (said.tier, said.agent, said.path) == (CLOUD, "cloud@b:2", (DEVICE, CLOUD))
        assert not said.degraded and said.confidence == pytest.approx(0.97)
        assert (len(links["a:1"].asked), len(links["b:2"].asked)) == (1, 1)


async def test_one_call_at_a_time_still_spreads_over_gateways_one_slow_moment_apart() -> None:
    """A gateway's own round trips are refreshed only by the calls it is chosen for: when they
    decided, one slow moment (400 ms here) kept a gateway unchosen for good (CI: 16 of 200
    escalations to one of two). Gateways are told apart by their load, ties either way."""
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5), latency_ms=2.0)
        links = gateways(f, {"slow:1": CloudBehaviour(), "fast:2": CloudBehaviour()})
        links["slow:1"].latency.add(400.0)
        links["fast:2"].latency.add(20.0)
        agents = Counter()
        for _ in range(40):  # one at a time: nothing in flight at any choice
            agents[served(await f.plane.infer(classify([3]), timeout_s=None)).agent] += 1
        assert set(agents) == {"cloud@slow:1", "cloud@fast:2"} and min(agents.values()) >= 10, agents


async def test_the_budget_is_held_against_the_cloud_tiers_round_trip() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5), latency_ms=2.0)
        links = gateways(f, {"a:1": CloudBehaviour(), "b:2": CloudBehaviour()})
        links["a:1"].latency.add(400.0)
        links["b:2"].latency.add(300.0)  # the tier: 350 ms, past a budget of 100
        said = served(await f.plane.infer(classify([3], budget_ms=100.0), timeout_s=None))
        assert said.tier == DEVICE and said.degraded
        assert links["a:1"].asked == [] and links["b:2"].asked == []


async def test_when_every_gateway_fails_the_device_answer_comes_back_degraded() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5), latency_ms=2.0)
        links = gateways(f, {"a:1": BROKE, "b:2": BROKE})
        response = await f.plane.infer(classify([3]), timeout_s=None)
        said = served(response)
        assert scores(response) == [MARK[DEVICE] + 3]
        assert said.tier == DEVICE and said.degraded and "the cloud link broke" in said.reason
        assert (len(links["a:1"].asked), len(links["b:2"].asked)) == (1, 1)  # each tried once
