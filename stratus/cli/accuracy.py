"""``stratus fleet accuracy FAMILY``: each tier's live agreement with the top tier, as audits
measure it, beside what calibration recorded, with a verdict; ``--agents`` ranks the agents."""

from __future__ import annotations

import json
from typing import Any

from stratus.convert.fleet import tier_label
from stratus.serving.channels import NO_TLS, TlsSettings, open_sync_channel, server_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc


def _estimate(estimate: fpb.AgreementEstimate) -> dict[str, Any]:
    return {
        "audits": estimate.audits,
        "agreed": estimate.agreed,
        "agreement": round(estimate.agreement, 4),
        "lower": round(estimate.lower, 4),
        "upper": round(estimate.upper, 4),
    }


def _calibrated(row: fpb.TierAccuracy) -> dict[str, Any] | None:
    if not row.HasField("calibrated"):
        return None
    figures = row.calibrated
    return {
        "accuracy": round(figures.accuracy, 4),
        "agreement": round(figures.agreement, 4) if figures.HasField("agreement") else None,
        "items": figures.items,
    }


def accuracy_json(reply: fpb.AccuracyReply) -> dict[str, Any]:
    return {
        "family": reply.family,
        "top_tier": tier_label(reply.top_tier),
        "calibrated_top_tier": tier_label(reply.calibrated_top_tier) if reply.calibrated_top_tier else None,
        "share": reply.share,
        "margin": reply.margin,
        "min_audits": reply.min_audits,
        "window": {"audits": reply.window_audits, "seconds": reply.window_s},
        "dropped": reply.dropped,
        "pushed": _pushed(reply),
        "tiers": [
            {
                "tier": tier_label(row.tier),
                "variants": list(row.variants),
                "calibrated": _calibrated(row),
                "live": _estimate(row.live),
                "verdict": row.verdict,
                "escalated": _estimate(row.escalated),
            }
            for row in reply.tiers
        ],
        "agents": [
            {
                "agent": a.agent,
                "tier": tier_label(a.tier),
                "variant": a.variant,
                "live": _estimate(a.live),
                "verdict": a.verdict,
            }
            for a in reply.agents
        ],
    }


def _pushed(reply: fpb.AccuracyReply) -> dict[str, Any] | None:
    """The thresholds a push holds in force (stratus fleet thresholds), if one does."""
    if not reply.HasField("pushed"):
        return None
    pushed = reply.pushed
    return {
        "version": pushed.version,
        "thresholds": dict(pushed.thresholds),
        "author": pushed.author,
        "reason": pushed.reason,
        "origin": pushed.origin,
    }


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _live(live: dict[str, Any]) -> str:
    if not live["audits"]:
        return f"{'-':>8}{'-':>17}{0:>8}"
    return f"{live['agreement']:>8.4f}{live['lower']:>9.4f}-{live['upper']:.4f}{live['audits']:>8}"


def accuracy_table(reply: fpb.AccuracyReply) -> str:
    found = accuracy_json(reply)
    lines = [
        f"{found['family']}: agreement with the {found['top_tier']} tier, audited on {found['share']:.1%} of the "
        f"items settled below it (window: the last {found['window']['audits']} audits per agent and variant, "
        f"{found['window']['seconds'] / 60:g} min)",
        "",
        f"{'tier':<8}{'variants':<26}{'cal acc':>8}{'cal agr':>8}{'live':>8}{'95% interval':>17}{'audits':>8}"
        f"  {'verdict':<16}escalated (biased)",
    ]
    for row in found["tiers"]:
        calibrated = row["calibrated"] or {}
        escalated = row["escalated"]
        biased = f"{escalated['agreement']:.4f} of {escalated['audits']}" if escalated["audits"] else "-"
        lines.append(
            f"{row['tier']:<8}{','.join(row['variants']) or '-':<26}{_share(calibrated.get('accuracy')):>8}"
            f"{_share(calibrated.get('agreement')):>8}{_live(row['live'])}  {row['verdict']:<16}{biased}"
        )
    calibrated_against = found["calibrated_top_tier"]
    if calibrated_against not in (None, found["top_tier"]):
        lines.append(
            f"(calibrated against the {calibrated_against} tier, but audits here ask the {found['top_tier']} "
            "tier: no verdict)"
        )
    if not found["tiers"]:
        lines.append(f"(nothing below the {found['top_tier']} tier serves {found['family']})")
    lines += [
        "",
        f"drifted: the interval's upper bound is below calibrated agreement - {found['margin']:g}; in line: its "
        f"lower bound is at or above it; too few audits: under {found['min_audits']}, or the interval straddles it",
        f"dropped so far: {found['dropped']} audits (no spare capacity at the top tier, a full queue, or a failed call)",
    ]
    pushed = found["pushed"]
    if pushed is not None:
        named = ",".join(f"{t}={v:g}" for t, v in sorted(pushed["thresholds"].items())) or "the agents' own"
        lines.append(
            f"thresholds: pushed version {pushed['version']} in force ({named}), by {pushed['author']} on "
            f"{pushed['origin']}: {pushed['reason']} (stratus fleet thresholds {found['family']})"
        )
    if found["agents"]:
        lines += ["", "agents, the surely worst last (ranked by the interval's upper bound)", _AGENT_HEADER]
        lines += [
            f"{a['agent']:<28}{a['tier']:<8}{a['variant']:<26}{_live(a['live'])}  {a['verdict']}"
            for a in found["agents"]
        ]
    return "\n".join(lines)


_AGENT_HEADER = (
    f"{'agent':<28}{'tier':<8}{'variant':<26}{'live':>8}{'95% interval':>17}{'audits':>8}  verdict"
)


def show_accuracy(
    router: str, family: str, *, agents: bool, as_json: bool, tls: TlsSettings = NO_TLS, token: str = ""
) -> int:
    request = fpb.AccuracyRequest(family=family, include_agents=agents, token=token)
    with open_sync_channel(router, tls, server_options("router", tls)) as channel:
        reply = fpb_grpc.FleetStub(channel).Accuracy(request, timeout=5.0)
    print(json.dumps(accuracy_json(reply), indent=2) if as_json else accuracy_table(reply))
    return 0
