"""The TensorRT runtime's parts that need no GPU: cache key, profile, flags, buffer sizes."""

from __future__ import annotations

import dataclasses

import pytest

from stratus.errors import InvalidInput
from stratus.families.spec import TensorSpec
from stratus.runtimes.tensorrt_rt import (
    BatchProfile,
    GpuIdentity,
    buffer_bytes,
    builder_flag_names,
    engine_cache_key,
)

H200 = GpuIdentity(name="NVIDIA H200", compute_capability=(9, 0))
BASE = {
    "trt_version": "10.13.0",
    "gpu": H200,
    "profile": BatchProfile(),
    "onnx_digest": "abc123",
    "precision": "FP16",
}


def test_cache_key_is_stable_and_names_version_and_arch() -> None:
    key = engine_cache_key(**BASE)
    assert key == engine_cache_key(**BASE)
    assert key.startswith("trt10.13.0-sm90-")
    assert "/" not in key and " " not in key


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("trt_version", "11.0.0"),
        ("gpu", GpuIdentity(name="NVIDIA H100", compute_capability=(9, 0))),
        ("gpu", GpuIdentity(name="NVIDIA H200", compute_capability=(8, 9))),
        ("profile", BatchProfile(max_batch=128)),
        ("onnx_digest", "abc124"),
        ("precision", "FP32"),
    ],
)
def test_cache_key_changes_with_every_part(field: str, value: object) -> None:
    assert engine_cache_key(**{**BASE, field: value}) != engine_cache_key(**BASE)


def test_profile_shapes_fill_the_batch_dimension() -> None:
    spec = TensorSpec(name="input", datatype="FP32", shape=(-1, 64))
    assert BatchProfile(min_batch=1, opt_batch=8, max_batch=64).shapes(spec) == ((1, 64), (8, 64), (64, 64))
    with pytest.raises(ValueError, match="min <= opt <= max"):
        BatchProfile(min_batch=4, opt_batch=2, max_batch=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        BatchProfile().max_batch = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("major", "precision", "flags"),
    [(10, "FP32", ()), (10, "FP16", ("FP16",)), (10, "INT8", ("INT8",)), (11, "FP16", ()), (11, "INT8", ())],
)
def test_builder_flags_follow_the_tensorrt_major(major: int, precision: str, flags: tuple[str, ...]) -> None:
    assert builder_flag_names(trt_major=major, precision=precision) == flags


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(InvalidInput, match="unknown precision 'FP4'"):
        builder_flag_names(trt_major=10, precision="FP4")


def test_buffer_bytes_at_max_batch() -> None:
    assert buffer_bytes(TensorSpec(name="input", datatype="FP32", shape=(-1, 64)), 64) == 64 * 64 * 4
    assert buffer_bytes(TensorSpec(name="p", datatype="FP16", shape=(-1, 10)), 8) == 8 * 10 * 2
