"""Every request is bounded before it costs anything (the security review's F5-F7, F18, F21).

Each request here once froze the router's loop, grew its memory by hundreds of MB, gave
INTERNAL with a traceback, or tore down every agent's link. Each must now be refused alone,
precisely, while the links stay up and the next ordinary request is answered.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from stratus.convert.inference import MAX_PROMPT_BYTES
from stratus.convert.parameters import set_parameter
from stratus.convert.tensors import MAX_REQUEST_ITEMS
from stratus.convert.wire_scan import MAX_TYPED_BYTES
from stratus.families.generation import MAX_TOKENS, TEXT_INPUT
from stratus.serving.channels import MAX_MESSAGE_BYTES, MAX_WORK_BYTES, grpc_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import Cluster, fleet_status, infer, ready_count, wait_until


@pytest.fixture
def router(cluster: Cluster) -> str:
    address = cluster.router().address
    cluster.agent("dev-1", address)
    wait_until(lambda: ready_count(address) == 1, timeout_s=30)
    return address


def send(router: str, request: pb.ModelInferRequest, timeout_s: float = 30.0) -> grpc.RpcError:
    """The router's refusal of ``request`` (the test fails if it answers)."""
    with grpc.insecure_channel(router, options=grpc_options()) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=timeout_s)
    return refused.value


def still_whole(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    """No agent was lost, and an ordinary request is answered."""
    assert [a.state for a in fleet_status(router).agents] == [fpb.AGENT_STATE_READY]
    _, served = infer(router, digits.held_out.x[:1], max_tier="device")
    assert served.agent == "dev-1"


def test_many_inputs_are_refused_by_count_before_any_is_read(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    request = pb.ModelInferRequest(model_name="digits")
    for index in range(20_000):  # each an empty [0] tensor: about 16 bytes on the wire
        request.inputs.add(name=f"x{index}", datatype="FP32", shape=[0])
    refused = send(router, request)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == "the request holds more than 64 inputs; at most 64 are taken"
    still_whole(router, digits)


def test_typed_contents_are_bounded_from_their_bytes_then_checked_against_the_family(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    """2 M typed INT64 zeros (2 MB sent, 16 MB parsed) are refused from their bytes, before
    gRPC's parse; 100,000 of them are parsed, and the datatype is refused first. Their count does
    not fit the shape either, so a decode-first router would say that instead."""
    request = pb.ModelInferRequest(model_name="digits")
    tensor = request.inputs.add(name="input", datatype="INT64", shape=[1, 64])
    tensor.contents.int64_contents.extend(np.zeros(2_000_000, np.int64).tolist())
    refused = send(router, request)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == (
        f"input #1: typed contents would take over {MAX_TYPED_BYTES} bytes once parsed; "
        "send a tensor this large as raw_input_contents"
    )
    del tensor.contents.int64_contents[100_000:]
    refused = send(router, request)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == "input 'input': datatype is INT64, the model takes FP32"
    still_whole(router, digits)


def test_an_empty_tensor_with_huge_dimensions_is_invalid_not_internal(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    request = pb.ModelInferRequest(model_name="digits-small")
    request.inputs.add(name="input", datatype="FP32", shape=[0, 2**40, 2**40])
    refused = send(router, request)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than the limit of" in refused.details()
    still_whole(router, digits)


def test_a_request_whose_work_comes_near_the_link_limit_is_refused_alone_by_the_item_cap(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    """Inside the router's 4 MiB receive limit, but within 64 KiB of what one message on the
    AgentLink may carry (a Work over it ends the agent's stream and every request on it):
    refused before it is queued, and the link stays. For digits the item cap (1,024, the
    advertised max_batch_size) now refuses it first; a family with larger items meets the
    Work-size check itself (tests/unit/test_link_limits.py)."""
    rows = MAX_WORK_BYTES // (64 * 4) + 64
    request = pb.ModelInferRequest(model_name="digits")
    request.inputs.add(name="input", datatype="FP32", shape=[rows, 64])
    request.raw_input_contents.append(np.zeros((rows, 64), np.float32).tobytes())
    set_parameter(request.parameters, "stratus.max_tier", "device")
    set_parameter(request.parameters, "stratus.budget_ms", 600_000.0)  # so the policy lets it go
    refused = send(router, request, timeout_s=600.0)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"holds {rows} items; a request may hold at most {MAX_REQUEST_ITEMS}" in refused.details()
    still_whole(router, digits)


def test_a_budget_past_the_limit_is_refused(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as refused:
        infer(router, digits.held_out.x[:1], budget_ms=1e12)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must lie in (0, 600000] ms" in refused.value.details()


def prompt(text: bytes, **parameters: object) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="arith")
    request.inputs.add(name=TEXT_INPUT, datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
    set_parameter(request.parameters, MAX_TOKENS, 4)
    for key, value in parameters.items():
        set_parameter(request.parameters, key, value)  # type: ignore[arg-type]
    return request


def padded_to(request: pb.ModelInferRequest, size: int) -> pb.ModelInferRequest:
    """``request`` with a non-Stratus parameter that brings it to exactly ``size`` bytes."""
    set_parameter(request.parameters, "padding", "")
    for _ in range(3):  # the length prefixes grow with the padding: converge in a step or two
        padding = request.parameters["padding"].string_param
        set_parameter(request.parameters, "padding", "x" * (len(padding) + size - request.ByteSize()))
    assert request.ByteSize() == size
    return request


def test_generative_works_carry_the_checked_prompt_only(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    """A prompt over the bound is refused; a small prompt padded with parameters to 8 bytes
    under the 4 MiB limit is answered, since its Work carries only the prompt (the whole
    request, wrapped in a Work, went over the limit and ended every link that serves the
    family, one after the other)."""
    refused = send(router, prompt(b"1" * (MAX_PROMPT_BYTES + 1)))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == f"the prompt is {MAX_PROMPT_BYTES + 5} bytes; at most {MAX_PROMPT_BYTES} are taken"
    padded = padded_to(prompt(b"37+48="), MAX_MESSAGE_BYTES - 8)  # the client's own limit allows it
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        answer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(padded, timeout=30)
    assert answer.outputs[0].name == "text_output"
    still_whole(router, digits)


def test_a_streamed_request_refused_from_its_bytes_keeps_its_id_and_the_stream(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    """Streams take requests as bytes too: one over a bound is answered with its error, under
    its own id, and the next request on the stream is served."""
    x = digits.held_out.x[:1].astype(np.float32)
    good = pb.ModelInferRequest(model_name="digits", id="good")
    good.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    good.raw_input_contents.append(x.tobytes())
    bad = pb.ModelInferRequest()
    bad.CopyFrom(good)
    bad.id = "bad"
    bad.raw_input_contents.extend([b""] * 64)
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        answers = list(pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([bad, good]), timeout=30))
    by_id = {a.infer_response.id: a for a in answers}
    assert set(by_id) == {"bad", "good"}
    assert by_id["bad"].error_message == (
        "INVALID_ARGUMENT: the request holds more than 64 raw_input_contents buffers; at most 64 are taken"
    )
    assert by_id["bad"].infer_response.model_name == "digits"
    assert by_id["good"].error_message == ""
    assert by_id["good"].infer_response.outputs
