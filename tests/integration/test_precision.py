"""Which precision an agent serves: native on its CPU and within tolerance, or as forced."""

from __future__ import annotations

import pytest

from stratus.errors import Unavailable

from .cluster import Cluster, fleet_status, infer, ready_count, wait_until


def _choices(router: str) -> dict[str, tuple[list[str], list[str]]]:
    """Each agent's digits variants and the reasons for them (agents serve every family)."""
    return {
        a.id: (
            [v for v in a.variants if v.startswith("digits-")],
            [c for c in a.variant_choices if c.startswith("digits-")],
        )
        for a in fleet_status(router).agents
    }


@pytest.mark.parametrize(
    ("name", "tier", "flags", "variant", "reason"),
    [
        (
            "plain",
            "device",
            "avx2,f16c,fma",
            "digits-small",
            "fp32: no native int8/fp16 on this CPU (avx2, f16c, fma)",
        ),
        ("vnni", "device", "avx2,avx512_vnni", "digits-small-int8", "int8: native (cpu flags: avx512_vnni)"),
        ("fp16", "edge", "avx2,avx512_fp16", "digits-medium-fp16", "fp16: native (cpu flags: avx512_fp16)"),
        (
            "amx",
            "edge",
            "amx_int8,amx_fp16",
            "digits-medium-int8",
            "int8: native (cpu flags: amx_int8, amx_fp16)",
        ),
    ],
)
def test_agents_pick_the_native_precision_and_say_why(  # type: ignore[no-untyped-def]
    cluster: Cluster, digits, name: str, tier: str, flags: str, variant: str, reason: str
) -> None:
    router = cluster.router().address
    cluster.agent(name, router, tier=tier, env={"STRATUS_CPU_FLAGS": flags})
    wait_until(lambda: ready_count(router) == 1)
    variants, choices = _choices(router)[name]
    assert variants == [variant]
    assert len(choices) == 1 and choices[0].startswith(f"{variant} ") and reason in choices[0]
    _, served = infer(router, digits.held_out.x[:4], min_confidence=0.0)
    assert served.variant == variant


def test_precision_flag_forces_a_verified_variant_and_the_family_answers(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router().address
    cluster.agent("forced", router, "--precision", "int8")
    wait_until(lambda: ready_count(router) == 1)
    variants, choices = _choices(router)["forced"]
    assert variants == ["digits-small-int8"] and "int8: forced by --precision" in choices[0]
    response, served = infer(router, digits.held_out.x[:30], max_tier="device")
    assert served.variant == "digits-small-int8"
    assert response.outputs[0].shape == [30, 10]


def test_precision_fp32_forces_the_parent_where_the_cpu_would_choose_int8(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router().address
    amx = {"STRATUS_CPU_FLAGS": "avx512f,avx512_vnni,avx512_bf16,avx512_fp16,amx_int8,amx_bf16"}
    cluster.agent("fp32", router, "--precision", "fp32", env=amx)
    wait_until(lambda: ready_count(router) == 1)
    variants, choices = _choices(router)["fp32"]
    assert variants == ["digits-small"] and "fp32: forced by --precision" in choices[0]
    _, served = infer(router, digits.held_out.x[:3], model="digits-small")
    assert (served.variant, served.precision) == ("digits-small", "FP32")


def test_a_precision_the_tier_does_not_have_is_refused_at_start(cluster: Cluster) -> None:
    router = cluster.router().address
    with pytest.raises(Unavailable, match="has no FP16 variant on the device tier"):
        cluster.agent("nofp16", router, "--precision", "fp16")
    assert list(fleet_status(router).agents) == []


def test_the_arithmetic_a_runtime_computes_in_is_shown_and_answered(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    """An FP16 child forced on any CPU: OpenVINO computes it in f16 only where its plugin
    has FP16 arithmetic, and in f32 elsewhere (never bf16 unannounced), and both the fleet
    status and each answer say which."""
    import openvino

    router = cluster.router().address
    cluster.agent("fp16", router, "--precision", "fp16", tier="edge")
    wait_until(lambda: ready_count(router) == 1)
    _, choices = _choices(router)["fp16"]
    fp16_here = "FP16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    expected = "f16" if fp16_here else "f32"
    assert len(choices) == 1 and choices[0].startswith(f"digits-medium-fp16 FP16, computes {expected} ")
    _, served = infer(router, digits.held_out.x[:5], max_tier="edge", min_confidence=0.0)
    assert (served.variant, served.precision, served.compute) == ("digits-medium-fp16", "FP16", expected)
