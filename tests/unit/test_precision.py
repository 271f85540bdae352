"""Choosing a precision: faked CPU flags, the verification record, overrides, tolerance."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from stratus.errors import ConfigError, NotFound
from stratus.families import cpu
from stratus.families.cpu import (
    Hardware,
    arm_hwcap_flags,
    cpu_flags,
    cpu_model,
    decode_hwcap,
    hardware_precisions,
    this_hardware,
)
from stratus.families.precision import VerificationRecord, choose_variant, format_record, load_verification
from stratus.families.repository import ModelRepository, load_family
from stratus.families.spec import FamilySpec
from stratus.tiers import Tier

AVX2 = ["fpu", "sse4_2", "avx", "avx2", "fma", "f16c"]
VNNI = [*AVX2, "avx512f", "avx512_vnni"]
SAPPHIRE_RAPIDS = [*VNNI, "amx_int8", "amx_bf16", "avx512_fp16", "amx_tile"]
GRAVITON = ["fp", "asimd", "fphp", "asimdhp", "asimddp", "sve"]


@pytest.mark.parametrize(
    ("flags", "machine", "expected"),
    [
        (AVX2, "x86_64", {"FP32"}),
        (VNNI, "x86_64", {"FP32", "INT8"}),
        ([*AVX2, "avx_vnni"], "x86_64", {"FP32", "INT8"}),
        (SAPPHIRE_RAPIDS, "x86_64", {"FP32", "INT8", "FP16"}),
        (GRAVITON, "aarch64", {"FP32", "INT8", "FP16"}),
        (["fp", "asimd"], "aarch64", {"FP32"}),
        (["asimddp"], "x86_64", {"FP32"}),  # an ARM flag on x86 means nothing
    ],
)
def test_native_precisions_follow_the_cpu_flags(flags: list[str], machine: str, expected: set[str]) -> None:
    assert hardware_precisions(flags, machine).precisions == expected


def test_reasons_name_the_flags() -> None:
    assert hardware_precisions(AVX2, "x86_64").reason == "no native int8/fp16 on this CPU (avx2, f16c, fma)"
    assert hardware_precisions(VNNI, "x86_64").reason == "cpu flags: avx512_vnni"


def test_cpu_flags_reads_x86_and_arm_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_vnni\n\nprocessor\t: 1\nflags\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_vnni"}
    assert cpu_flags(arm) == {"fp", "asimd", "asimddp"}
    assert cpu_flags(tmp_path / "absent") == set()


@pytest.fixture
def family(repository: ModelRepository) -> FamilySpec:
    return repository.family("digits")


@pytest.fixture
def record(family: FamilySpec) -> VerificationRecord:
    loaded = load_verification(family)
    assert loaded is not None, "models/digits/verified.toml is committed with the models"
    return loaded


def hardware(*precisions: str) -> Hardware:
    return Hardware(precisions=frozenset({"FP32", *precisions}), reason="cpu flags: faked")


def test_plain_avx2_serves_fp32(family: FamilySpec, record: VerificationRecord) -> None:
    choice = choose_variant(family, Tier.DEVICE, hardware=hardware_precisions(AVX2, "x86_64"), record=record)
    assert choice.variant.name == "digits-small"
    assert choice.reason.startswith("fp32: no native int8/fp16 on this CPU")


def test_vnni_serves_int8_and_says_what_it_costs(family: FamilySpec, record: VerificationRecord) -> None:
    choice = choose_variant(family, Tier.DEVICE, hardware=hardware_precisions(VNNI, "x86_64"), record=record)
    assert choice.variant.name == "digits-small-int8"
    assert choice.reason.startswith("int8: native (cpu flags: avx512_vnni), drop 0.")
    assert "≤ 0.010" in choice.reason


def test_fewer_bits_first_unless_measured(family: FamilySpec, record: VerificationRecord) -> None:
    amx = hardware_precisions(SAPPHIRE_RAPIDS, "x86_64")
    assert choose_variant(family, Tier.EDGE, hardware=amx, record=record).variant.name == "digits-medium-int8"
    measured = {"digits-medium": 0.05, "digits-medium-int8": 0.04, "digits-medium-fp16": 0.02}
    chosen = choose_variant(family, Tier.EDGE, hardware=amx, record=record, measured_ms=measured)
    assert chosen.variant.name == "digits-medium-fp16"
    arm = hardware_precisions(GRAVITON, "aarch64")
    assert choose_variant(family, Tier.CLOUD, hardware=arm, record=record).variant.name == "digits-large-fp16"


def test_no_record_or_a_stale_one_means_fp32(
    family: FamilySpec, record: VerificationRecord, tmp_path: Path
) -> None:
    vnni = hardware("INT8")
    none = choose_variant(family, Tier.DEVICE, hardware=vnni, record=None)
    assert none.variant.name == "digits-small" and "no verification record" in none.reason
    copy = tmp_path / "digits"
    shutil.copytree(family.folder, copy)
    (copy / "digits-small-int8.tflite").write_bytes(b"retrained without re-verifying")
    moved = load_family(copy / "family.toml")
    stale = choose_variant(moved, Tier.DEVICE, hardware=vnni, record=load_verification(moved))
    assert stale.variant.name == "digits-small"
    assert "stale (digits-small-int8.tflite changed" in stale.reason


def test_a_changed_parent_makes_the_child_stale(family: FamilySpec, tmp_path: Path) -> None:
    copy = tmp_path / "digits"
    shutil.copytree(family.folder, copy)
    (copy / "digits-small.onnx").write_bytes(b"a new parent")
    moved = load_family(copy / "family.toml")
    choice = choose_variant(moved, Tier.DEVICE, hardware=hardware("INT8"), record=load_verification(moved))
    assert choice.variant.name == "digits-small" and "digits-small.onnx changed" in choice.reason


def test_outside_tolerance_is_never_chosen_even_when_forced(
    family: FamilySpec, record: VerificationRecord
) -> None:
    entry = record.variants["digits-small-int8"]
    worse = dataclasses.replace(
        record, variants={**record.variants, entry.name: dataclasses.replace(entry, accuracy_drop=0.05)}
    )
    choice = choose_variant(family, Tier.DEVICE, hardware=hardware("INT8"), record=worse)
    assert choice.variant.name == "digits-small"
    assert "outside tolerance: drop 0.050 > 0.010" in choice.reason
    with pytest.raises(ConfigError, match="outside tolerance"):
        choose_variant(family, Tier.DEVICE, hardware=hardware(), record=worse, override="int8")
    # The tolerance is the family's as configured now, not the one recorded.
    entry_drop = dataclasses.replace(entry, accuracy_drop=0.005)
    slight = dataclasses.replace(record, variants={**record.variants, entry.name: entry_drop})
    strict = dataclasses.replace(family, max_accuracy_drop=0.001)
    assert (
        choose_variant(family, Tier.DEVICE, hardware=hardware("INT8"), record=slight).variant.precision
        == "INT8"
    )
    assert (
        choose_variant(strict, Tier.DEVICE, hardware=hardware("INT8"), record=slight).variant.precision
        == "FP32"
    )


def test_override_forces_a_precision_that_is_not_native(
    family: FamilySpec, record: VerificationRecord
) -> None:
    forced = choose_variant(family, Tier.EDGE, hardware=hardware(), record=record, override="FP16")
    assert forced.variant.name == "digits-medium-fp16"
    assert forced.reason == "fp16: forced by --precision"
    fp32 = choose_variant(family, Tier.EDGE, hardware=hardware("INT8"), record=record, override="fp32")
    assert fp32.variant.name == "digits-medium"
    with pytest.raises(NotFound, match="no FP16 variant on the device tier"):
        choose_variant(family, Tier.DEVICE, hardware=hardware(), record=record, override="fp16")
    with pytest.raises(ConfigError, match="'bf16' is not one of fp32, fp16, int8"):
        choose_variant(family, Tier.DEVICE, hardware=hardware(), record=record, override="bf16")
    with pytest.raises(ConfigError, match="no verification record"):
        choose_variant(family, Tier.DEVICE, hardware=hardware(), record=None, override="int8")


def test_record_round_trips_and_malformed_is_refused(record: VerificationRecord, tmp_path: Path) -> None:
    (tmp_path / "verified.toml").write_text(format_record(record))
    again = load_verification(tmp_path)
    assert again is not None and again.variants == record.variants
    assert load_verification(tmp_path / "nowhere") is None
    (tmp_path / "verified.toml").write_text("[family]\nname = 'digits'\n")
    with pytest.raises(ConfigError, match="malformed verification record"):
        load_verification(tmp_path)


# Raspberry Pi 4 (Cortex-A72, ARMv8.0) and Pi 5 (Cortex-A76, ARMv8.2) as Linux prints them.
PI4_HWCAP = 0b1000_1000_0111  # fp asimd evtstrm crc32 cpuid
PI5_HWCAP = PI4_HWCAP | 1 << 8 | 1 << 9 | 1 << 10 | 1 << 12 | 1 << 15 | 1 << 16 | 1 << 20  # + v8.2


def test_hwcap_bits_decode_to_the_names_cpuinfo_prints() -> None:
    assert decode_hwcap(PI4_HWCAP) == ["fp", "asimd", "evtstrm", "crc32", "cpuid"]
    assert {"asimddp", "asimdhp", "fphp", "atomics", "lrcpc"} <= set(decode_hwcap(PI5_HWCAP))
    assert decode_hwcap(0, 1 << 13 | 1 << 14) == ["i8mm", "bf16"]
    assert arm_hwcap_flags(lambda kind: PI5_HWCAP if kind == 16 else 0) == decode_hwcap(PI5_HWCAP)


@pytest.mark.parametrize(
    ("hwcap", "expected", "reason"),
    [
        (PI4_HWCAP, {"FP32"}, "no native int8/fp16 on this CPU (asimd)"),
        (PI5_HWCAP, {"FP32", "INT8", "FP16"}, "cpu flags: asimddp, asimdhp, fphp"),
        (PI4_HWCAP | 1 << 20, {"FP32", "INT8"}, "cpu flags: asimddp"),  # dot product alone
        (PI4_HWCAP | 1 << 9, {"FP32", "FP16"}, "cpu flags: fphp"),  # scalar half precision alone
    ],
)
def test_arm_precisions_follow_dot_product_and_half_precision(
    hwcap: int, expected: set[str], reason: str
) -> None:
    hardware = hardware_precisions(decode_hwcap(hwcap), "aarch64")
    assert (hardware.precisions, hardware.reason) == (expected, reason)


def test_on_aarch64_the_kernels_hwcap_wins_over_a_cpuinfo_an_emulator_passed_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QEMU 7.2 shows the host's x86 cpuinfo to an aarch64 guest: HWCAP is the emulated CPU's."""
    monkeypatch.setattr(cpu, "arm_hwcap_flags", lambda: decode_hwcap(PI5_HWCAP))
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2", "avx512_vnni"})
    assert cpu.machine_flags("aarch64") == (set(decode_hwcap(PI5_HWCAP)), "hwcap")
    assert cpu.machine_flags("x86_64") == ({"avx2", "avx512_vnni"}, "/proc/cpuinfo")
    monkeypatch.setattr(cpu, "arm_hwcap_flags", lambda: [])  # no getauxval: cpuinfo it is
    assert cpu.machine_flags("aarch64")[1] == "/proc/cpuinfo"
    hardware = hardware_precisions(machine="aarch64")
    assert hardware.flags_from == "/proc/cpuinfo" and hardware.precisions == {"FP32"}


def test_stratus_cpu_flags_stands_in_and_says_so() -> None:
    hardware = this_hardware({"STRATUS_CPU_FLAGS": "avx2, avx512_vnni"})
    assert (hardware.flags, hardware.flags_from) == (("avx512_vnni",), "STRATUS_CPU_FLAGS")


def test_cpu_model_names_an_x86_cpu_and_an_arm_core(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n\nprocessor\t: 1\n")
    pi = tmp_path / "pi"
    pi.write_text("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\nCPU part\t: 0xd0b\n")
    odd = tmp_path / "odd"
    odd.write_text("processor\t: 0\nCPU implementer\t: 0x51\nCPU part\t: 0x001\n")
    assert cpu_model(x86) == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_model(pi) == "Cortex-A76"
    assert cpu_model(odd) == "" and cpu_model(tmp_path / "absent") == ""
