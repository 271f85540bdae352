"""How a router's fleet reads for its operator: its status, families, cloud and rollouts as JSON
(``--json``, for scripts) and as tables (for people), cut to the terminal's width."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stratus.convert.fleet import tier_label
from stratus.convert.hardware import describe as describe_hardware
from stratus.wire import fleet_pb2 as fpb

_STATE = {
    fpb.AGENT_STATE_READY: "ready",
    fpb.AGENT_STATE_DRAINING: "draining",
    fpb.AGENT_STATE_LOST: "lost",
    fpb.AGENT_STATE_LEFT: "left",
}


def status_json(status: fpb.FleetStatus) -> dict[str, Any]:
    return {
        "tiers": [
            {
                "tier": tier_label(t.tier),
                "ready": t.ready,
                "draining": t.draining,
                "lost": t.lost,
                "left": t.left,
                "in_flight": t.in_flight,
                "requests_per_s": round(t.requests_per_s, 2),
            }
            for t in status.tiers
        ],
        "agents": [
            {
                "id": a.id,
                "tier": tier_label(a.tier),
                "host": a.host,
                "hardware": {
                    "machine": a.hardware.machine,
                    "cpu_model": a.hardware.cpu_model,
                    "flags": list(a.hardware.flags),
                    "flags_from": a.hardware.flags_from,
                    "precisions": list(a.hardware.precisions),
                },
                "runtimes": list(a.runtimes),
                "state": _STATE.get(a.state, "unknown"),
                "variants": list(a.variants),
                "in_flight": a.in_flight,
                "capacity": a.capacity,
                "queue_limit": a.queue_limit,
                "latency_ms": {"p50": round(a.p50_ms, 3), "p99": round(a.p99_ms, 3)},
                "requests_per_s": round(a.requests_per_s, 2),
                "mean_batch_size": round(a.mean_batch_size, 2),
                "variant_choices": list(a.variant_choices),
                "unavailable": list(a.unavailable),
                "last_heartbeat_s": round(a.last_heartbeat_s, 2),
                "version": a.version or None,  # None: an agent too old to say
                "uptime_s": round(a.uptime_s, 1) if a.uptime_s > 0 else None,
            }
            for a in status.agents
        ],
        "omitted_agents": status.omitted_agents,
        "cloud": cloud_json(status.cloud),
        "families": [family_json(f) for f in status.families],
        "heartbeat_interval_s": status.heartbeat_interval_s,
        "site_state": (
            {
                "url": status.site_state.url,
                "connected": status.site_state.connected,
                "detail": status.site_state.detail,
                "judge": status.site_state.judge,
                "routers": list(status.site_state.routers),
            }
            if status.HasField("site_state")
            else None
        ),
    }


def cloud_json(cloud: fpb.CloudStatus) -> dict[str, Any]:
    return {
        "address": cloud.address,
        "state": cloud.state,
        "server": cloud.server or None,
        "transport": cloud.transport or None,
        "in_flight": cloud.in_flight,
        "latency_ms": {"p50": round(cloud.p50_ms, 3), "p99": round(cloud.p99_ms, 3)},
        "models": [{"name": m.name, "sent_as": m.sent_as, "variant": m.variant} for m in cloud.models],
    }


def family_json(family: fpb.FamilyStatus) -> dict[str, Any]:
    return {
        "name": family.name,
        "kind": family.kind or "classifier",
        "state": family.state,
        "reason": family.reason,
        "tiers": [
            {
                "tier": tier_label(t.tier),
                "threshold": t.threshold if t.HasField("threshold") else None,
                "current": list(t.current),
                "ready": t.ready,
                "listed": t.listed,
                "rollout": {
                    "candidate": t.candidate,
                    "share_percent": t.candidate_percent,
                    "state": t.rollout_state,
                }
                if t.candidate
                else None,
            }
            for t in family.tiers
        ],
    }


def fit(text: str, width: int) -> str:
    """``text`` in ``width`` characters, an ellipsis saying where it was cut."""
    return text if len(text) <= width else text[: width - 1] + "…"


def _number(value: float, spec: str, known: bool) -> str:
    return format(value, spec) if known else "-"


def duration(seconds: float | None) -> str:
    """An uptime in its two largest units ("3d04h", "2h05m", "5m03s", "42s"); "-" unknown."""
    if seconds is None:
        return "-"
    whole = int(seconds)
    days, hours, minutes, secs = whole // 86400, whole // 3600 % 24, whole // 60 % 60, whole % 60
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def agents_table(status: fpb.FleetStatus) -> list[str]:
    header = (
        f"{'id':<22}{'tier':<8}{'host':<14}{'arch':<9}{'runtimes':<22}{'variants':<28}{'state':<10}"
        f"{'version':<10}{'up':>7}"
        f"{'inflight':>9}{'batch':>7}{'p50 ms':>8}{'p99 ms':>8}{'req/s':>8}{'hb s':>6}"
    )
    lines = [header, "-" * len(header)]
    for a in status_json(status)["agents"]:
        served = a["requests_per_s"] > 0 or a["latency_ms"]["p50"] > 0  # no data yet: "-", not 0.00
        lines.append(
            f"{fit(a['id'], 21):<22}{a['tier']:<8}{fit(a['host'], 13):<14}{fit(a['hardware']['machine'], 8) or '-':<9}"
            f"{fit(','.join(a['runtimes']), 21):<22}"
            f"{fit(','.join(a['variants']), 27):<28}{a['state']:<10}"
            f"{fit(a['version'] or '-', 9):<10}{duration(a['uptime_s']):>7}{a['in_flight']:>9}"
            f"{_number(a['mean_batch_size'], '.1f', served):>7}{_number(a['latency_ms']['p50'], '.2f', served):>8}"
            f"{_number(a['latency_ms']['p99'], '.2f', served):>8}{_number(a['requests_per_s'], '.1f', served):>8}"
            f"{a['last_heartbeat_s']:>6.1f}"
        )
    lines.append("")
    agents = status_json(status)["agents"]
    lines += [f"{a.id}: runs on {describe_hardware(a.hardware)}" for a in status.agents if a.hardware.machine]
    lines += [f"{a['id']}: {choice}" for a in agents for choice in a["variant_choices"]]
    lines += [f"{a['id']}: not serving {why}" for a in agents for why in a["unavailable"]]
    lines.append("")
    return lines


def status_table(status: fpb.FleetStatus) -> str:
    """The summary by tier and state; each agent too when the status lists them."""
    lines = agents_table(status) if status.agents else []
    if status.omitted_agents:
        lines.append(f"({status.omitted_agents} more agents not listed: the status has a size limit)")
    header = f"{'tier':<8}{'ready':>7}{'draining':>10}{'lost':>6}{'left':>6}{'inflight':>10}{'req/s':>9}"
    lines += [header, "-" * len(header)]
    for t in status_json(status)["tiers"]:
        lines.append(
            f"{t['tier']:<8}{t['ready']:>7}{t['draining']:>10}{t['lost']:>6}{t['left']:>6}{t['in_flight']:>10}"
            f"{t['requests_per_s']:>9.1f}"
        )
    if not status.tiers:
        lines.append("(no agents)")
    lines.append("")
    lines += cloud_table(status.cloud)
    if status.families:
        lines += ["", *families_table(status.families)]
    lines.append("")
    lines.append(f"heartbeats   every {status.heartbeat_interval_s:g} s")
    if status.HasField("site_state"):
        lines.append(f"site state   {status.site_state.detail or status.site_state.url}")
        if status.site_state.judge:
            lines.append(f"site judge   {status.site_state.judge}")
        if status.site_state.routers:
            lines.append(f"site peers   {', '.join(status.site_state.routers)}")
    return "\n".join(lines)


def cloud_table(cloud: fpb.CloudStatus) -> list[str]:
    """The cloud link's row: state, server, transport, load, round trips, what it serves."""
    if cloud.state == "none":
        return ["cloud link   none (the router runs without --cloud)"]
    header = f"{'cloud link':<22}{'state':<18}{'server':<18}{'transport':<10}{'inflight':>9}{'p50 ms':>8}{'p99 ms':>8}"
    known = cloud.p50_ms > 0  # no escalation answered yet: "-", not 0.00
    row = (
        f"{fit(cloud.address, 21):<22}{fit(cloud.state, 17):<18}{fit(cloud.server or '-', 17):<18}"
        f"{cloud.transport or '-':<10}{cloud.in_flight:>9}"
        f"{_number(cloud.p50_ms, '.2f', known):>8}{_number(cloud.p99_ms, '.2f', known):>8}"
    )
    served = [m.name if m.variant == m.name else f"{m.name} ({m.variant})" for m in cloud.models]
    return [header, "-" * len(header), row, f"  serves {fit(', '.join(served), 200) or 'nothing yet'}"]


def families_table(families: Sequence[fpb.FamilyStatus]) -> list[str]:
    """Per family: each tier's threshold, current variants, ready agents and any rollout;
    then why each family that is not simply serving is not."""
    header = f"{'family':<16}{'state':<13}{'tier':<8}{'threshold':>10}  {'current':<32}{'ready':>7}  rollout"
    lines = [header, "-" * len(header)]
    for family in families:
        for index, t in enumerate(family.tiers or [fpb.FamilyTier()]):
            name, state = (fit(family.name, 15), family.state) if index == 0 else ("", "")
            threshold = _number(t.threshold, ".4f", t.HasField("threshold"))
            ready = f"{t.ready}/{t.listed}"
            rollout = f"{t.candidate} {t.candidate_percent:g}% {t.rollout_state}" if t.candidate else "-"
            lines.append(
                f"{name:<16}{state:<13}{tier_label(t.tier, '-'):<8}{threshold:>10}  "
                f"{fit(','.join(t.current) or '-', 31):<32}{ready:>7}  {rollout}"
            )
    lines += [f"{f.name}: {f.state}: {f.reason}" for f in families if f.reason]
    return lines


def ready_agents(status: fpb.FleetStatus) -> int:
    return sum(t.ready for t in status.tiers)


def rollout_json(status: fpb.RolloutStatus) -> dict[str, Any]:
    def arm(stats: fpb.ArmStats) -> dict[str, Any]:
        return {
            "variant": stats.variant,
            "requests": stats.requests,
            "errors": stats.errors,
            "p99_ms": round(stats.p99_ms, 3),
            "unsure_share": round(stats.unsure_share, 4),
            "audited": stats.audited,
            "agreement": round(stats.agreement, 4) if stats.audited else None,
        }

    return {
        "family": status.family,
        "tier": tier_label(status.tier),
        "candidate": status.candidate,
        "state": status.state,
        "share_percent": status.share_percent,
        "step": status.step,
        "steps": list(status.steps),
        "min_requests": status.min_requests,
        "min_audits": status.min_audits,
        "reason": status.reason,
        "revision": status.revision,
        "current": arm(status.current),
        "candidate_stats": arm(status.candidate_stats),
        "shadow": {"requests": status.shadow_requests, "agreement": round(status.shadow_agreement, 4)},
        "history": list(status.history),
    }


def rollout_table(statuses: list[fpb.RolloutStatus]) -> str:
    if not statuses:
        return "(no rollouts)"
    lines = []
    for s in statuses:
        r = rollout_json(s)
        steps = ",".join(f"{x:g}" for x in r["steps"])
        audits = f" and {r['min_audits']} audits" if r["min_audits"] else ""
        lines.append(
            f"{r['family']}/{r['tier']}: {r['candidate']} {r['state']} at {r['share_percent']:g}% "
            f"(steps {steps}; at least {r['min_requests']} requests{audits} each)"
        )
        lines.append(
            f"  {'variant':<24}{'requests':>9}{'errors':>8}{'p99 ms':>9}{'unsure':>9}{'audited':>9}{'agree':>8}"
            "   (this step, this router)"
        )
        for arm in (r["current"], r["candidate_stats"]):
            agree = f"{arm['agreement']:.1%}" if arm["agreement"] is not None else "-"
            lines.append(
                f"  {arm['variant'] or '-':<24}{arm['requests']:>9}{arm['errors']:>8}{arm['p99_ms']:>9.2f}"
                f"{arm['unsure_share']:>9.1%}{arm['audited']:>9}{agree:>8}"
            )
        if r["shadow"]["requests"]:
            lines.append(f"  shadow: {r['shadow']['requests']} items, {r['shadow']['agreement']:.1%} agree")
        lines += [f"  - {event}" for event in r["history"]]
    return "\n".join(lines)
