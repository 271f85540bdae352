"""Tiers cross the wire without a table: Tier's numbers are fleet.proto's."""

from __future__ import annotations

import pytest

from stratus.convert.fleet import tier_label, wire_tier
from stratus.errors import InvalidInput
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb


def test_tier_numbers_are_the_wire_enum_values() -> None:
    """Tier.to_wire is int(self): this holds the two enums in step, name by name."""
    wire_names = {name for name in fpb.Tier.DESCRIPTOR.values_by_name if name != "TIER_UNSPECIFIED"}
    assert wire_names == {f"TIER_{tier.name}" for tier in Tier}
    for tier in Tier:
        assert tier.to_wire() == fpb.Tier.Value(f"TIER_{tier.name}")
        assert wire_tier(tier) == fpb.Tier.Value(f"TIER_{tier.name}")


def test_each_wire_tier_comes_back_as_itself() -> None:
    assert [Tier.from_wire(v) for v in (fpb.TIER_DEVICE, fpb.TIER_EDGE, fpb.TIER_CLOUD)] == [
        Tier.DEVICE,
        Tier.EDGE,
        Tier.CLOUD,
    ]


@pytest.mark.parametrize("value", [fpb.TIER_UNSPECIFIED, 4, -1])
def test_a_tier_this_version_does_not_know_is_the_senders_mistake(value: int) -> None:
    with pytest.raises(InvalidInput, match=f"unknown tier {value}; expected one of 1 \\(device\\)"):
        Tier.from_wire(value)


def test_no_tier_is_unspecified_on_the_wire() -> None:
    assert wire_tier(None) == fpb.TIER_UNSPECIFIED


def test_operators_see_unknown_tiers_named_so() -> None:
    assert tier_label(fpb.TIER_EDGE) == "edge"
    assert tier_label(fpb.TIER_UNSPECIFIED) == "unknown"
    assert tier_label(9, unknown="-") == "-"
