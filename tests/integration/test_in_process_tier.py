"""The edge tier served in the router's own process (``--local-tier edge``, issue 37): one hop.

It is one more agent of its tier: the same answers as an edge agent in a process of its own,
listed and drained like one, serving while the remote agents come and go, and its id held
against any remote agent that claims it.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from stratus.convert import codec
from stratus.convert.parameters import Served
from stratus.serving.channels import open_sync_channel
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

from .cluster import MODELS, Cluster, fleet_status, infer, ready_count, states, wait_until
from .expected import BATCH_TOLERANCE, served_for

LOCAL = "router-edge"  # --local-name


def local_tier(cluster: Cluster) -> str:
    router = cluster.router("--models", str(MODELS), "--local-tier", "edge", "--local-name", LOCAL)
    return router.address


def answers(router: str, x: np.ndarray) -> list[tuple[np.ndarray, Served]]:
    """Each row alone, asked to be surer than the device's threshold allows for about a third."""
    out = []
    for row in x:
        response, served = infer(router, row[None, :], min_confidence=0.999)
        out.append((codec.decode_response_outputs(response)["probabilities"][0], served))
    return out


def test_the_router_serves_the_edge_tier_as_an_edge_agent_would_in_a_process_of_its_own(
    tmp_path: Path, digits
) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x[:80]
    with_local = Cluster(tmp_path / "local")
    with_agent = Cluster(tmp_path / "agent")
    try:
        router = local_tier(with_local)
        with_local.agent("dev-1", router)
        wait_until(lambda: ready_count(router) == 2, timeout_s=60)
        local = next(a for a in fleet_status(router).agents if a.id == LOCAL)
        assert local.tier == fpb.TIER_EDGE and local.state == fpb.AGENT_STATE_READY
        assert {served_for("digits-medium").name, served_for("defects-medium").name} <= set(local.variants)
        here = answers(router, x)

        reference = with_agent.router().address
        with_agent.agent("dev-1", reference)
        with_agent.agent("edge-1", reference, tier="edge")
        wait_until(lambda: ready_count(reference) == 2, timeout_s=60)
        there = answers(reference, x)
    finally:
        with_local.stop_all()
        with_agent.stop_all()
    climbed = [served for _, served in here if served.tier == Tier.EDGE]
    assert len(climbed) >= 10, "the test needs items the device is unsure of"
    assert {served.agent for served in climbed} == {LOCAL}
    assert all(served.path == (Tier.DEVICE, Tier.EDGE) for served in climbed)
    tolerance = BATCH_TOLERANCE[served_for("digits-medium").precision]
    for (mine, served_here), (theirs, served_there) in zip(here, there, strict=True):
        assert served_here.tier == served_there.tier and served_here.variant == served_there.variant
        np.testing.assert_allclose(mine, theirs, atol=tolerance, rtol=0)


def test_the_in_process_tier_serves_on_when_remote_agents_go_and_is_drained_like_an_agent(
    tmp_path: Path, digits
) -> None:  # type: ignore[no-untyped-def]
    cluster = Cluster(tmp_path)
    try:
        router = local_tier(cluster)
        device = cluster.agent("dev-1", router)
        wait_until(lambda: ready_count(router) == 2, timeout_s=60)
        device.kill()
        wait_until(lambda: states(router).get("dev-1") == fpb.AGENT_STATE_LOST, timeout_s=15)
        _, served = infer(router, digits.held_out.x[:8])
        assert served.tier == Tier.EDGE and served.agent == LOCAL and not served.degraded

        with open_sync_channel(router) as channel:
            assert fpb_grpc.FleetStub(channel).Drain(fpb.DrainRequest(agent_id=LOCAL), timeout=5).accepted
        assert states(router)[LOCAL] == fpb.AGENT_STATE_DRAINING
        with pytest.raises(grpc.RpcError) as refused:  # no tier is left to answer digits
            infer(router, digits.held_out.x[:8])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with open_sync_channel(router) as channel:
            assert fpb_grpc.FleetStub(channel).Undrain(fpb.DrainRequest(agent_id=LOCAL), timeout=5).accepted
        _, served = infer(router, digits.held_out.x[:8])
        assert served.agent == LOCAL
        with open_sync_channel(router) as channel:  # an operator's Reload reaches it as any agent's
            reloaded = fpb_grpc.FleetStub(channel).Reload(fpb.ReloadRequest(agent_id=LOCAL, timeout_s=60), timeout=70)
        assert reloaded.ok and served_for("digits-medium").name in reloaded.variants
        assert cluster.latest("router").stop() == 0
    finally:
        cluster.stop_all()


def test_no_remote_agent_takes_the_in_process_tier_s_id(tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    cluster = Cluster(tmp_path)
    try:
        router = local_tier(cluster)
        impostor = cluster.agent(LOCAL, router, tier="edge")
        wait_until(lambda: "is linked by another identity" in impostor.log(), timeout_s=60)
        assert states(router) == {LOCAL: fpb.AGENT_STATE_READY}
        _, served = infer(router, digits.held_out.x[:4])
        assert served.agent == LOCAL
    finally:
        cluster.stop_all()
