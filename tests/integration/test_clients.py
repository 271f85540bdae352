"""Standard clients and the on-device SDK against the real fleet."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from edge_agent.sdk import Client
from stratus import codec
from stratus.tiers import Tier

from .conftest import MODELS


def test_tritonclient_health_and_metadata(router: str) -> None:
    client = triton.InferenceServerClient(router)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits") and client.is_model_ready("digits-large")
    assert not client.is_model_ready("letters")
    server = client.get_server_metadata()
    assert server.name == "stratus" and server.version
    model = client.get_model_metadata("digits")
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [("input", "FP32", [-1, 64])]
    assert [(t.name, list(t.shape)) for t in model.outputs] == [("probabilities", [-1, 10])]
    config = client.get_model_config("digits").config
    assert config.name == "digits" and [i.name for i in config.input] == ["input"]
    # the cloud's variant, under its FP32 name whatever precision serves it: the family's tensors
    large = client.get_model_metadata("digits-large")
    assert [(t.name, list(t.shape)) for t in large.inputs] == [("input", [-1, 64])]
    assert [i.name for i in client.get_model_config("digits-large").config.input] == ["input"]


def test_tritonclient_infer(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    client = triton.InferenceServerClient(router)
    x = digits.held_out.x[:8]
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("digits", [tensor], request_id="42", parameters={"stratus.budget_ms": 5000.0})
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == (8, 10)
    assert (probabilities.argmax(axis=1) == digits.held_out.y[:8]).mean() >= 0.75
    response = result.get_response()
    assert response.id == "42"
    assert response.parameters["stratus.tier"].string_param in ("device", "edge", "cloud")


def test_tritonclient_stream_infer(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    client = triton.InferenceServerClient(router)
    answers: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for index in range(20):
            tensor = triton.InferInput("input", [1, 64], "FP32")
            tensor.set_data_from_numpy(digits.held_out.x[index : index + 1])
            client.async_stream_infer("digits", [tensor], request_id=str(index))
        received = {}
        for _ in range(20):
            result, error = answers.get(timeout=30)
            assert error is None, error
            received[result.get_response().id] = result.as_numpy("probabilities")  # type: ignore[attr-defined]
    finally:
        client.stop_stream()
    assert sorted(received, key=int) == [str(i) for i in range(20)]
    predicted = np.array([received[str(i)].argmax() for i in range(20)])
    assert (predicted == digits.held_out.y[:20]).mean() >= 0.9


def test_stream_reports_a_bad_request_without_ending_the_stream(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    client = triton.InferenceServerClient(router)
    answers: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        bad = triton.InferInput("input", [1, 63], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 63), np.float32))
        client.async_stream_infer("digits", [bad], request_id="bad")
        good = triton.InferInput("input", [1, 64], "FP32")
        good.set_data_from_numpy(digits.held_out.x[:1])
        client.async_stream_infer("digits", [good], request_id="good")
        outcomes = [answers.get(timeout=30) for _ in range(2)]
    finally:
        client.stop_stream()
    errors = [str(error) for _, error in outcomes if error is not None]
    results = [result for result, error in outcomes if error is None]
    assert len(errors) == 1 and "INVALID_ARGUMENT" in errors[0] and "does not fit" in errors[0]
    assert len(results) == 1 and results[0].get_response().id == "good"  # type: ignore[attr-defined]


def test_sdk_answers_locally_and_escalates_through_the_router(router: str, digits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with Client(MODELS, router=router, cache_dir=tmp_path) as client:
        confident = client.infer("digits", digits.held_out.x[:1], min_confidence=0.0)
        assert confident.path == (Tier.DEVICE,) and confident.agent == "sdk" and not confident.degraded
        escalated = client.infer("digits", digits.held_out.x[:1], min_confidence=1.0)
        assert escalated.path == (Tier.DEVICE, Tier.EDGE, Tier.CLOUD)
        assert escalated.tier is Tier.CLOUD and set(escalated.timings_ms) == {
            Tier.DEVICE,
            Tier.EDGE,
            Tier.CLOUD,
        }
        assert escalated.outputs["probabilities"].shape == (1, 10)


def test_sdk_async_matches_sync(router: str, digits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    async def both(client: Client) -> None:
        try:
            for min_confidence in (0.0, 1.0):
                result = await client.ainfer("digits", digits.held_out.x[2:3], min_confidence=min_confidence)
                expected = client.infer("digits", digits.held_out.x[2:3], min_confidence=min_confidence)
                assert result.path == expected.path
                np.testing.assert_allclose(
                    result.outputs["probabilities"], expected.outputs["probabilities"], atol=1e-5
                )
        finally:  # closed on this loop, even when an assertion failed
            await client.aclose()

    with Client(MODELS, router=router, cache_dir=tmp_path) as client:
        asyncio.run(both(client))


def test_sdk_without_a_reachable_router_answers_locally_marked_degraded(digits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with Client(MODELS, router="127.0.0.1:1", cache_dir=tmp_path) as client:
        result = client.infer("digits", digits.held_out.x[:1], min_confidence=1.0)
    assert result.degraded and result.path == (Tier.DEVICE,)
    assert result.outputs["probabilities"].shape == (1, 10)


def test_sdk_refuses_bad_input_before_any_hop(tmp_path: Path) -> None:
    from stratus.errors import InvalidInput

    with (
        Client(MODELS, router=None, cache_dir=tmp_path) as client,
        pytest.raises(InvalidInput, match="does not fit"),
    ):
        client.infer("digits", np.zeros((1, 10), np.float32))


def test_sdk_escalates_only_its_unsure_items_and_matches_the_router(
    router: str, digits, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from .cluster import infer

    x = digits.held_out.x[:40]
    with Client(MODELS, router=router, cache_dir=tmp_path) as client:
        result = client.infer("digits", x, min_confidence=0.99)  # stricter: some items climb
    response, served = infer(router, x, min_confidence=0.99)
    assert result.item_tiers == served.item_tiers and len(result.item_tiers) == 40
    assert Tier.DEVICE in result.item_tiers and result.tier > Tier.DEVICE  # a mixed batch
    assert result.tier == max(result.item_tiers)
    np.testing.assert_array_equal(
        result.outputs["probabilities"], codec.decode_response_outputs(response)["probabilities"]
    )


def test_sdk_waits_for_a_router_and_serves_the_precision_asked(router: str, digits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with Client(MODELS, router=router, cache_dir=tmp_path, precision="fp32") as client:
        assert client.wait_ready(timeout_s=10)
        local = client.infer("digits", digits.held_out.x[:1], min_confidence=0.0)
        assert local.variant == "digits-small" and str(local.tier) == "device"  # FP32, as asked
    with Client(MODELS, router="127.0.0.1:1", cache_dir=tmp_path) as lost:
        started = time.monotonic()
        assert not lost.wait_ready(timeout_s=0.5)
        assert time.monotonic() - started < 5


def test_model_statistics_count_what_each_server_answered(fleet, digits) -> None:  # type: ignore[no-untyped-def]
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(fleet.router.address)
    try:
        before = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
        tensor = grpcclient.InferInput("input", [3, 64], "FP32")
        tensor.set_data_from_numpy(digits.held_out.x[:3])
        client.infer("digits", [tensor])
        with pytest.raises(grpcclient.InferenceServerException):
            client.infer("digits", [grpcclient.InferInput("nope", [1], "FP32")])  # refused: a failure
        after = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
        with pytest.raises(grpcclient.InferenceServerException, match="no model 'made-up'"):
            client.get_inference_statistics("made-up")
    finally:
        client.close()
    success, fail = after["inference_stats"]["success"], after["inference_stats"]["fail"]
    assert int(after["execution_count"]) == int(before.get("execution_count", 0)) + 1
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 3
    assert int(success["count"]) == int(before["inference_stats"].get("success", {}).get("count", 0)) + 1
    assert int(fail["count"]) == int(before["inference_stats"].get("fail", {}).get("count", 0)) + 1
    assert int(success["ns"]) > 0 and int(after["last_inference"]) > 0
