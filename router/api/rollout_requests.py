"""A Fleet.Rollout call read against the fleet: the tier it names, whether a start could ever
work, and each plan as an operator is shown it, beside the lines its tier serves now.

Apart from the Fleet service (:class:`router.api.fleet_service.FleetServicer`), which
authorizes the call and writes a change to the site's store first: these read only the registry
and the rollouts (no gRPC context, no credentials), so the service keeps the call's door and
these keep what a rollout may be.
"""

from __future__ import annotations

from router.api.fleet_status import rollout_status
from router.fleet.index import line_key
from router.fleet.registry import FleetRegistry
from router.rollout.judge import Margins
from router.rollout.plan import DEFAULT_MIN_AUDITS, DEFAULT_STEPS, Plan
from router.rollout.plans import Rollouts
from stratus.errors import InvalidInput, NotFound
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb


def rollout_tier(value: int) -> Tier:
    """The tier a Rollout request names (the wire's value)."""
    try:
        return Tier.from_wire(value)
    except InvalidInput:
        raise InvalidInput("a rollout names its tier: device or edge") from None


def start_plan(registry: FleetRegistry, rollouts: Rollouts, request: fpb.RolloutRequest, tier: Tier) -> Plan:
    """Start the rollout ``request`` asks for, refusing what could never work: an unknown family,
    a candidate no agent of the tier serves, the current variant itself, or the cloud tier."""
    family, candidate = request.family, request.candidate
    if registry.family(family) is None:
        raise NotFound(f"no agent serves a family '{family}'")
    if tier is Tier.CLOUD:
        raise InvalidInput(
            "the cloud tier is one gateway with its own models folder: roll a new cloud variant "
            "out by deploying a gateway beside the old one"
        )
    if tier not in registry.index.tiers(line_key(candidate)):
        raise NotFound(
            f"no {tier.label} agent serves '{candidate}': add it to their models folder and "
            "reload them (stratus fleet reload AGENT, or SIGHUP)"
        )
    if candidate in lines_served(registry, family, tier):
        raise InvalidInput(f"'{candidate}' is already the current {tier.label} variant of '{family}'")
    margins = Margins(
        max_error_increase=request.max_error_increase or Margins.max_error_increase,
        max_p99_ratio=request.max_p99_ratio or Margins.max_p99_ratio,
        max_unsure_increase=request.max_unsure_increase or Margins.max_unsure_increase,
        max_disagreement_increase=request.max_disagreement_increase or Margins.max_disagreement_increase,
    )
    return rollouts.start(
        family,
        tier,
        candidate,
        steps=list(request.steps) or DEFAULT_STEPS,
        min_requests=request.min_requests or 100,
        min_audits=request.min_audits or DEFAULT_MIN_AUDITS,
        shadow=request.shadow_percent,
        margins=margins,
    )


def lines_served(registry: FleetRegistry, family: str, tier: Tier) -> set[str]:
    """The lines agents of ``tier`` serve ``family`` requests with now."""
    lines = set()
    for handle in registry.index.pools(family).get(tier, ()):
        info = handle.variants.get(handle.variant_for(family))
        if info is not None:
            lines.add(info.line or info.name)
    return lines


def plan_status(registry: FleetRegistry, rollouts: Rollouts, plan: Plan) -> fpb.RolloutStatus:
    """``plan`` as an operator reads it, against the lines its tier serves besides the candidate."""
    current = sorted(lines_served(registry, plan.family, plan.tier) - {plan.candidate})
    return rollout_status(rollouts, plan, ",".join(current))
