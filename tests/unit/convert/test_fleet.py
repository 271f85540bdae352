"""fleet.proto's tiers, thresholds, chunks and family descriptions cross the wire as they are."""

from __future__ import annotations

import dataclasses
import math

import pytest

from stratus.convert.fleet import (
    chunk_to_wire,
    family_from_wire,
    heartbeat_from_wire,
    heartbeat_to_wire,
    thresholds_from_wire,
    thresholds_to_wire,
    tier_label,
    wire_tier,
)
from stratus.errors import InvalidInput
from stratus.families.audit import AuditSpec, TierCalibration
from stratus.families.generation import Chunk, GenerationMethod, Token
from stratus.families.spec import GenerationSpec, TensorSpec
from stratus.obs.stats import LatencySummary, LoadReport
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb


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


@pytest.mark.parametrize("value", [float("nan"), -0.5, 1.5])
def test_a_threshold_no_cascade_compares_with_refuses_the_hello(value: float) -> None:
    with pytest.raises(InvalidInput, match=r"^Hello from a1: the device threshold .* is not in \[0, 1\]"):
        thresholds_from_wire({"device": value}, "Hello from a1")


def test_a_chunk_crosses_with_its_text_log_probabilities_and_margins() -> None:
    chunk = Chunk(
        tokens=(Token(text="4", logprob=-0.1, margin=2.5), Token(text="2", logprob=-0.3, margin=None))
    )
    sent = chunk_to_wire("w1", chunk)
    assert (sent.request_id, sent.text, list(sent.logprobs)) == ("w1", "42", [-0.1, -0.3])
    assert sent.margins[0] == 2.5 and math.isnan(sent.margins[1])  # a margin not given is NaN


def test_a_heartbeat_crosses_as_it_was_written() -> None:
    report = LoadReport(
        in_flight=3,
        queue_length=17,
        received=41,
        latency={
            "digits-small": LatencySummary(mean_ms=1.5, p50_ms=1.25, p99_ms=4.0, count=9),
            "digits-small-int8": LatencySummary(mean_ms=0.75, p50_ms=0.5, p99_ms=2.0, count=2),
        },
    )
    assert heartbeat_from_wire(fpb.Heartbeat.FromString(heartbeat_to_wire(report).SerializeToString())) == report


def test_a_heartbeats_times_that_are_no_times_read_as_unknown_and_a_name_twice_as_its_last() -> None:
    beat = fpb.Heartbeat()
    beat.latency.add(variant="v", mean_ms=math.nan, p50_ms=math.inf, p99_ms=-3.0, count=5)
    beat.latency.add(variant="w", mean_ms=1.0, count=1)
    beat.latency.add(variant="w", mean_ms=2.0, count=2)
    read = heartbeat_from_wire(beat)
    assert read.latency["v"] == LatencySummary(mean_ms=0.0, p50_ms=0.0, p99_ms=0.0, count=5)
    assert read.latency["w"].mean_ms == 2.0 and list(read.latency) == ["v", "w"]


def _described_arith() -> fpb.FamilyInfo:
    info = fpb.FamilyInfo(
        name="arith",
        inputs=[pb.ModelMetadataResponse.TensorMetadata(name="text_input", datatype="BYTES", shape=[1])],
        thresholds={"device": 0.8, "edge": 0.7},
        kind="generative",
        confidence_method="first_margin",
        max_tokens=6,
        stop=["\n"],
        cloud_variants=["arith-large"],
        calibrated_cloud_share=0.13,
    )
    info.audit.share = 0.02
    info.audit.compare = "number"
    info.calibrated["device"].CopyFrom(fpb.TierCalibration(accuracy=0.97, agreement=0.98, items=90))
    info.calibrated["cloud"].CopyFrom(fpb.TierCalibration(accuracy=0.99, items=13))
    return info


def test_a_hellos_family_is_read_once_into_what_the_router_serves_by() -> None:
    described = family_from_wire(_described_arith())
    assert described.inputs == (TensorSpec(name="text_input", datatype="BYTES", shape=(1,)),)
    assert described.thresholds == {Tier.DEVICE: 0.8, Tier.EDGE: 0.7}
    assert described.generation == GenerationSpec(max_tokens=6, stop=("\n",), method=GenerationMethod.FIRST_MARGIN)
    assert (described.max_tokens, described.stop, described.cloud_variants) == (6, ("\n",), ("arith-large",))
    assert described.calibrated_cloud_share == 0.13
    assert described.audit == AuditSpec(share=0.02, max_per_s=None, compare="number")
    assert described.tier_accuracy == {
        Tier.DEVICE: TierCalibration(accuracy=0.97, agreement=0.98, items=90),
        Tier.CLOUD: TierCalibration(accuracy=0.99, agreement=None, items=13),
    }
    plain = family_from_wire(fpb.FamilyInfo(name="digits"))
    assert not plain.generative and plain.max_tokens == 0 and plain.calibrated_cloud_share is None


def test_a_family_the_router_cannot_read_refuses_its_hello_naming_the_field() -> None:
    unknown_method = _described_arith()
    unknown_method.confidence_method = "vibes"
    with pytest.raises(InvalidInput, match="family 'arith': confidence method 'vibes' is not one of"):
        family_from_wire(unknown_method)
    no_tier = _described_arith()
    no_tier.calibrated["space"].CopyFrom(fpb.TierCalibration(accuracy=0.5, items=1))
    with pytest.raises(InvalidInput, match=r"family 'arith': calibrated figures: .*space"):
        family_from_wire(no_tier)


def test_a_push_keeps_the_first_agents_figures_and_drops_the_calibrated_share() -> None:
    first = family_from_wire(_described_arith())
    recalibrated = dataclasses.replace(first, thresholds={Tier.DEVICE: 0.5}, tier_accuracy={}, calibrated_cloud_share=0.3)
    served = recalibrated.under_push({Tier.DEVICE: 0.9}, first)
    assert served.thresholds == {Tier.DEVICE: 0.9, Tier.EDGE: 0.7}
    assert served.tier_accuracy == first.tier_accuracy and served.calibrated_cloud_share is None
