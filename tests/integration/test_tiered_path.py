"""The whole tiered path through real processes: routing, escalation, pinning, limits."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

from stratus.cli.demo import Fleet, through_gateway
from stratus.convert import codec
from stratus.convert.parameters import Served, set_parameter
from stratus.execution.loading import LocalSettings
from stratus.execution.local_models import LocalModels
from stratus.execution.running import score
from stratus.families.repository import ModelRepository
from stratus.serving.channels import grpc_options
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .conftest import MODELS
from .expected import served_for, sum_tolerance


def call(router: str, model: str, x: np.ndarray, **parameters: object) -> pb.ModelInferResponse:
    request = pb.ModelInferRequest(model_name=model, id="t1")
    codec.encode_request_inputs(request, {"input": x})
    for key, value in parameters.items():
        set_parameter(request.parameters, f"stratus.{key}", value)  # type: ignore[arg-type]
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)


def test_cascade_on_the_held_out_split_matches_digits_large_within_the_cloud_share(
    router: str, digits
) -> None:  # type: ignore[no-untyped-def]
    cascade = asyncio.run(through_gateway(router, digits.held_out))
    pinned = asyncio.run(through_gateway(router, digits.held_out, model="digits-large"))
    assert pinned.tiers["cloud"] == 1.0
    assert cascade.accuracy >= pinned.accuracy
    assert cascade.tiers["cloud"] <= 0.08
    assert cascade.tiers["device"] > 0.5  # most requests never leave the device tier
    assert cascade.degraded == 0


def test_escalation_happens_exactly_below_the_device_threshold(router: str, digits, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Predicted with what the device agents serve: the child this CPU chooses (digits-small-int8
    where it has INT8 dot products) in the runtime an agent picks for it (LiteRT on a device),
    not the FP32 parent on ONNX Runtime, whose confidences lie up to 3e-2 from the child's."""
    repository = ModelRepository.load(MODELS)
    threshold = repository.family("digits").thresholds[Tier.DEVICE]
    child = served_for("digits-small")
    local = LocalModels(repository, LocalSettings(variants=[child.name], cache_dir=tmp_path))
    try:
        x = digits.held_out.x[:150]
        family = repository.family("digits")
        outputs = local.runners[child.name].infer({"input": x})
        confidences = score(family, child, outputs)  # at its temperature
    finally:
        local.close()
    checked = 0
    for row, conf in zip(x, confidences, strict=True):
        if abs(conf - threshold) < 1e-4:  # the same file in the same runtime; stay clear of the edge
            continue
        served = Served.read(call(router, "digits", row[None, :]).parameters)
        assert (served.path == (Tier.DEVICE,)) == (conf >= threshold), (conf, threshold, served.path)
        checked += 1
    assert checked > 100


def test_min_confidence_overrides_the_thresholds(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x[:1]
    always_up = Served.read(call(router, "digits", x, min_confidence=1.0).parameters)
    assert always_up.path == (Tier.DEVICE, Tier.EDGE, Tier.CLOUD) and always_up.tier is Tier.CLOUD
    never_up = Served.read(call(router, "digits", x, min_confidence=0.0).parameters)
    assert never_up.path == (Tier.DEVICE,)


def test_max_tier_device_never_leaves_the_device_tier(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    for row in digits.held_out.x[:40]:
        served = Served.read(
            call(router, "digits", row[None, :], max_tier="device", min_confidence=1.0).parameters
        )
        assert served.path == (Tier.DEVICE,) and served.tier is Tier.DEVICE
        assert not served.degraded


@pytest.mark.parametrize(
    ("variant", "tier"),
    [("digits-small", Tier.DEVICE), ("digits-medium", Tier.EDGE), ("digits-large", Tier.CLOUD)],
)
def test_a_pinned_variant_runs_exactly_there(router: str, digits, variant: str, tier: Tier) -> None:  # type: ignore[no-untyped-def]
    """The FP32 name keeps working whatever precision serves it; the answer names the child."""
    response = call(router, variant, digits.held_out.x[:3], min_confidence=1.0)
    served = Served.read(response.parameters)
    child = served_for(variant)
    assert served.path == (tier,) and (served.variant, served.precision) == (child.name, child.precision)
    assert variant in (child.name, child.parent)
    assert response.model_name == variant and response.id == "t1"
    assert codec.decode_response_outputs(response)["probabilities"].shape == (3, 10)


def test_a_batch_answers_every_item_with_the_family_outputs(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    response = call(router, "digits", digits.held_out.x[:17])
    probabilities = codec.decode_response_outputs(response)["probabilities"]
    assert probabilities.shape == (17, 10)
    tolerance = sum_tolerance("digits-small", "digits-medium", "digits-large")
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=tolerance)
    assert (probabilities.argmax(axis=1) == digits.held_out.y[:17]).mean() > 0.9


@pytest.mark.parametrize(
    ("model", "x", "parameters", "code", "message"),
    [
        (
            "digits",
            np.zeros((1, 63), np.float32),
            {},
            grpc.StatusCode.INVALID_ARGUMENT,
            "does not fit the model's",
        ),
        ("digits", np.zeros((1, 64), np.float64), {}, grpc.StatusCode.INVALID_ARGUMENT, "datatype is FP64"),
        ("letters", np.zeros((1, 64), np.float32), {}, grpc.StatusCode.NOT_FOUND, "unknown model 'letters'"),
        (
            "digits",
            np.zeros((1, 64), np.float32),
            {"budget_ms": "soon"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "'stratus.budget_ms' must be a double",
        ),
        (
            "digits",
            np.zeros((1, 64), np.float32),
            {"max_tier": "fog"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown tier 'fog'",
        ),
        (
            "digits",
            np.zeros((1, 64), np.float32),
            {"colour": "red"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown request parameter",
        ),
    ],
)
def test_bad_requests_get_a_precise_status(
    router: str, model: str, x: np.ndarray, parameters: dict[str, object], code: grpc.StatusCode, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as error:
        call(router, model, x, **parameters)
    assert error.value.code() == code
    assert message in error.value.details()


def test_fleet_status_lists_every_agent_and_the_cloud_link(fleet: Fleet) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", "status", "--router", fleet.router.address, "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    agents = {a["id"]: a for a in status["agents"]}  # nothing else links to the shared fleet
    assert set(agents) == {"device-1", "device-2", "edge-1"}
    assert {a["tier"] for a in agents.values()} == {"device", "edge"}
    # Each heard from within the three heartbeats after which it would be counted lost.
    beat = status["heartbeat_interval_s"]
    assert all(a["state"] == "ready" and a["last_heartbeat_s"] < 3 * beat for a in agents.values()), beat
    assert [v for v in agents["edge-1"]["variants"] if v.startswith("digits-")] == [served_for("digits-medium").name]
    assert {"p50", "p99"} == set(agents["device-1"]["latency_ms"])
    assert (status["cloud"]["address"], status["cloud"]["state"]) == (fleet.cloud.address, "connected")
    assert "digits" in {model["name"] for model in status["cloud"]["models"]}
    tiers = {t["tier"]: t for t in status["tiers"]}
    assert (tiers["device"]["ready"], tiers["edge"]["ready"], tiers["edge"]["lost"]) == (2, 1, 0)

    def table(*extra: str) -> str:
        command = [sys.executable, "-m", "stratus.cli", "fleet", "status", "--router", fleet.router.address]
        return subprocess.run(
            [*command, *extra], check=False, capture_output=True, text=True, timeout=60
        ).stdout

    summary, listing = table(), table("--agents")
    assert "device-1" not in summary and "cloud link" in summary
    assert [line.split()[:2] for line in summary.splitlines() if line.startswith("edge")] == [["edge", "1"]]
    assert "device-1" in listing and "edge-1" in listing and "cloud link" in listing
