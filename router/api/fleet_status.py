"""The fleet as operators read it: ``stratus fleet status`` and Watch's FleetStatus (each agent,
tier, family, rollout, the cloud and the site's state, bounded in size), and the gauges
/metrics gives of the same (each agent's state and load, the cloud's, each rollout's).
Built from the registry and its parts as they are; the Fleet service sends them."""

from __future__ import annotations

from prometheus_client.core import Metric

from router.api.family_view import family_statuses
from router.cloud.pool import CloudTier
from router.fleet.agent_handle import AgentHandle, State, shown_state
from router.fleet.registry import FleetRegistry
from router.rollout.judge import ArmWindow
from router.rollout.plan import Plan
from router.rollout.plans import Rollouts
from router.site.mirror import SiteMirror
from stratus import __version__
from stratus.convert.fleet import wire_tier
from stratus.convert.hardware import to_wire as hardware_to_wire
from stratus.families.agent_hello import VariantServed
from stratus.obs.metrics import gauge
from stratus.serving.channels import MAX_MESSAGE_BYTES
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb

_STATES = {
    State.READY: fpb.AGENT_STATE_READY,
    State.DRAINING: fpb.AGENT_STATE_DRAINING,
    State.LOST: fpb.AGENT_STATE_LOST,
    State.LEFT: fpb.AGENT_STATE_LEFT,
}


def agent_status(handle: AgentHandle, now: float) -> fpb.AgentStatus:
    estimates = list(handle.latency.values())
    p50 = max((e.p50_ms for e in estimates), default=0.0)
    p99 = max((e.p99_ms for e in estimates), default=0.0)
    return fpb.AgentStatus(
        id=handle.id,
        tier=wire_tier(handle.tier),
        host=handle.host,
        runtimes=handle.runtimes,
        variants=sorted(handle.variants),
        state=_STATES[shown_state(handle)],
        in_flight=handle.in_flight,
        queue_length=handle.reported_queue,
        p50_ms=p50,
        p99_ms=p99,
        requests_per_s=handle.completions.per_second(),
        last_heartbeat_s=max(0.0, now - handle.last_heartbeat),
        capacity=handle.declared,  # as its Hello said (clamped); the metric shows what it is trusted with
        queue_limit=handle.queue_limit,
        mean_batch_size=handle.batch_sizes.mean,
        variant_choices=[_variant_choice(name, info) for name, info in sorted(handle.variants.items())],
        unavailable=[f"{u.family} ({u.variant}): {u.reason}" for u in handle.unavailable],
        hardware=hardware_to_wire(handle.hardware),
        version=handle.version,
        uptime_s=now - handle.started if handle.started is not None and handle.state != State.LOST else 0.0,
    )


def _variant_choice(name: str, info: VariantServed) -> str:
    """One variant as status shows it: "digits-small-int8 INT8, computes int8 (int8: native (...))"."""
    return (
        f"{name} {info.precision or 'FP32'}"
        + (f", computes {info.compute}" if info.compute else "")
        + (f", kv cache {info.kv_cache}" if info.kv_cache else "")
        + (f" ({info.chosen_because})" if info.chosen_because else "")
        + ("" if info.current or not info.line else "; not current: served when named or in a rollout")
    )


def fleet_levels(registry: FleetRegistry, cloud: CloudTier | None) -> list[Metric]:
    """What Prometheus reads at each scrape: agents by tier and state, each agent's load,
    and the cloud link's breaker (1 for its current state)."""
    states: dict[tuple[str, str], int] = {}
    in_flight, queued, trusted = [], [], []
    for handle in registry.agents.values():
        key = (handle.tier.label, shown_state(handle))
        states[key] = states.get(key, 0) + 1
        if handle.state != State.LOST:
            in_flight.append(([handle.id], float(handle.work.batcher.running_items)))
            queued.append(([handle.id], float(handle.work.batcher.waiting_items)))
            trusted.append(([handle.id], float(handle.capacity)))
    families = [
        gauge("stratus_router_agents", "Agents by tier and state.", ["tier", "state"],
              [([tier, state], float(n)) for (tier, state), n in sorted(states.items())]),
        gauge("stratus_router_agent_in_flight_items", "Items sent to each agent and not answered yet.",
              ["agent"], in_flight),
        gauge("stratus_router_agent_queued_items", "Items waiting in the router for each agent.",
              ["agent"], queued),
        gauge("stratus_router_agent_trusted_capacity", "Calls at once each agent is trusted with: the capacity "
              "its Hello declared, bounded by what it has served within budget.", ["agent"], trusted),
    ]  # fmt: skip
    families.append(calibrated_shares(registry))
    if cloud is not None:
        current = cloud.circuit
        families.append(
            gauge(
                "stratus_router_cloud_breaker",
                "The cloud link's circuit breaker, 1 for its current state (open while the link is down).",
                ["state"],
                [([s], 1.0 if s == current else 0.0) for s in ("closed", "open", "half-open")],
            )
        )
    return families


def calibrated_shares(registry: FleetRegistry) -> Metric:
    """Each family's calibrated cloud share, as its agents' family.toml records it: the
    baseline the cloud-share alert compares the live share with. A family whose thresholds
    were never calibrated has no sample, so no alert."""
    return gauge(
        "stratus_router_family_calibrated_cloud_share",
        "Share of the calibration split that reached the cloud at the family's thresholds "
        "(stratus models calibrate).",
        ["family"],
        [
            ([name], share)
            for name, info in sorted(registry.families.items())
            if (share := info.calibrated_cloud_share) is not None
        ],
    )


def tier_summaries(registry: FleetRegistry) -> list[fpb.TierSummary]:
    """Agents counted by tier and state: what an operator reads first, at any fleet size."""
    summaries: dict[Tier, fpb.TierSummary] = {}
    for handle in registry.agents.values():
        summary = summaries.setdefault(handle.tier, fpb.TierSummary(tier=wire_tier(handle.tier)))
        state = shown_state(handle)
        setattr(summary, state, getattr(summary, state) + 1)
        summary.in_flight += handle.in_flight
        summary.requests_per_s += handle.completions.per_second()
    return [summaries[tier] for tier in sorted(summaries)]


# A status lists agents up to this many bytes: 240 agents of 256 variants each made one of
# 18.8 MB, which no client could receive (over the message limit) and which took the loop
# seconds to build. 2,000 agents of three variants each take about 0.6 MB.
MAX_STATUS_BYTES = MAX_MESSAGE_BYTES * 3 // 4


def _listed_agents(registry: FleetRegistry, max_bytes: int) -> tuple[list[fpb.AgentStatus], int]:
    """Linked agents first, then lost ones, each group by tier and id, up to ``max_bytes``."""
    now = registry.now()
    ordered = sorted(registry.agents.values(), key=lambda h: (h.state == State.LOST, h.tier, h.id))
    listed: list[fpb.AgentStatus] = []
    size = 0
    for count, handle in enumerate(ordered):
        status = agent_status(handle, now)
        size += status.ByteSize() + 8
        if size > max_bytes:
            return listed, len(ordered) - count
        listed.append(status)
    return listed, 0


def cloud_status(cloud: CloudTier | None) -> fpb.CloudStatus:
    """The cloud link as an operator reads it: its state, server, load, round trips, models."""
    if cloud is None:
        return fpb.CloudStatus(state="none")
    return fpb.CloudStatus(
        address=cloud.address,
        state=cloud.status,
        server=cloud.server,
        transport=cloud.transport if cloud.server else "",
        in_flight=cloud.in_flight,
        p50_ms=cloud.latency.percentile(50),
        p99_ms=cloud.latency.percentile(99),
        models=[
            fpb.CloudModel(name=name, sent_as=sent_as, variant=cloud.variants.get(name, sent_as))
            for name, sent_as in sorted(cloud.wire_names.items())
        ],
    )


def fleet_status(
    registry: FleetRegistry,
    cloud: CloudTier | None,
    *,
    include_agents: bool,
    include_families: bool = False,
    rollouts: Rollouts | None = None,
    max_bytes: int | None = None,
    site: SiteMirror | None = None,
) -> fpb.FleetStatus:
    limit = MAX_STATUS_BYTES if max_bytes is None else max_bytes
    agents, omitted = _listed_agents(registry, limit) if include_agents else ([], 0)
    plans = rollouts.plans() if rollouts is not None else []
    return fpb.FleetStatus(
        agents=agents,
        omitted_agents=omitted,
        tiers=tier_summaries(registry),
        cloud=cloud_status(cloud),
        router_version=__version__,
        heartbeat_interval_s=registry.pace_s,
        families=family_statuses(registry, cloud, plans) if include_families else [],
        site_state=site_state_status(site) if site is not None else None,
    )


def site_state_status(site: SiteMirror) -> fpb.SiteStateStatus:
    store = site.state
    return fpb.SiteStateStatus(
        url=store.url, connected=store.connected, detail=store.describe(), judge=site.judge(), routers=site.other_routers()
    )




def arm_stats(variant: str, window: ArmWindow) -> fpb.ArmStats:
    return fpb.ArmStats(
        variant=variant,
        requests=window.requests,
        errors=window.errors,
        p99_ms=window.p99_ms,
        unsure_share=window.unsure_share,
        audited=window.audited,
        agreement=window.agreement,
    )


def rollout_status(rollouts: Rollouts, plan: Plan, current: str) -> fpb.RolloutStatus:
    """One rollout as an operator reads it: where it stands, this router's evidence, history."""
    mine, theirs, shadow_items, shadow_agreed = rollouts.evidence(plan.family, plan.tier)
    return fpb.RolloutStatus(
        family=plan.family,
        tier=wire_tier(plan.tier),
        candidate=plan.candidate,
        state=plan.state,
        share_percent=plan.share,
        step=plan.step,
        steps=plan.steps,
        reason=plan.reason,
        revision=plan.revision,
        current=arm_stats(current, mine),
        candidate_stats=arm_stats(plan.candidate, theirs),
        shadow_requests=shadow_items,
        shadow_agreement=shadow_agreed / shadow_items if shadow_items else 0.0,
        history=plan.history,
        min_requests=plan.min_requests,
        min_audits=plan.min_audits if rollouts.auditable(plan.family, plan.tier) else 0,
    )


def rollout_levels(rollouts: Rollouts) -> list[Metric]:
    """Each rollout's candidate share, labelled with its state (1 sample per rollout)."""
    samples = [([p.family, p.tier.label, p.candidate, p.state], p.share) for p in rollouts.plans()]
    return [
        gauge(
            "stratus_router_rollout_share_percent",
            "Percent of a tier's requests for a family sent to a rollout's candidate, with its state.",
            ["family", "tier", "candidate", "state"],
            samples,
        )
    ]


