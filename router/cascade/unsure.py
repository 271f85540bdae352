"""Why a classifier's final answer keeps items below its tier's threshold: never silently wrong.

A final answer (:mod:`router.policy.climb` says when one is) settles every item it was sent,
sure or not. Where some stayed below the threshold, the response says why in
``stratus.reason``: the client's ``stratus.max_tier`` held them below a tier that serves the
family; or nowhere higher could be asked, because the family keeps its inputs on the site
(``[privacy] escalate = false``) or because no tier above serves it. Nowhere higher makes
the answer degraded, and the router's log says so once per family.

Kept apart from :class:`~router.cascade.classify.ClassifyCascade`, which performs the climb:
this only explains where a climb ended, once, on its final answer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from router.backends.base import Backend
from router.cascade.common import Answer, CascadeContext, Job
from router.policy import FleetSnapshot, top_tier
from stratus.convert.parameters import held_reason
from stratus.families.confidence import settled
from stratus.tiers import Tier

log = logging.getLogger("stratus.router")


@dataclass(frozen=True, kw_only=True)
class KeptUnsure:
    """Why a final answer kept unsure items, as ``stratus.reason`` says it."""

    reason: str
    nowhere_higher: bool  # no tier above could be asked: the answer is degraded


def kept_unsure(
    context: CascadeContext,
    job: Job,
    answer: Answer,
    snapshot: FleetSnapshot[Backend],
    thresholds: Mapping[Tier, float],
) -> KeptUnsure | None:
    """Why the final ``answer`` keeps items below its tier's threshold; None where it keeps none."""
    options = job.options
    floor = options.min_confidence
    sure = settled(answer.confidences, answer.tier, final=False, thresholds=thresholds, min_confidence=floor)
    short = sure.count(False)  # items below their threshold: they would have climbed
    if not short:
        return None
    higher = top_tier(snapshot, Tier.CLOUD)
    family, tier = job.family, answer.tier.label
    if higher is not None and higher > answer.tier:
        return KeptUnsure(reason=held_reason(options.max_tier, short, answer.tier), nowhere_higher=False)
    if not context.escalates(job.model):  # the cloud may serve it, but not be sent it
        reason = (
            f"'{family}' keeps its inputs on the site ([privacy] escalate = false): {short} item(s) "
            f"stayed below the {tier} threshold"
        )
        return KeptUnsure(reason=reason, nowhere_higher=True)
    if family not in context.warned_short:
        context.warned_short.add(family)
        log.warning(
            "%s: unsure answers are degraded (no tier above %s serves it: give the cloud a variant "
            "of it, or agents of a higher tier)",
            family,
            tier,
        )
    reason = f"no tier above {tier} serves '{family}': {short} item(s) stayed below the {tier} threshold"
    return KeptUnsure(reason=reason, nowhere_higher=True)
