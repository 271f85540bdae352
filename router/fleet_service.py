"""The Fleet service: status for operators, a stream of changes, and Drain."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client.core import Metric

from router.cloud import CloudLink
from router.registry import AgentHandle, FleetRegistry, State
from stratus import __version__
from stratus.errors import Unauthenticated
from stratus.metrics import gauge
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

_STATES = {
    State.READY: fpb.AGENT_STATE_READY,
    State.DRAINING: fpb.AGENT_STATE_DRAINING,
    State.LOST: fpb.AGENT_STATE_LOST,
}
_TIERS = {1: fpb.TIER_DEVICE, 2: fpb.TIER_EDGE, 3: fpb.TIER_CLOUD}


def agent_status(handle: AgentHandle, now: float) -> fpb.AgentStatus:
    estimates = list(handle.latency.values())
    p50 = max((e.p50_ms for e in estimates), default=0.0)
    p99 = max((e.p99_ms for e in estimates), default=0.0)
    return fpb.AgentStatus(
        id=handle.id,
        tier=_TIERS[int(handle.tier)],
        host=handle.host,
        runtimes=handle.runtimes,
        variants=sorted(handle.variants),
        state=_STATES[handle.state],
        in_flight=handle.in_flight,
        queue_length=handle.reported_queue,
        p50_ms=p50,
        p99_ms=p99,
        requests_per_s=handle.completions.per_second(),
        last_heartbeat_s=max(0.0, now - handle.last_heartbeat),
        capacity=handle.capacity,
        queue_limit=handle.queue_limit,
        mean_batch_size=handle.batch_sizes.mean,
        variant_choices=[
            f"{name} {info.precision or 'FP32'}"
            + (f" ({info.chosen_because})" if info.chosen_because else "")
            for name, info in sorted(handle.variants.items())
        ],
    )


def fleet_levels(registry: FleetRegistry, cloud: CloudLink | None) -> list[Metric]:
    """What Prometheus reads at each scrape: agents by tier and state, each agent's load,
    and the cloud link's breaker (1 for its current state)."""
    states: dict[tuple[str, str], int] = {}
    in_flight, queued = [], []
    for handle in registry.agents.values():
        key = (handle.tier.label, handle.state)
        states[key] = states.get(key, 0) + 1
        if handle.state != State.LOST and handle.batcher is not None:
            in_flight.append(([handle.id], float(handle.batcher.running_items)))
            queued.append(([handle.id], float(handle.batcher.waiting_items)))
    families = [
        gauge("stratus_router_agents", "Agents by tier and state.", ["tier", "state"],
              [([tier, state], float(n)) for (tier, state), n in sorted(states.items())]),
        gauge("stratus_router_agent_in_flight_items", "Items sent to each agent and not answered yet.",
              ["agent"], in_flight),
        gauge("stratus_router_agent_queued_items", "Items waiting in the router for each agent.",
              ["agent"], queued),
    ]  # fmt: skip
    if cloud is not None:
        # A link that is down refuses escalations at once, as an open breaker does.
        current = cloud.breaker.state if cloud.state == "connected" else "open"
        families.append(
            gauge(
                "stratus_router_cloud_breaker",
                "The cloud link's circuit breaker, 1 for its current state (open while the link is down).",
                ["state"],
                [([s], 1.0 if s == current else 0.0) for s in ("closed", "open", "half-open")],
            )
        )
    return families


def tier_summaries(registry: FleetRegistry) -> list[fpb.TierSummary]:
    """Agents counted by tier and state: what an operator reads first, at any fleet size."""
    summaries: dict[Tier, fpb.TierSummary] = {}
    for handle in registry.agents.values():
        summary = summaries.setdefault(handle.tier, fpb.TierSummary(tier=_TIERS[int(handle.tier)]))
        setattr(summary, handle.state, getattr(summary, handle.state) + 1)
        summary.in_flight += handle.in_flight
        summary.requests_per_s += handle.completions.per_second()
    return [summaries[tier] for tier in sorted(summaries)]


def fleet_status(
    registry: FleetRegistry, cloud: CloudLink | None, *, include_agents: bool
) -> fpb.FleetStatus:
    now = registry.now()
    agents = (
        [agent_status(h, now) for h in sorted(registry.agents.values(), key=lambda h: (h.tier, h.id))]
        if include_agents
        else []
    )
    return fpb.FleetStatus(
        agents=agents,
        tiers=tier_summaries(registry),
        cloud=fpb.CloudStatus(address=cloud.address, state=cloud.status)
        if cloud
        else fpb.CloudStatus(state="none"),
        router_version=__version__,
        heartbeat_interval_s=registry.pace_s,
    )


# A watcher gets at most this many updates a second, however fast the fleet changes (a
# thousand agents rejoining after a restart would otherwise mean a thousand statuses).
WATCH_MIN_GAP_S = 0.5


class FleetServicer(fpb_grpc.FleetServicer):
    def __init__(self, registry: FleetRegistry, cloud: CloudLink | None, *, token: str = "") -> None:
        self._registry = registry
        self._cloud = cloud
        self._token = token

    async def Status(self, request: fpb.FleetStatusRequest, context: Any) -> fpb.FleetStatus:
        return fleet_status(self._registry, self._cloud, include_agents=request.include_agents)

    async def Watch(self, request: fpb.FleetWatchRequest, context: Any) -> AsyncIterator[fpb.FleetEvent]:
        """A status now, then one on every change (at most every WATCH_MIN_GAP_S, changes in
        between folded into one), and at least every heartbeat interval."""
        changes = self._registry.watch()
        try:
            while True:
                status = fleet_status(self._registry, self._cloud, include_agents=request.include_agents)
                yield fpb.FleetEvent(status=status)
                await asyncio.sleep(WATCH_MIN_GAP_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changes.get(), timeout=self._registry.heartbeat_s)
        finally:
            self._registry.unwatch(changes)

    async def Drain(self, request: fpb.DrainRequest, context: Any) -> fpb.DrainResponse:
        if self._token and not hmac.compare_digest(request.token.encode(), self._token.encode()):
            raise Unauthenticated("Drain needs the fleet token")
        handle = self._registry.drain(request.agent_id)
        return fpb.DrainResponse(accepted=True, message=f"agent {handle.id} is draining")
