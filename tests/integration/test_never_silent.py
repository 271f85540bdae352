"""Never silently wrong (issue 21 §2): an unsure answer that could not climb says why."""

from __future__ import annotations

from stratus.wire import fleet_pb2 as fpb

from .cluster import Cluster, fleet_status, infer, ready_count, wait_until


def test_no_tier_above_makes_an_unsure_answer_degraded_and_says_why(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router()  # no cloud, no edge: nothing above the device serves digits
    cluster.agent("dev-1", router.address)
    wait_until(lambda: ready_count(router.address) == 1, timeout_s=30)
    _, unsure = infer(router.address, digits.held_out.x[:3], min_confidence=1.0)
    assert unsure.degraded and unsure.path == (unsure.tier,)
    assert unsure.reason == "no tier above device serves 'digits': 3 item(s) stayed below the device threshold"
    wait_until(lambda: "digits: unsure answers are degraded (no tier above device serves it" in router.log())
    _, sure = infer(router.address, digits.held_out.x[:3], min_confidence=0.0)
    assert not sure.degraded and sure.reason == ""


def test_max_tier_keeping_unsure_items_is_said_not_degraded(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    _, kept = infer(router, digits.held_out.x[:2], min_confidence=1.0, max_tier="device")
    assert not kept.degraded
    assert kept.reason == "stratus.max_tier=device: 2 item(s) below the device threshold were not sent higher"
    _, climbed = infer(router, digits.held_out.x[:2], min_confidence=1.0)
    assert climbed.reason == "" and not climbed.degraded  # the cloud answered: final, and sure


def test_an_agent_that_said_goodbye_has_left_one_that_vanished_is_lost(cluster: Cluster) -> None:
    router = cluster.router()
    leaving, vanishing = cluster.agent("dev-1", router.address), cluster.agent("dev-2", router.address)
    wait_until(lambda: ready_count(router.address) == 2, timeout_s=30)
    assert leaving.stop() == 0  # SIGTERM: it drains, says so, then closes its link
    vanishing.kill()  # SIGKILL: nothing said
    wait_until(lambda: {a.id: a.state for a in fleet_status(router.address).agents}
               == {"dev-1": fpb.AGENT_STATE_LEFT, "dev-2": fpb.AGENT_STATE_LOST})  # fmt: skip
    (device,) = fleet_status(router.address).tiers
    assert (device.left, device.lost, device.ready) == (1, 1, 0)
    assert "agent dev-1 left (it drained first)" in router.log()
