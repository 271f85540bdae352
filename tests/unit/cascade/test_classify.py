"""How a classifier request climbs the tiers, through ``RouterDataPlane.infer``.

Characterization: each test pins what the router does today (where it answers, which
items climb, what it says and counts), so that moving the climb out of the data plane
(issue 19) shows any change of behaviour. Thresholds: device 0.8, edge 0.7.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from stratus.errors import DeadlineExceeded, NotFound, Overloaded, Unavailable
from stratus.tiers import Tier

from .fleet_fakes import (
    FAMILY,
    MARK,
    Fleet,
    classifier_family,
    classify,
    confidences,
    fill,
    fleet,
    release,
    scores,
    served,
)

DEVICE, EDGE, CLOUD = Tier.DEVICE, Tier.EDGE, Tier.CLOUD


@contextlib.asynccontextmanager
async def three_tiers(
    device: float = 0.99, edge: float = 0.99, cloud: float = 0.99, **settings: object
) -> AsyncIterator[Fleet]:
    """One device agent, one edge agent and a cloud, each as sure of every item as told."""
    async with fleet(**settings) as built:
        built.agent("d1", DEVICE, confidence=confidences({}, device), latency_ms=2.0)
        built.agent("e1", EDGE, confidence=confidences({}, edge), latency_ms=3.0)
        built.with_cloud(confidence=cloud)
        yield built


# -- where an answer comes from ----------------------------------------------------------------


async def test_a_sure_device_answer_is_the_answer() -> None:
    async with three_tiers() as f:
        response = await f.plane.infer(classify([7]), timeout_s=None)
        said = served(response)
        assert scores(response) == [MARK[DEVICE] + 7]
        assert (said.tier, said.agent, said.variant, said.path) == (DEVICE, "d1", "toy-small", (DEVICE,))
        assert not said.degraded and said.confidence == pytest.approx(0.99)
        assert f.agents[1].works == [] and f.cloud is not None and f.cloud.asked == []
        assert f.count("requests", family=FAMILY, tier="device", outcome="ok") == 1


async def test_an_unsure_item_climbs_device_edge_cloud_and_each_tier_is_timed() -> None:
    async with three_tiers(device=0.5, edge=0.5, cloud=0.95) as f:
        response = await f.plane.infer(classify([4]), timeout_s=None)
        said = served(response)
        assert scores(response) == [MARK[CLOUD] + 4]
        assert (said.tier, said.agent, said.variant) == (CLOUD, "cloud@cloud.test:8001", "toy-large")
        assert said.path == (DEVICE, EDGE, CLOUD) and not said.degraded
        assert said.confidence == pytest.approx(0.95)
        assert said.timings_ms == {DEVICE: 2.0, EDGE: 3.0, CLOUD: 5.0}  # the latencies the fakes took
        assert f.climbs(DEVICE, EDGE, "unsure") == 1
        assert f.climbs(EDGE, CLOUD, "unsure") == 1
        assert f.count("requests", family=FAMILY, tier="cloud", outcome="ok") == 1


async def test_each_item_of_a_batch_climbs_alone_and_comes_back_in_order() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({1: 0.9}, 0.5))
        edge = f.agent("e1", EDGE, confidence=confidences({2: 0.9}, 0.1))
        cloud = f.with_cloud(confidence=0.99)
        response = await f.plane.infer(classify([1, 2, 3]), timeout_s=None)
        said = served(response)
        assert scores(response) == [MARK[DEVICE] + 1, MARK[EDGE] + 2, MARK[CLOUD] + 3]
        assert said.item_tiers == (DEVICE, EDGE, CLOUD) and said.tier == CLOUD
        assert edge.keys_seen == [[2, 3]] and cloud.keys_seen == [[3]]  # only the unsure went on
        assert said.confidence == pytest.approx(0.9)  # the least sure item, where it settled


async def test_an_item_at_its_tiers_threshold_settles_there() -> None:
    async with three_tiers(device=0.8) as f:
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert said.path == (DEVICE,)


async def test_each_tier_judges_by_its_own_threshold() -> None:
    """0.75 is below the device's 0.8 and above the edge's 0.7."""
    async with three_tiers(device=0.75, edge=0.75) as f:
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert said.path == (DEVICE, EDGE) and said.tier == EDGE and not said.degraded


async def test_the_clients_min_confidence_replaces_every_threshold() -> None:
    async with three_tiers(device=0.9, edge=0.9, cloud=0.9) as f:
        said = served(await f.plane.infer(classify([1], min_confidence=0.95), timeout_s=None))
        assert said.path == (DEVICE, EDGE, CLOUD)
        # the cloud is the top: its answer is final, never degraded for being under the bar
        assert not said.degraded and said.reason == ""


async def test_the_clients_min_confidence_may_lower_a_threshold_too() -> None:
    """0.6 is under every tier's 0.8/0.7 but meets the client's 0.5: the device answers."""
    async with three_tiers(device=0.6, edge=0.6) as f:
        said = served(await f.plane.infer(classify([1], min_confidence=0.5), timeout_s=None))
        assert (said.path, said.degraded) == ((DEVICE,), False)
        assert f.agents[1].works == []
        without = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert without.path == (DEVICE, EDGE, CLOUD)  # the family's own thresholds send it up


# -- budget and failures ---------------------------------------------------------------------------


async def test_a_tier_too_slow_for_the_budget_is_skipped_and_counted() -> None:
    async with three_tiers() as f:
        device = f.agents[0]
        device.heartbeat(mean_ms=50.0)
        said = served(await f.plane.infer(classify([1], budget_ms=20.0), timeout_s=None))
        assert said.path == (EDGE,) and device.works == []
        assert f.climbs(DEVICE, EDGE, "too_slow") == 1


async def test_a_failed_agent_is_retried_on_another_agent_of_its_tier() -> None:
    async with fleet() as f:
        failing = f.agent("d1", DEVICE, error=grpc.StatusCode.UNAVAILABLE)
        f.agent("d2", DEVICE)
        edge = f.agent("e1", EDGE)
        failing.heartbeat(mean_ms=1.0)  # predicted faster: chosen first
        f.agents[1].heartbeat(mean_ms=2.0)
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert len(failing.works) == 1 and edge.works == []
        assert (said.agent, said.path) == ("d2", (DEVICE,))


async def test_a_failure_on_the_only_agent_of_a_tier_climbs_and_is_counted() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, error=grpc.StatusCode.RESOURCE_EXHAUSTED)
        f.agent("e1", EDGE)
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert (said.agent, said.path, said.degraded) == ("e1", (EDGE,), False)
        assert f.climbs(DEVICE, EDGE, "failed") == 1


async def test_an_agent_lost_with_the_work_fails_over_to_the_next_tier() -> None:
    async with fleet() as f:
        lost = f.agent("d1", DEVICE, drop=True)
        f.agent("e1", EDGE)
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert said.path == (EDGE,) and len(lost.works) == 1
        assert f.registry.agents["d1"].state == "lost"


async def test_an_error_that_is_not_retryable_reaches_the_client() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, error=grpc.StatusCode.INVALID_ARGUMENT)
        edge = f.agent("e1", EDGE)
        with pytest.raises(Exception, match="d1 failed as told") as raised:
            await f.plane.infer(classify([1]), timeout_s=None)
        assert type(raised.value).__name__ == "InvalidInput" and edge.works == []
        assert f.count("refusals", reason="invalid_argument") == 1


# -- the cloud ---------------------------------------------------------------------------------------


async def test_a_cloud_that_is_down_leaves_a_degraded_answer_from_below() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5))
        f.agent("e1", EDGE, confidence=confidences({}, 0.5))
        cloud = f.with_cloud(up=False)
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        # why it stayed below is said, not only counted: the cloud is listed but not ready
        why = f"1 item(s) below the edge threshold got no answer from a tier above: the cloud tier serving '{FAMILY}' is not ready now"
        assert (said.tier, said.path, said.degraded, said.reason) == (EDGE, (DEVICE, EDGE), True, why)
        assert cloud.asked == []
        assert f.count("degraded_answers", family=FAMILY, reason="unavailable") == 1
        assert f.count("requests", family=FAMILY, tier="edge", outcome="degraded") == 1


async def test_a_cloud_call_that_fails_leaves_a_degraded_answer_from_below() -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5))
        cloud = f.with_cloud(error=Unavailable("cloud is away"))
        said = served(await f.plane.infer(classify([1]), timeout_s=None))
        assert (said.tier, said.path, said.degraded) == (DEVICE, (DEVICE,), True)
        assert len(cloud.asked) == 1
        assert f.climbs(DEVICE, CLOUD, "unsure") == 1
        assert f.count("degraded_answers", family=FAMILY, reason="unavailable") == 1


async def test_on_cloud_failure_fail_refuses_instead_of_degrading() -> None:
    async with fleet(fail_without_cloud=True) as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5))
        f.with_cloud(up=False)
        with pytest.raises(
            Unavailable,
            match=r"the cloud is unavailable \(down\) and the router runs with "
            r"--on-cloud-failure fail; 1 item\(s\) were still unsure",
        ):
            await f.plane.infer(classify([1]), timeout_s=None)
        assert f.count("refusals", reason="unavailable") == 1
        assert f.count("requests", family=FAMILY, tier="none", outcome="unavailable") == 1


@pytest.mark.parametrize("cloud_serves", [True, False], ids=["max_tier=edge", "cloud lacks family"])
async def test_on_cloud_failure_fail_degrades_where_the_cloud_was_not_the_way_up(cloud_serves: bool) -> None:
    """An unsure device answer whose edge is full: the client forbade the cloud, or the cloud
    does not serve the family, so its being away is not why the climb stopped."""
    async with fleet(fail_without_cloud=True) as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5))
        edge = f.agent("e1", EDGE, capacity=1, queue_limit=0, max_batch=1, hold_after=0)
        f.with_cloud(up=False, serves=(FAMILY,) if cloud_serves else ())
        holder = await fill(edge, f.plane.infer(classify([9], model="toy-medium"), timeout_s=None))
        asked = classify([1], max_tier=EDGE if cloud_serves else CLOUD)
        said = served(await f.plane.infer(asked, timeout_s=None))
        assert (said.tier, said.path, said.degraded) == (DEVICE, (DEVICE,), True)
        assert f.count("degraded_answers", family=FAMILY, reason="overloaded") == 1
        await release(holder)


# -- what the client asks for --------------------------------------------------------------------------


async def test_max_tier_keeps_unsure_items_below_and_says_so() -> None:
    async with three_tiers(device=0.5, edge=0.5) as f:
        said = served(await f.plane.infer(classify([1, 2], max_tier=EDGE), timeout_s=None))
        assert (said.tier, said.path, said.degraded) == (EDGE, (DEVICE, EDGE), False)
        assert said.reason == "stratus.max_tier=edge: 2 item(s) below the edge threshold were not sent higher"
        assert f.cloud is not None and f.cloud.asked == []


async def test_max_tier_device_answers_on_the_device_however_unsure() -> None:
    async with three_tiers(device=0.1) as f:
        said = served(await f.plane.infer(classify([1], max_tier=DEVICE), timeout_s=None))
        assert (said.tier, said.path, said.degraded) == (DEVICE, (DEVICE,), False)
        assert f.agents[1].works == []


async def test_min_tier_starts_above_the_device_without_counting_a_climb() -> None:
    async with three_tiers() as f:
        said = served(await f.plane.infer(classify([1], min_tier=EDGE), timeout_s=None))
        assert said.path == (EDGE,) and f.agents[0].works == []
        assert f.climbs(DEVICE, EDGE, "too_slow") == 0


async def test_a_pinned_variant_runs_there_alone_however_unsure() -> None:
    async with three_tiers(device=0.1, edge=0.1) as f:
        response = await f.plane.infer(classify([1]), timeout_s=None)
        pinned = await f.plane.infer(classify([1], model="toy-medium"), timeout_s=None)
        said = served(pinned)
        assert (said.tier, said.variant, said.path, said.degraded) == (EDGE, "toy-medium", (EDGE,), False)
        assert scores(pinned) == [MARK[EDGE] + 1] and pinned.model_name == "toy-medium"
        assert served(response).path == (DEVICE, EDGE, CLOUD)  # the family, unpinned, climbs
        assert f.cloud is not None and len(f.cloud.asked) == 1


# -- nowhere higher ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", [None, "serves other families"])
async def test_no_tier_above_leaves_a_degraded_answer_with_the_reason(cloud: str | None) -> None:
    async with fleet() as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5))
        f.agent("e1", EDGE, confidence=confidences({1: 0.9}, 0.5))
        if cloud is not None:
            f.with_cloud(serves=("other",))
        said = served(await f.plane.infer(classify([1, 2]), timeout_s=None))
        assert (said.tier, said.item_tiers, said.degraded) == (EDGE, (EDGE, EDGE), True)
        assert said.reason == "no tier above edge serves 'toy': 1 item(s) stayed below the edge threshold"
        assert f.count("degraded_answers", family=FAMILY, reason="no_higher_tier") == 1


async def test_a_family_kept_on_the_site_stops_below_a_cloud_that_serves_it_and_says_why() -> None:
    """[privacy] escalate = false: the cloud serves the family but is never sent its items; the
    answer is degraded (nowhere higher could be asked), with the privacy rule as its reason."""
    kept = classifier_family()
    kept.keep_on_site = True
    async with fleet(family=kept) as f:
        f.agent("d1", DEVICE, confidence=confidences({}, 0.5))
        f.agent("e1", EDGE, confidence=confidences({1: 0.9}, 0.5))
        cloud = f.with_cloud()
        said = served(await f.plane.infer(classify([1, 2]), timeout_s=None))
        assert (said.tier, said.item_tiers, said.degraded) == (EDGE, (EDGE, EDGE), True)
        assert said.reason == (
            "'toy' keeps its inputs on the site ([privacy] escalate = false): 1 item(s) stayed below "
            "the edge threshold"
        )
        assert cloud.asked == []
        assert f.count("degraded_answers", family=FAMILY, reason="no_higher_tier") == 1


async def test_a_budget_no_tier_can_meet_is_refused_as_deadline_exceeded() -> None:
    async with fleet() as f:
        for agent in (f.agent("d1", DEVICE), f.agent("e1", EDGE)):
            agent.heartbeat(mean_ms=50.0)
        with pytest.raises(DeadlineExceeded, match=r"no tier can answer 'toy' within 10\.0 ms"):
            await f.plane.infer(classify([1], budget_ms=10.0), timeout_s=None)
        assert f.count("refusals", reason="deadline_exceeded") == 1


async def test_every_agent_full_is_refused_as_overloaded() -> None:
    async with fleet() as f:
        device = f.agent("d1", DEVICE, capacity=1, queue_limit=0, max_batch=1, hold_after=0)
        holder = await fill(device, f.plane.infer(classify([9]), timeout_s=None))
        with pytest.raises(Overloaded, match="every device agent serving 'toy' has a full work queue"):
            await f.plane.infer(classify([1]), timeout_s=None)
        await release(holder)
        assert device.cancels == [device.works[0].request_id]  # the held Work was called off


async def test_an_unknown_model_is_not_found() -> None:
    async with three_tiers() as f:
        with pytest.raises(
            NotFound, match=r"unknown model 'nope'; the fleet serves \[toy, toy-medium, toy-small\]"
        ):
            await f.plane.infer(classify([1], model="nope"), timeout_s=None)
        assert f.count("requests", family="unknown", tier="none", outcome="not_found") == 1


async def test_past_max_requests_the_router_refuses_at_once() -> None:
    async with fleet(max_requests=0) as f:
        device = f.agent("d1", DEVICE)
        with pytest.raises(Overloaded, match="router request queue is full: 0 requests in flight"):
            await f.plane.infer(classify([1]), timeout_s=None)
        assert device.works == []
