"""Each family as the router routes it now, for ``stratus fleet status --families``.

Per tier: its escalation threshold, the variants serving the family there, how many agents
are ready, and any rollout; then whether unsure answers come back degraded, and why. The
judgement is a pure function of what was seen (:func:`judge`), by the same rules the
cascade follows (:mod:`router.dataplane`): an unsure answer climbs to the next tier that
serves the family and can take it; where none above serves the family, or none that does is
reachable now, the answer comes back marked degraded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.cloud.link import LinkState
from router.cloud.models import family_of
from router.cloud.pool import CloudTier
from router.fleet.registry import FleetRegistry
from router.rollout.plan import Plan
from stratus.convert.fleet import wire_tier
from stratus.families.description import FamilyDescription
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb

SERVING = "serving"
DEGRADED = "degraded"
UNAVAILABLE = "unavailable"


@dataclass(frozen=True, kw_only=True)
class TierSeen:
    """One tier of one family as the router sees it now."""

    tier: Tier
    threshold: float | None
    current: tuple[str, ...]  # variants serving the family's requests here
    ready: int
    listed: int
    unreachable_because: str = ""  # why nothing here takes work now (for a tier with listed > 0)


@dataclass(frozen=True, kw_only=True)
class CloudSeen:
    """The cloud link as far as one family is concerned."""

    serves: bool
    available: bool
    status: str  # the link's state, as fleet status shows it
    variant: str  # what answers the family there


def judge(family: str, tiers: Sequence[TierSeen]) -> tuple[str, str]:
    """(state, reason) for a family whose tiers, lowest first, are ``tiers``."""
    present = [t for t in tiers if t.listed]
    reachable = [t for t in present if t.ready]
    if not reachable:
        held = "; ".join(t.unreachable_because for t in present) or "no agent or cloud serves it"
        return UNAVAILABLE, f"nothing ready serves '{family}': {held}"
    top, highest = present[-1], reachable[-1]
    reasons = []
    if highest.tier < top.tier and highest.threshold is not None:
        above = "; ".join(t.unreachable_because for t in present if t.tier > highest.tier)
        reasons.append(f"unsure {highest.tier.label} answers cannot climb: {above}")
    if top.tier < Tier.CLOUD and top.threshold is not None and top.ready:
        reasons.append(
            f"no tier above {top.tier.label} serves '{family}': unsure {top.tier.label} answers stay"
        )
    return (DEGRADED, "; ".join(reasons)) if reasons else (SERVING, "")


def agent_tier(registry: FleetRegistry, family: str, tier: Tier, threshold: float | None) -> TierSeen:
    """What agents of ``tier`` do for ``family``: its current variants on the ready ones."""
    pool = registry.index.pools(family).get(tier, ())
    listed = registry.index.listed(family).get(tier, 0)
    return TierSeen(
        tier=tier,
        threshold=threshold,
        current=tuple(sorted({handle.variant_for(family) for handle in pool})),
        ready=len(pool),
        listed=listed,
        unreachable_because=f"{listed} {tier.label} agent(s) listed, none ready" if listed else "",
    )


def cloud_tier(cloud: CloudSeen, threshold: float | None) -> TierSeen:
    return TierSeen(
        tier=Tier.CLOUD,
        threshold=threshold,
        current=(cloud.variant,) if cloud.serves and cloud.variant else (),
        ready=int(cloud.serves and cloud.available),
        listed=int(cloud.serves),
        unreachable_because=f"the cloud link is {cloud.status}",
    )


def seen_tiers(
    registry: FleetRegistry, family: str, info: FamilyDescription | None, cloud: CloudSeen | None
) -> list[TierSeen]:
    """Each tier with agents serving ``family`` or a threshold for it, and the cloud where it
    serves the family, lowest first."""
    thresholds = registry.thresholds(family)  # a family only the cloud serves has none
    listed = registry.index.listed(family)
    tiers = [
        agent_tier(registry, family, tier, thresholds.get(tier))
        for tier in (Tier.DEVICE, Tier.EDGE)
        if listed.get(tier) or tier in thresholds
    ]
    if cloud is not None and (cloud.serves or Tier.CLOUD in thresholds):
        tiers.append(cloud_tier(cloud, thresholds.get(Tier.CLOUD)))
    return tiers


def family_status(
    name: str, kind: str, tiers: Sequence[TierSeen], plans: Mapping[Tier, Plan]
) -> fpb.FamilyStatus:
    state, reason = judge(name, tiers)
    status = fpb.FamilyStatus(name=name, kind=kind, state=state, reason=reason)
    for seen in tiers:
        row = status.tiers.add(
            tier=wire_tier(seen.tier), current=seen.current, ready=seen.ready, listed=seen.listed
        )
        if seen.threshold is not None:
            row.threshold = seen.threshold
        plan = plans.get(seen.tier)
        if plan is not None:
            row.candidate, row.candidate_percent, row.rollout_state = plan.candidate, plan.share, plan.state
    return status


def cloud_seen(cloud: CloudTier | None, family: str) -> CloudSeen | None:
    if cloud is None:
        return None
    status = cloud.status
    if status == LinkState.CONNECTED and not cloud.available:  # up, but its queue is full
        status = f"full ({cloud.in_flight} escalations in flight)"
    return CloudSeen(
        serves=cloud.models.get(family, False),
        available=cloud.available,
        status=status,
        variant=cloud.variants.get(family, ""),
    )


def family_statuses(
    registry: FleetRegistry, cloud: CloudTier | None, plans: Sequence[Plan]
) -> list[fpb.FamilyStatus]:
    """Every family agents brought, and each text model the cloud alone serves (not the
    cloud's variants of those families, which answer only when named), by name."""
    by_family: dict[str, dict[Tier, Plan]] = {}
    for plan in plans:
        by_family.setdefault(plan.family, {})[plan.tier] = plan
    known = registry.families
    generative = {
        name: info
        for name, info in (cloud.generative if cloud is not None else {}).items()
        if family_of(name, known) in (None, name)
    }
    statuses = []
    for name in sorted({*known, *generative}):
        info = registry.families.get(name) or generative.get(name)
        tiers = seen_tiers(registry, name, info, cloud_seen(cloud, name))
        statuses.append(family_status(name, "generative" if info is not None and info.generative else "", tiers, by_family.get(name, {})))
    return statuses
