"""fleet.proto's messages ⇄ domain types."""

from __future__ import annotations

from stratus.errors import InvalidInput
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb


def wire_tier(tier: Tier | None) -> fpb.Tier.ValueType:
    """:meth:`Tier.to_wire` in the stubs' type; None is TIER_UNSPECIFIED (a request that
    names no tier)."""
    return fpb.Tier.ValueType(tier.to_wire()) if tier is not None else fpb.TIER_UNSPECIFIED


def tier_label(value: int, unknown: str = "unknown") -> str:
    """A tier a router reported, as an operator reads it; one this version does not know
    (a newer router's) is shown as ``unknown``, not refused, so the rest of the table shows."""
    try:
        return Tier.from_wire(value).label
    except InvalidInput:
        return unknown
