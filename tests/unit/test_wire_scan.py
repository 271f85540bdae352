"""A request's bytes are bounded before protobuf parses them (stratus/convert/wire_scan.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stratus.convert.wire_scan import (
    MAX_CONTENTS_FIELDS,
    MAX_PARAMETERS,
    MAX_TYPED_BYTES,
    read_infer_request,
    request_header,
)
from stratus.errors import InvalidInput
from stratus.wire import inference_pb2 as pb


def digits_request(rows: int = 2) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="digits", id="req-7")
    request.parameters["stratus.max_tier"].string_param = "edge"
    request.parameters["stratus.budget_ms"].double_param = 50.0
    request.inputs.add(name="input", datatype="FP32", shape=[rows, 64])
    request.raw_input_contents.append(np.arange(rows * 64, dtype=np.float32).tobytes())
    request.outputs.add(name="probabilities").parameters["classification"].int64_param = 2
    return request


def refusal(request: pb.ModelInferRequest | bytes) -> str:
    raw = request if isinstance(request, bytes) else request.SerializeToString()
    with pytest.raises(InvalidInput) as refused:
        read_infer_request(raw)
    return str(refused.value)


def test_what_clients_send_parses_as_it_was_sent() -> None:
    raw_request = digits_request()
    typed = pb.ModelInferRequest(model_name="digits")
    typed.inputs.add(name="input", datatype="FP32", shape=[1, 64]).contents.fp32_contents.extend([0.5] * 64)
    prompts = pb.ModelInferRequest(model_name="arith")
    prompts.inputs.add(name="text_input", datatype="BYTES", shape=[3]).contents.bytes_contents.extend(
        [b"1+1=", b"2+2=", b"x" * 100_000]
    )
    unpacked = pb.ModelInferRequest(model_name="m")  # one field per dimension: legal protobuf
    unpacked_bytes = unpacked.SerializeToString() + bytes([0x2A, 6, 0x18, 2, 0x18, 3, 0x18, 4])
    for request in (raw_request, typed, prompts):
        assert read_infer_request(request.SerializeToString()) == request
    assert list(read_infer_request(unpacked_bytes).inputs[0].shape) == [2, 3, 4]


def test_inputs_outputs_and_buffers_past_64_are_refused_on_the_65th() -> None:
    many_inputs = pb.ModelInferRequest(model_name="digits")
    for index in range(20_000):
        many_inputs.inputs.add(name=f"x{index}", datatype="FP32", shape=[0])
    assert refusal(many_inputs) == "the request holds more than 64 inputs; at most 64 are taken"
    many_outputs = digits_request()
    for index in range(65):
        many_outputs.outputs.add(name=f"o{index}")
    assert refusal(many_outputs) == "the request holds more than 64 requested outputs; at most 64 are taken"
    many_buffers = digits_request()
    many_buffers.raw_input_contents.extend([b""] * 64)
    assert (
        refusal(many_buffers)
        == "the request holds more than 64 raw_input_contents buffers; at most 64 are taken"
    )
    at_the_limit = pb.ModelInferRequest(model_name="digits")
    for index in range(64):
        at_the_limit.inputs.add(name=f"x{index}", datatype="FP32", shape=[0])
    assert len(read_infer_request(at_the_limit.SerializeToString()).inputs) == 64


def test_parameters_are_bounded_on_the_request_each_input_and_each_output() -> None:
    request = digits_request()
    for index in range(MAX_PARAMETERS + 1 - len(request.parameters)):
        request.parameters[f"p{index}"].bool_param = True
    assert (
        refusal(request) == f"the request holds more than {MAX_PARAMETERS} parameters; at most 64 are taken"
    )
    del request.parameters["p0"]
    assert len(read_infer_request(request.SerializeToString()).parameters) == MAX_PARAMETERS
    on_input, on_output = digits_request(), digits_request()
    for index in range(MAX_PARAMETERS + 1):
        on_input.inputs[0].parameters[f"p{index}"].int64_param = index
        on_output.outputs[0].parameters[f"p{index}"].int64_param = index
    assert refusal(on_input) == "input #1 holds more than 64 parameters; at most 64 are taken"
    assert refusal(on_output) == "requested output #1 holds more than 64 parameters; at most 64 are taken"


def test_typed_contents_are_refused_by_what_they_would_take_once_parsed() -> None:
    """One-byte INT64 zeros take eight bytes each parsed: 1 M of them is 1 MB sent, 8 MB parsed."""
    request = pb.ModelInferRequest(model_name="digits")
    tensor = request.inputs.add(name="input", datatype="INT64", shape=[1_000_000])
    tensor.contents.int64_contents.extend(np.zeros(1_000_000, np.int64).tolist())
    assert request.ByteSize() < MAX_TYPED_BYTES
    assert refusal(request) == (
        f"input #1: typed contents would take over {MAX_TYPED_BYTES} bytes once parsed; "
        "send a tensor this large as raw_input_contents"
    )
    del tensor.contents.int64_contents[MAX_TYPED_BYTES // 8 :]
    assert (
        len(read_infer_request(request.SerializeToString()).inputs[0].contents.int64_contents)
        == MAX_TYPED_BYTES // 8
    )
    floats = pb.ModelInferRequest(model_name="digits")  # packed floats: exactly their bytes
    floats.inputs.add(name="input", datatype="FP32").contents.fp32_contents.extend(
        [1.0] * (MAX_TYPED_BYTES // 4)
    )
    read_infer_request(floats.SerializeToString())
    floats.inputs.add(name="more", datatype="FP32").contents.fp32_contents.append(
        1.0
    )  # the budget is the request's
    assert "typed contents would take over" in refusal(floats)


def test_bytes_elements_count_their_overhead_and_their_number() -> None:
    empty_strings = pb.ModelInferRequest(model_name="arith")
    empty_strings.inputs.add(name="text_input", datatype="BYTES").contents.bytes_contents.extend(
        [b""] * (MAX_CONTENTS_FIELDS + 1)
    )
    assert refusal(empty_strings) == (
        f"the request holds more than {MAX_CONTENTS_FIELDS} separate typed-contents fields; "
        f"at most {MAX_CONTENTS_FIELDS} are taken"
    )
    del empty_strings.inputs[0].contents.bytes_contents[-1]
    read_infer_request(empty_strings.SerializeToString())


def test_a_shape_longer_than_rank_16_allows_is_refused_and_fields_are_bounded_per_tensor() -> None:
    long_shape = pb.ModelInferRequest(model_name="digits")
    long_shape.inputs.add(name="input", datatype="FP32", shape=[-1] * 17)  # 17 ten-byte varints
    assert refusal(long_shape) == "input #1: its shape takes 170 bytes; a shape has at most 16 dimensions"
    unpacked = bytes([0x18, 1]) * 100  # 100 dimensions, one field each
    raw = (
        pb.ModelInferRequest(model_name="m").SerializeToString() + bytes([0x2A, 0xC8, 0x01]) + unpacked
    )  # 200
    assert refusal(raw) == "input #1 holds more than 88 fields; no request of a model here holds as many"


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (digits_request().SerializeToString()[:-3], "runs past the end of its message"),
        (b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", "a varint is cut off or longer than ten bytes"),
        (b"\x0b\x00", "wire type 3"),  # a group: never in these messages
        (b"\x00\x01", "field 0 runs past"),
    ],
)
def test_bytes_that_are_no_message_are_refused_saying_so(raw: bytes, why: str) -> None:
    message = refusal(raw)
    assert message.startswith("the request is not a valid ModelInferRequest: ")
    assert why in message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_parsed_as_protobuf_would_or_refused_as_invalid_input(raw: bytes) -> None:
    try:
        parsed = read_infer_request(raw)
    except InvalidInput as refused:
        assert str(refused).startswith(
            ("the request is not a valid ModelInferRequest: ", "input #", "the request holds")
        )
    else:
        assert parsed == pb.ModelInferRequest.FromString(raw)


def test_a_refused_request_still_names_its_model_and_id() -> None:
    request = digits_request()
    request.raw_input_contents.extend([b""] * 64)
    assert request_header(request.SerializeToString()) == ("digits", "req-7")
    assert request_header(b"\x0a\x05dig") == ("", "")  # cut off before its name ends
