"""An agent's Hello is read once, bounded, into values the registry keeps (issue 33 §3)."""

from __future__ import annotations

import dataclasses

import pytest

from stratus.convert.hardware import to_wire as hardware_to_wire
from stratus.convert.hello import hello_from_wire, hello_to_wire
from stratus.errors import InvalidInput
from stratus.families.agent_hello import FamilyUnavailable, HardwareSaid, VariantServed
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb


def _hello() -> fpb.Hello:
    variant = fpb.VariantInfo(
        name="digits-small-int8", family="digits", runtime="openvino", device="CPU", precision="INT8",
        compute="int8", dynamic_batch=True, max_batch=32, chosen_because="int8: native", line="digits-small",
        current=True, kv_cache="u8",
    )  # fmt: skip
    family = fpb.FamilyInfo(
        name="digits",
        inputs=[pb.ModelMetadataResponse.TensorMetadata(name="input", datatype="FP32", shape=[-1, 64])],
        thresholds={"device": 0.8},
    )
    return fpb.Hello(
        agent_id="dev-1", tier=fpb.TIER_DEVICE, host="box", runtimes=["openvino"], variants=[variant],
        capacity=3, queue_limit=9, token="t", version="0.1.0", families=[family], uptime_s=12.5,
        unavailable=[fpb.FamilyUnavailable(family="arith", variant="arith-small", reason="no runtime")],
        hardware_info=fpb.HardwareInfo(machine="x86_64", cpu_model="EPYC", flags=["avx2"], flags_from="cpuinfo",
                                       precisions=["INT8", "FP32"]),
    )  # fmt: skip


def test_every_field_of_a_hello_is_read_as_a_value() -> None:
    read = hello_from_wire(_hello())
    assert (read.agent_id, read.tier, read.host, read.runtimes) == ("dev-1", Tier.DEVICE, "box", ("openvino",))
    assert (read.capacity, read.queue_limit, read.token, read.version, read.uptime_s) == (3, 9, "t", "0.1.0", 12.5)
    assert read.variants == (
        VariantServed(
            name="digits-small-int8", family="digits", runtime="openvino", device="CPU", precision="INT8",
            compute="int8", dynamic_batch=True, max_batch=32, chosen_because="int8: native", line="digits-small",
            current=True, kv_cache="u8",
        ),
    )  # fmt: skip
    assert read.unavailable == (FamilyUnavailable(family="arith", variant="arith-small", reason="no runtime"),)
    assert read.hardware == HardwareSaid(
        machine="x86_64", cpu_model="EPYC", flags=("avx2",), flags_from="cpuinfo", precisions=("INT8", "FP32")
    )
    (family,) = read.families
    assert (family.name, family.thresholds, [t.shape for t in family.inputs]) == ("digits", {Tier.DEVICE: 0.8}, [(-1, 64)])


def test_what_an_agent_writes_a_router_reads_back_as_it_was() -> None:
    said = hello_from_wire(_hello())
    written = hello_to_wire(said)
    assert hello_from_wire(fpb.Hello.FromString(written.SerializeToString())) == said
    assert written.hardware == "x86_64 EPYC"  # in words too, for a router older than hardware_info


def test_the_hardware_status_shows_is_what_was_read() -> None:
    read = hello_from_wire(_hello()).hardware
    assert hardware_to_wire(read) == _hello().hardware_info


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda h: h.ClearField("variants"), "no variants"),
        (lambda h: setattr(h, "tier", fpb.TIER_UNSPECIFIED), "tier is unspecified"),
        (lambda h: setattr(h, "agent_id", "dev 1\n"), "agent_id"),
        (lambda h: h.variants.add(name="x" * 200, family="digits"), "model name"),
    ],
)
def test_a_hello_out_of_bounds_is_refused_as_it_is_read(change, said: str) -> None:  # type: ignore[no-untyped-def]
    hello = _hello()
    change(hello)
    with pytest.raises(InvalidInput, match=said):
        hello_from_wire(hello)


def test_values_are_frozen_so_no_holder_changes_what_another_was_told() -> None:
    read = hello_from_wire(_hello())
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.variants[0].current = False  # type: ignore[misc]
