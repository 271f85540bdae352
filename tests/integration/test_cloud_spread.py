"""Several cloud gateways behind one router: escalations spread over all of them, and one
gateway dying loses nothing while the others are up."""

from __future__ import annotations

import asyncio
import signal
import statistics
from dataclasses import dataclass

import numpy as np

from stratus.serving.channels import open_sync_channel
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import Cluster, fleet_status, ready_count, wait_until
from .test_faults import Outcome, blast, errors_of


def answered_by(gateway: str) -> int:
    """Inferences the gateway itself counted (Triton's ModelStatistics, every model)."""
    with open_sync_channel(gateway) as channel:
        stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            pb.ModelStatisticsRequest(name=""), timeout=5
        )
    return sum(model.inference_count for model in stats.model_stats)


@dataclass(frozen=True)
class Share:
    """What one gateway answered of a blast, as the router's answers say: how many, how fast."""

    gateway: str
    answered: int
    round_trip_ms: float  # the median of the router's cloud time for them


def shares_of(outcomes: list[Outcome]) -> list[Share]:
    by_gateway: dict[str, list[float]] = {}
    for outcome in outcomes:
        assert outcome.served is not None and outcome.served.timings_ms is not None
        by_gateway.setdefault(outcome.served.agent, []).append(outcome.served.timings_ms[Tier.CLOUD])
    return sorted(
        (Share(agent, len(times), statistics.median(times)) for agent, times in by_gateway.items()),
        key=lambda share: share.answered,
    )


def assert_spread(outcomes: list[Outcome], gateways: list[str], *, even_floor: float) -> None:
    """Every gateway took a part, and one that took less than ``even_floor`` of its even share
    was slower than the busiest one. The policy sends each call to the less loaded of two, so
    on a loaded 2-core machine a gateway the scheduler starves of CPU (10 times the round trip
    of the others for a second) rightly takes less; one taking less while as fast is herding."""
    shares = shares_of(outcomes)
    assert sorted(s.gateway for s in shares) == sorted(f"cloud@{g}" for g in gateways), shares
    least, busiest = shares[0], shares[-1]
    even = len(outcomes) / len(gateways)
    assert least.answered >= 0.1 * even, shares  # never left out
    if least.answered < even_floor * even:
        assert least.round_trip_ms > busiest.round_trip_ms, f"herded onto one gateway as fast as the rest: {shares}"


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
    assert_spread(outcomes, [g.address for g in gateways], even_floor=0.6)

    gateways[1].process.send_signal(signal.SIGKILL)
    gateways[1].process.wait()
    wait_until(lambda: fleet_status(router).cloud.state == "2/3 gateways connected")
    alive = [answered_by(gateways[n].address) for n in (0, 2)]
    outcomes = asyncio.run(blast(router, digits.held_out.x, count=200, concurrency=16, min_tier="cloud"))
    assert errors_of(outcomes) == []
    assert not any(o.served is not None and o.served.degraded for o in outcomes)
    after = [answered_by(gateways[n].address) - alive[i] for i, n in enumerate((0, 2))]
    assert sum(after) == 200, after
    assert_spread(outcomes, [gateways[n].address for n in (0, 2)], even_floor=0.4)


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
