"""Never silently wrong (issue 21 §2): an unsure answer that could not climb says why."""

from __future__ import annotations

import subprocess
import sys

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


def test_an_operator_takes_a_drain_back_and_forgets_what_left(cluster: Cluster) -> None:
    router = cluster.router().address
    staying, leaving = cluster.agent("dev-1", router), cluster.agent("dev-2", router)
    wait_until(lambda: ready_count(router) == 2, timeout_s=30)

    def fleet(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "stratus.cli", "fleet", *args, "--router", router],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    refused = fleet("undrain", "dev-1")  # not drained: nothing to take back
    assert refused.returncode == 2 and "FAILED_PRECONDITION: agent dev-1 is ready" in refused.stderr
    assert fleet("drain", "dev-1").returncode == 0
    wait_until(lambda: ready_count(router) == 1)
    undrained = fleet("undrain", "dev-1")
    assert undrained.returncode == 0 and "agent dev-1 is ready again" in undrained.stdout
    wait_until(lambda: ready_count(router) == 2)
    assert leaving.stop() == 0
    wait_until(lambda: {a.id: a.state for a in fleet_status(router).agents}.get("dev-2") == fpb.AGENT_STATE_LEFT)
    assert "only a lost or left agent is forgotten" in fleet("forget", "dev-1").stderr  # still linked
    assert fleet("forget", "dev-2").returncode == 0
    assert [a.id for a in fleet_status(router).agents] == ["dev-1"]
    assert staying.process.poll() is None
