"""fleet.proto's tiers, thresholds and chunks cross the wire as they are."""

from __future__ import annotations

import math

import pytest

from stratus.convert.fleet import (
    chunk_to_wire,
    thresholds_from_wire,
    thresholds_to_wire,
    tier_label,
    wire_tier,
)
from stratus.errors import InvalidInput
from stratus.families.generation import Chunk, Token
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


def test_thresholds_cross_keyed_by_tier_label() -> None:
    thresholds = {Tier.DEVICE: 0.8, Tier.CLOUD: 0.5}
    assert thresholds_to_wire(thresholds) == {"device": 0.8, "cloud": 0.5}
    assert thresholds_from_wire({"device": 0.8, "cloud": 0.5}, "here") == thresholds


def test_a_threshold_for_no_tier_says_where_it_came_from() -> None:
    with pytest.raises(InvalidInput, match=r"^Hello from a1: thresholds: unknown tier 'sky'"):
        thresholds_from_wire({"edge": 0.5, "sky": 0.5}, "Hello from a1")


def test_a_chunk_crosses_with_its_text_log_probabilities_and_margins() -> None:
    chunk = Chunk(
        tokens=(Token(text="4", logprob=-0.1, margin=2.5), Token(text="2", logprob=-0.3, margin=None))
    )
    sent = chunk_to_wire("w1", chunk)
    assert (sent.request_id, sent.text, list(sent.logprobs)) == ("w1", "42", [-0.1, -0.3])
    assert sent.margins[0] == 2.5 and math.isnan(sent.margins[1])  # a margin not given is NaN
