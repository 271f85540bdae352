"""Several cloud gateways behind one router: escalations spread over all of them, and one
gateway dying loses nothing while the others are up."""

from __future__ import annotations

import asyncio
import signal

import numpy as np

from stratus.serving.channels import open_sync_channel
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import Cluster, fleet_status, ready_count, wait_until
from .test_faults import blast, errors_of


def answered_by(gateway: str) -> int:
    """Inferences the gateway itself counted (Triton's ModelStatistics, every model)."""
    with open_sync_channel(gateway) as channel:
        stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            pb.ModelStatisticsRequest(name=""), timeout=5
        )
    return sum(model.inference_count for model in stats.model_stats)


def test_escalations_spread_over_three_gateways_and_survive_one_dying(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    gateways = [cluster.cloud(role=f"cloud-{n}") for n in range(3)]
    router = cluster.router("--cloud", ",".join(g.address for g in gateways)).address
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1 and fleet_status(router).cloud.state == "connected")
    before = [answered_by(g.address) for g in gateways]

    outcomes = asyncio.run(blast(router, digits.held_out.x, count=600, concurrency=16, min_tier="cloud"))
    assert errors_of(outcomes) == []
    assert all(o.served is not None and o.served.tier is Tier.CLOUD for o in outcomes)
    shares = np.array([answered_by(g.address) for g in gateways]) - np.array(before)
    assert shares.sum() == 600, shares  # every escalation reached exactly one gateway
    assert shares.min() >= 120, f"one gateway got {shares.min()} of 600 (even: 200): {shares}"

    gateways[1].process.send_signal(signal.SIGKILL)
    gateways[1].process.wait()
    wait_until(lambda: fleet_status(router).cloud.state == "2/3 gateways connected")
    alive = [answered_by(gateways[n].address) for n in (0, 2)]
    outcomes = asyncio.run(blast(router, digits.held_out.x, count=200, concurrency=16, min_tier="cloud"))
    assert errors_of(outcomes) == []
    assert not any(o.served is not None and o.served.degraded for o in outcomes)
    after = [answered_by(gateways[n].address) - alive[i] for i, n in enumerate((0, 2))]
    assert sum(after) == 200 and min(after) >= 40, after


def test_a_dns_name_is_every_address_it_resolves_to(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    """``localhost`` resolves to 127.0.0.1 (and ::1 where the host lists it); the gateway
    listens on 127.0.0.1 only, so an IPv6 link, if any, stays down and takes no call."""
    gateway = cluster.cloud()
    port = gateway.address.rpartition(":")[2]
    router = cluster.router("--cloud", f"dns:///localhost:{port}").address
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1 and fleet_status(router).cloud.state.startswith(("connected", "1/")))
    outcomes = asyncio.run(blast(router, digits.held_out.x, count=40, concurrency=4, min_tier="cloud"))
    assert errors_of(outcomes) == []
    assert all(o.served is not None and o.served.tier is Tier.CLOUD for o in outcomes)
