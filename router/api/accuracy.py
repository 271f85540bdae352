"""Fleet.Accuracy: each tier's live agreement with the top tier, beside its calibrated figures.

Per tier below the family's top tier, one row: what ``models calibrate`` recorded, the live
estimate from audits (unbiased), its verdict (:func:`router.audit.agreement.verdict`), and the biased
sample escalations carry, kept apart. With agents, one row per (agent, variant), ranked by the
upper bound of their interval, highest first: the agent that is surely worst comes last, and
one unlucky audit (agreement 0, upper bound 0.79) does not outrank thirty bad ones.
"""

from __future__ import annotations

from collections.abc import Mapping

from router.audit.agreement import MARGIN, MIN_AUDITS, AuditKey, Estimate, total, verdict
from router.audit.auditor import Auditor, calibrated_top
from stratus.convert.fleet import wire_tier
from stratus.errors import NotFound
from stratus.families.audit import calibration_info
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb


def estimate_info(estimate: Estimate) -> fpb.AgreementEstimate:
    lower, upper = estimate.interval
    return fpb.AgreementEstimate(
        audits=estimate.audits, agreed=estimate.agreed, agreement=estimate.agreement, lower=lower, upper=upper
    )


def accuracy_reply(
    auditor: Auditor,
    family: str,
    *,
    include_agents: bool,
    margin: float = MARGIN,
    min_audits: int = MIN_AUDITS,
) -> fpb.AccuracyReply:
    info = auditor.registry.family(family)
    top = auditor.top_of(family)
    if info is None or top is None:
        raise NotFound(f"no agent serves a family '{family[:128]}'")
    live = auditor.book.estimates(family)
    tiers = sorted({t for t in auditor.registry.index.tiers(family) if t < top} | {k.tier for k in live})
    calibrated = info.tier_accuracy
    lines = auditor.calibrated_lines(info)
    reply = fpb.AccuracyReply(
        family=family,
        top_tier=wire_tier(top),
        margin=margin,
        min_audits=min_audits,
        window_audits=auditor.book.max_audits,
        window_s=auditor.book.max_age_s,
        dropped=auditor.dropped,
        share=auditor.share_of(info),
    )
    if (calibrated_against := calibrated_top(info)) is not None:
        reply.calibrated_top_tier = wire_tier(calibrated_against)
    escalated = auditor.escalated.estimates(family)
    for tier in tiers:
        mine = [e for k, e in live.items() if k.tier is tier]
        row = fpb.TierAccuracy(
            tier=wire_tier(tier),
            variants=sorted({k.variant for k in live if k.tier is tier}),
            live=estimate_info(total(mine)),
            verdict=verdict(total(mine), lines.get(tier), margin=margin, min_audits=min_audits),
            escalated=estimate_info(total(e for k, e in escalated.items() if k.tier is tier)),
        )
        if tier in calibrated:
            row.calibrated.CopyFrom(calibration_info(calibrated[tier]))
        reply.tiers.append(row)
    if include_agents:
        reply.agents.extend(_agent_rows(live, lines, margin=margin, min_audits=min_audits))
    return reply


def _agent_rows(
    live: Mapping[AuditKey, Estimate],
    lines: Mapping[Tier, float],
    *,
    margin: float,
    min_audits: int,
) -> list[fpb.AgentAccuracy]:
    ranked = sorted(live.items(), key=lambda kv: (kv[1].interval[1], kv[1].agreement), reverse=True)
    return [
        fpb.AgentAccuracy(
            agent=key.agent,
            tier=wire_tier(key.tier),
            variant=key.variant,
            live=estimate_info(estimate),
            verdict=verdict(estimate, lines.get(key.tier), margin=margin, min_audits=min_audits),
        )
        for key, estimate in ranked
    ]
