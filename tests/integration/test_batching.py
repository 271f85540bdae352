"""Batching and per-item escalation through real processes.

Merged requests must come back exactly as they would alone, item by item; a malformed
request in a burst gets its own precise error and harms nobody else.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from stratus.convert import codec
from stratus.convert.parameters import BATCH_SIZE, Served, parameter_value, set_parameter
from stratus.serving.channels import grpc_options
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import Cluster, fleet_status, ready_count, request, wait_until
from .expected import BATCH_TOLERANCE, served_for


def ask(address: str, message: pb.ModelInferRequest) -> pb.ModelInferResponse:
    with grpc.insecure_channel(address, options=grpc_options()) as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=30)


async def burst(
    address: str, messages: list[pb.ModelInferRequest]
) -> list[pb.ModelInferResponse | grpc.aio.AioRpcError]:
    """Every message at once on one channel, as concurrent clients would send them."""
    async with grpc.aio.insecure_channel(address, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def one(message: pb.ModelInferRequest) -> pb.ModelInferResponse | grpc.aio.AioRpcError:
            try:
                return await stub.ModelInfer(message, timeout=30)
            except grpc.aio.AioRpcError as exc:
                return exc

        return list(await asyncio.gather(*(one(m) for m in messages)))


def probabilities(response: pb.ModelInferResponse) -> np.ndarray:
    return codec.decode_response_outputs(response)["probabilities"]


def test_a_mixed_batch_gives_item_by_item_exactly_what_each_item_alone_gives(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x[:60]
    sure = 0.99  # stricter than the thresholds, so that some items climb to each tier
    batch = ask(router, request(x, min_confidence=sure))
    served = Served.read(batch.parameters)
    tiers = served.item_tiers
    assert len(tiers) == 60 and served.tier == max(tiers)
    assert {Tier.DEVICE} < set(tiers), "the batch should mix device answers with escalated ones"
    together = probabilities(batch)
    for index, row in enumerate(x):
        alone = ask(router, request(row[None, :], min_confidence=sure))
        assert Served.read(alone.parameters).tier == tiers[index], index
        assert np.array_equal(probabilities(alone)[0], together[index]), index
    # only the unsure items climbed: the path went up, yet most items stayed on the device
    assert served.path[0] is Tier.DEVICE and tiers.count(Tier.DEVICE) > 20


def test_typed_clients_get_typed_answers_from_a_per_item_climb(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x[:60]
    sure = 0.99  # as above: some items climb, most stay on the device
    typed = pb.ModelInferRequest(model_name="digits")
    codec.encode_request_inputs(typed, {"input": x}, raw=False)
    set_parameter(typed.parameters, "stratus.min_confidence", sure)
    response = ask(router, typed)
    tiers = Served.read(response.parameters).item_tiers
    assert len(tiers) == 60 and {Tier.DEVICE} < set(tiers), "the items should climb to different tiers"
    assert not response.raw_output_contents and len(response.outputs[0].contents.fp32_contents) == 600
    raw = ask(router, request(x, min_confidence=sure))
    assert np.array_equal(probabilities(response), probabilities(raw))


def test_a_malformed_request_in_a_burst_gets_its_own_error_and_harms_nobody(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x[:40]
    good = [request(row[None, :], max_tier="device") for row in x]
    short = request(np.zeros((1, 64), np.float32))
    short.raw_input_contents[0] = short.raw_input_contents[0][:100]
    wide = request(np.zeros((1, 65), np.float32))
    doubles = request(np.zeros((1, 64), np.float64))
    messages = [*good[:13], short, *good[13:27], wide, *good[27:], doubles]
    answers = asyncio.run(burst(router, messages))
    errors = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert "raw buffer holds 100 bytes" in errors[0].details()
    assert "shape [1, 65] does not fit" in errors[1].details()
    assert "datatype is FP64" in errors[2].details()
    answered = [a for a in answers if not isinstance(a, grpc.aio.AioRpcError)]
    expected = probabilities(ask(router, request(x, max_tier="device")))
    assert np.array_equal(np.concatenate([probabilities(a) for a in answered]), expected)


def _device_fleet(cluster: Cluster, name: str, *agent_flags: str) -> str:
    router = cluster.router(role=f"router-{name}").address
    # a queue deep enough for the whole burst, so that nothing is refused either way
    cluster.agent(
        name, router, "--concurrency", "1", "--queue-limit", "128", "--emulate-slow-ms", "3", *agent_flags
    )
    wait_until(lambda: ready_count(router) == 1)
    return router


def test_batched_and_unbatched_answers_are_identical(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    batching = _device_fleet(cluster, "batching")
    single = _device_fleet(cluster, "single", "--max-batch", "1")
    messages = [request(row[None, :], max_tier="device") for row in digits.held_out.x[:96]]
    merged = asyncio.run(burst(batching, messages))
    alone = asyncio.run(burst(single, messages))
    failed = [a for a in merged + alone if not isinstance(a, pb.ModelInferResponse)]
    assert not failed, failed[:1]
    for a, b in zip(merged, alone, strict=True):
        assert isinstance(a, pb.ModelInferResponse) and isinstance(b, pb.ModelInferResponse)
        assert np.array_equal(probabilities(a), probabilities(b))
    (batched_agent,) = fleet_status(batching).agents
    (single_agent,) = fleet_status(single).agents
    # Requests really were merged: 96 at once on one slot held 3 ms a call cannot all run alone.
    assert batched_agent.mean_batch_size >= 1.5, batched_agent.mean_batch_size
    assert single_agent.mean_batch_size == 1.0


def test_cloud_gateway_batches_direct_clients_and_answers_each_alone(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud("--concurrency", "1", "--emulate-slow-ms", "3").address
    x = digits.held_out.x[:64]
    messages = [request(row[None, :], model="digits-large") for row in x]
    for message in messages[::7]:
        set_parameter(message.parameters, "stratus.budget_ms", 5000.0)
    answers = asyncio.run(burst(cloud, messages))
    responses = [a for a in answers if isinstance(a, pb.ModelInferResponse)]
    assert len(responses) == len(answers), [a for a in answers if not isinstance(a, pb.ModelInferResponse)][:1]
    rows = np.concatenate([probabilities(a) for a in responses])
    whole = probabilities(ask(cloud, request(x, model="digits-large")))
    np.testing.assert_allclose(rows, whole, rtol=0, atol=BATCH_TOLERANCE[served_for("digits-large").precision])
    assert np.array_equal(rows.argmax(axis=1), whole.argmax(axis=1))
    sizes = [parameter_value(a.parameters[BATCH_SIZE]) for a in responses]
    assert max(sizes) > 1  # some requests ran merged with others
