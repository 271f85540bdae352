"""Bad input of every kind gets a precise status, and nobody else is disturbed.

Fuzzes ModelInfer and ModelStreamInfer on the shared fleet's router with hypothesis, and
feeds its AgentLink garbage, out-of-order and malformed messages.
"""

from __future__ import annotations

import queue
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratus.protocol import set_parameter
from stratus.serving import grpc_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import fleet_status, infer

CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}

datatypes = st.sampled_from(
    ["FP32", "FP16", "FP64", "INT8", "INT32", "INT64", "UINT8", "BOOL", "BYTES", "FP8", ""]
)
dims = st.one_of(st.integers(-3, 70), st.sampled_from([1 << 31, 1 << 40, -(1 << 40)]))
parameter_values = st.one_of(
    st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=5)
)


@st.composite
def requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(
        model_name=draw(
            st.sampled_from(["digits", "digits-small", "digits-large", "letters", "", "digits-huge"])
        )
    )
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = message.inputs.add(
            name=draw(st.sampled_from(["input", "image", ""])),
            datatype=draw(datatypes),
            shape=draw(st.lists(dims, max_size=3)),
        )
        if raw:
            message.raw_input_contents.append(draw(st.binary(max_size=300)))
        elif draw(st.booleans()):
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=70)))
    if raw and draw(st.booleans()):
        message.raw_input_contents.append(b"extra")
    for key in draw(
        st.lists(
            st.sampled_from(
                [
                    "stratus.budget_ms",
                    "stratus.min_confidence",
                    "stratus.max_tier",
                    "stratus.min_tier",
                    "stratus.bogus",
                ]
            ),
            max_size=3,
            unique=True,
        )
    ):
        set_parameter(message.parameters, key, draw(parameter_values))
    return message


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=requests())
def test_fuzzed_model_infer_gets_a_clear_status(router: str, message: pb.ModelInferRequest) -> None:
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        try:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=10)
        except grpc.RpcError as error:
            assert error.code() in CLEAR, (error.code(), error.details())
            assert error.details()


def test_the_router_still_serves_after_the_fuzzing(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    response, _ = infer(router, digits.held_out.x[:4])
    assert len(response.raw_output_contents) == 1
    assert all(a.state == fpb.AGENT_STATE_READY for a in fleet_status(router).agents)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(requests(), min_size=1, max_size=6))
def test_fuzzed_stream_answers_each_request_and_keeps_the_stream(
    router: str, batch: list[pb.ModelInferRequest]
) -> None:
    for index, message in enumerate(batch):
        message.id = str(index)
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answers = list(stub.ModelStreamInfer(iter(batch), timeout=30))
    assert sorted(a.infer_response.id for a in answers) == sorted(m.id for m in batch)
    for answer in answers:
        if answer.error_message:
            assert answer.error_message.split(":")[0] in {"INVALID_ARGUMENT", "NOT_FOUND"}, (
                answer.error_message
            )


def test_oversized_messages_are_refused(router: str) -> None:
    big = np.zeros((70_000, 64), np.float32)  # 17.9 MB, over the 16 MiB limit
    with pytest.raises(grpc.RpcError) as error:
        infer(router, big)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _raw_link(
    router: str, messages: list[bytes], *, read: bool = True
) -> tuple[list[bytes], grpc.RpcError | None]:
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        connect = channel.stream_stream(
            "/stratus.v1.AgentLink/Connect", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        received: list[bytes] = []
        try:
            for message in connect(iter(messages), timeout=5):
                received.append(message)
        except grpc.RpcError as error:
            return received, error
    return received, None


def hello(agent_id: str, **changes: object) -> fpb.AgentMessage:
    message = fpb.Hello(
        agent_id=agent_id,
        tier=fpb.TIER_DEVICE,
        capacity=1,
        variants=[fpb.VariantInfo(name="digits-small", family="digits")],
    )
    for key, value in changes.items():
        setattr(message, key, value)
    return fpb.AgentMessage(hello=message)


@pytest.mark.parametrize(
    ("messages", "code", "text"),
    [
        ([b"\xff\xfe garbage \x00\x01"], grpc.StatusCode.INTERNAL, ""),
        (
            [fpb.AgentMessage(result=fpb.Result(request_id="r1")).SerializeToString()],
            grpc.StatusCode.INVALID_ARGUMENT,
            "first message on an AgentLink must be a Hello",
        ),
        ([hello("").SerializeToString()], grpc.StatusCode.INVALID_ARGUMENT, "agent_id is empty"),
        (
            [hello("x", tier=fpb.TIER_UNSPECIFIED).SerializeToString()],
            grpc.StatusCode.INVALID_ARGUMENT,
            "tier is unspecified",
        ),
        (
            [fpb.AgentMessage(hello=fpb.Hello(agent_id="x", tier=fpb.TIER_EDGE)).SerializeToString()],
            grpc.StatusCode.INVALID_ARGUMENT,
            "no variants",
        ),
    ],
)
def test_agent_link_refuses_malformed_peers(
    router: str, messages: list[bytes], code: grpc.StatusCode, text: str
) -> None:
    _, error = _raw_link(router, messages)
    assert error is not None and error.code() == code, error
    assert text in (error.details() or "")
    assert {a.id for a in fleet_status(router).agents} >= {"device-1", "device-2", "edge-1"}


def test_duplicate_hello_and_unknown_results_drop_only_that_link(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    stray = fpb.AgentMessage(result=fpb.Result(request_id="no-such-request")).SerializeToString()
    received, _ = _raw_link(
        router, [hello("weird-peer").SerializeToString(), stray, hello("weird-peer").SerializeToString()]
    )
    assert received and fpb.RouterMessage.FromString(received[0]).HasField("welcome")
    agents = {a.id: a.state for a in fleet_status(router).agents}
    assert agents["weird-peer"] == fpb.AGENT_STATE_LOST
    assert infer(router, digits.held_out.x[:1], max_tier="device")[1].agent in {"device-1", "device-2"}


def test_a_peer_that_goes_silent_after_hello_is_dropped(router: str) -> None:
    gate: queue.Queue[bytes | None] = queue.Queue()
    gate.put(hello("mute-peer").SerializeToString())

    def outgoing():  # type: ignore[no-untyped-def]
        while (item := gate.get()) is not None:
            yield item

    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        connect = channel.stream_stream(
            "/stratus.v1.AgentLink/Connect", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        call = connect(outgoing(), timeout=20)
        started = time.monotonic()
        try:
            for _ in call:
                pass  # the router ends the stream once it counts the peer lost
        except grpc.RpcError:
            pass
        finally:
            gate.put(None)
    assert time.monotonic() - started < 10
    assert {a.id: a.state for a in fleet_status(router).agents}["mute-peer"] == fpb.AGENT_STATE_LOST
