"""Standard clients and the on-device SDK against the real fleet."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from edge_agent.sdk import Client
from stratus.convert import codec
from stratus.tiers import Tier

from .conftest import MODELS
from .expected import served_for


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


def tensors(metadata: object) -> tuple[list[tuple[str, str, list[int]]], ...]:
    """A ModelMetadata's inputs and outputs as (name, datatype, shape)."""
    return tuple(
        [(t.name, t.datatype, list(t.shape)) for t in getattr(metadata, kind)]  # type: ignore[attr-defined]
        for kind in ("inputs", "outputs")
    )


@pytest.mark.parametrize("variant", ["digits-large", "defects-large", "arith-large"])
def test_a_cloud_only_variant_is_described_as_the_cloud_describes_it(fleet, variant: str) -> None:  # type: ignore[no-untyped-def]
    """No agent serves these (the fleet's agents are device and edge): the router's metadata is
    the cloud gateway's own, fetched from it directly, and its config agrees with both."""
    router = triton.InferenceServerClient(fleet.router.address)
    cloud = triton.InferenceServerClient(fleet.cloud.address)
    ours, theirs = router.get_model_metadata(variant), cloud.get_model_metadata(variant)
    assert tensors(ours) == tensors(theirs) and tensors(ours)[0], (ours, theirs)
    assert list(ours.versions) == list(theirs.versions) == ["1"]  # a variant is a model, not a version
    config = router.get_model_config(variant).config
    batched = config.max_batch_size > 0  # then dims leave out the batch dimension, as in Triton
    inputs = [(i.name, [-1, *i.dims] if batched else list(i.dims)) for i in config.input]
    assert inputs == [(name, shape) for name, _, shape in tensors(theirs)[0]]
    assert config.max_batch_size == cloud.get_model_config(variant).config.max_batch_size


def test_versions_are_model_versions_everywhere(router: str) -> None:
    """Every model has one version, "1": ready, described and listed as such; any other is
    no model at all, and says so."""
    client = triton.InferenceServerClient(router)
    assert client.is_model_ready("digits", "1") and client.is_model_ready("digits-small", "1")
    assert not client.is_model_ready("digits", "2")
    assert list(client.get_model_metadata("digits", "1").versions) == ["1"]
    assert {m.version for m in client.get_model_repository_index().models} == {"1"}
    with pytest.raises(triton.InferenceServerException, match="has no version '2'") as refused:
        client.get_model_metadata("digits", "2")
    assert refused.value.status() == "StatusCode.NOT_FOUND"
    x = triton.InferInput("input", [1, 64], "FP32")
    x.set_data_from_numpy(np.zeros((1, 64), np.float32))
    with pytest.raises(triton.InferenceServerException, match="has no version '7'"):
        client.infer("digits", [x], model_version="7")
    assert client.infer("digits", [x], model_version="1").as_numpy("probabilities").shape == (1, 10)


def test_a_family_config_names_its_variants_and_each_tiers_line(router: str) -> None:
    config = triton.InferenceServerClient(router).get_model_config("digits").config
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert parameters["stratus.current.device"] == "digits-small"  # models/digits/family.toml [current]
    assert parameters["stratus.current.edge"] == "digits-medium"
    assert {"digits-small", "digits-medium", "digits-large"} <= set(parameters["stratus.variants"].split(","))


def test_not_found_lists_every_name_that_works_as_the_index_does(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    import re

    client = triton.InferenceServerClient(router)
    x = triton.InferInput("input", [1, 64], "FP32")
    x.set_data_from_numpy(digits.held_out.x[:1])
    with pytest.raises(triton.InferenceServerException) as refused:
        client.infer("digts", [x])
    assert refused.value.status() == "StatusCode.NOT_FOUND"
    found = re.search(r"the fleet serves \[(.*)\]", refused.value.message())
    assert found is not None, refused.value.message()
    listed = found.group(1).split(", ")
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert set(listed) == set(index) and index["digits-large"] == "READY"
    assert listed[:3] == ["arith", "defects", "digits"]  # families first
    assert "digits-large" in listed  # only the cloud serves it ...
    pinned = client.infer("digits-large", [x]).get_response().parameters  # ... and pinned, it answers
    assert (pinned["stratus.tier"].string_param, pinned["stratus.variant"].string_param) == (
        "cloud",
        served_for("digits-large").name,  # the precision this hardware serves (FP16 where it can)
    )
    for name in (n for n in listed if n.startswith("digits") and index[n] == "READY"):  # each works pinned
        answer = client.infer(name, [x])
        assert answer.as_numpy("probabilities").shape == (1, 10), name


def stats_of(address: str, model: str) -> dict[str, int]:
    """One model's ModelStatistics as tritonclient reads it, flattened to counts and times."""
    client = triton.InferenceServerClient(address)
    try:
        (stats,) = client.get_inference_statistics(model, as_json=True)["model_stats"]
    finally:
        client.close()
    flat = {key: int(stats.get(key, 0)) for key in ("inference_count", "execution_count")}
    for kind in ("success", "fail", "queue", "compute_infer"):
        entry = stats["inference_stats"].get(kind, {})
        flat[f"{kind}.count"], flat[f"{kind}.ns"] = int(entry.get("count", 0)), int(entry.get("ns", 0))
    return flat


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}


@pytest.mark.parametrize(
    ("model", "sizes", "at_cloud"),
    [
        ("digits", [1, 2, 5], 0),  # a family: settled where it starts, as asked
        ("digits-small", [3, 1], None),  # pinned to a device variant, which the cloud does not have
        ("digits-large", [2, 4], 2),  # only the cloud serves it
    ],
)
def test_statistics_through_the_router_count_each_model_as_sent(  # type: ignore[no-untyped-def]
    fleet, digits, model: str, sizes: list[int], at_cloud: int | None
) -> None:
    router = fleet.router.address
    before = stats_of(router, model)
    cloud_before = stats_of(fleet.cloud.address, model) if at_cloud is not None else {}
    client = triton.InferenceServerClient(router)
    try:
        for size in sizes:
            x = triton.InferInput("input", [size, 64], "FP32")
            x.set_data_from_numpy(digits.held_out.x[:size])
            client.infer(model, [x], parameters={"stratus.min_confidence": 0.0})  # answered where it starts
        bad = triton.InferInput("input", [1, 63], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 63), np.float32))
        with pytest.raises(triton.InferenceServerException, match="does not fit"):
            client.infer(model, [bad])
    finally:
        client.close()
    change = delta(stats_of(router, model), before)
    sent = len(sizes)
    assert (change["execution_count"], change["inference_count"]) == (sent, sum(sizes))
    assert (change["success.count"], change["fail.count"]) == (sent, 1)
    assert change["queue.count"] == change["compute_infer.count"] == sent  # each answer said both
    assert change["compute_infer.ns"] > 0 and change["fail.ns"] > 0
    # Waiting and running are parts of a request's time, never more than all of it.
    assert change["queue.ns"] + change["compute_infer.ns"] <= change["success.ns"]
    if at_cloud is not None:
        cloud = delta(stats_of(fleet.cloud.address, model), cloud_before)
        assert cloud["execution_count"] == at_cloud and cloud["fail.count"] == 0  # refused at the router


def test_sdk_tiers_bound_where_it_answers_as_the_routers_do(router: str, digits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x[:4]
    with Client(MODELS, router=router, cache_dir=tmp_path) as client:
        skipped = client.infer("digits", x, min_tier="edge", min_confidence=0.0)
        assert skipped.path == (Tier.EDGE,) and skipped.agent == "edge-1" and not skipped.degraded
        assert set(skipped.item_tiers) == {Tier.EDGE}
        assert skipped.outputs["probabilities"].shape == (4, 10)
        held = client.infer("digits", x, max_tier=Tier.EDGE, min_confidence=1.0)  # nothing is that sure
        assert held.path == (Tier.DEVICE, Tier.EDGE) and held.tier is Tier.EDGE and not held.degraded
        assert held.reason.startswith("stratus.max_tier=edge: ") and "below the edge threshold" in held.reason
        local = client.infer("digits", x, max_tier="device", min_confidence=1.0)
        assert local.path == (Tier.DEVICE,) and local.agent == "sdk" and not local.degraded
        assert local.reason.startswith("stratus.max_tier=device: ") and "below the device threshold" in local.reason
    from .cluster import infer

    _, served = infer(router, x, max_tier="edge", min_confidence=1.0)
    assert held.reason == served.reason and held.item_tiers == served.item_tiers  # said alike
