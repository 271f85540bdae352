"""Exact bounds and refusals of a request's reading: wire scan, tensor checks, the decoded request.

Each limit is pinned at the limit and one past it; each refusal by its whole message, which is
what a client reads. Protobuf bytes are built by hand where the encoder would never send them.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from stratus.convert import codec
from stratus.convert.codec import MAX_INPUTS
from stratus.convert.inference import InferRequest, InferResult
from stratus.convert.tensors import (
    MAX_REQUEST_ITEMS,
    RawTensor,
    Tensors,
    answer_raw,
    check_inputs,
    check_request_metadata,
    input_headers,
    requested_outputs,
)
from stratus.convert.wire_scan import (
    MAX_PARAMETERS,
    MAX_REQUEST_FIELDS,
    MAX_TYPED_BYTES,
    read_infer_request,
    request_header,
)
from stratus.datatypes import MAX_RANK
from stratus.errors import InvalidInput
from stratus.families.spec import TensorSpec
from stratus.sched.batching import BatchKey
from stratus.wire import inference_pb2 as pb

NOT_A_MESSAGE = "the request is not a valid ModelInferRequest: "
VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
SPEC = (TensorSpec(name="input", datatype="FP32", shape=(-1, 4)),)


# -- protobuf by hand ------------------------------------------------------------------------
def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64s are ten-byte varints
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def key(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def length_field(number: int, payload: bytes) -> bytes:
    return key(number, LENGTH) + varint(len(payload)) + payload


def request_with_input(tensor: bytes, *, model: bytes = b"m") -> bytes:
    """A ModelInferRequest (model_name = field 1) holding one input (field 5) given as its bytes."""
    return length_field(1, model) + length_field(5, tensor)


def refusal(raw: bytes) -> str:
    with pytest.raises(InvalidInput) as refused:
        read_infer_request(raw)
    return str(refused.value)


def refused(call, *args) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidInput) as error:
        call(*args)
    return str(error.value)


# -- the wire scan ------------------------------------------------------------------------------
def test_request_fields_are_taken_up_to_the_bound_and_refused_one_past_it() -> None:
    """An empty model_version (field 2) repeated: each is one field of the request itself."""
    empty_version = length_field(2, b"")
    assert read_infer_request(empty_version * MAX_REQUEST_FIELDS) == pb.ModelInferRequest()
    assert refusal(empty_version * (MAX_REQUEST_FIELDS + 1)) == (
        f"the request holds more than {MAX_REQUEST_FIELDS} fields; no request of a model here holds as many"
    )


def test_exactly_max_inputs_raw_buffers_are_taken() -> None:
    """The bound on raw buffers is inclusive: 64 buffers are one per input of the widest request."""
    request = pb.ModelInferRequest(model_name="m")
    request.raw_input_contents.extend([b"\x00"] * MAX_INPUTS)
    assert len(read_infer_request(request.SerializeToString()).raw_input_contents) == MAX_INPUTS


def test_an_input_with_exactly_max_parameters_parameters_is_taken() -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[0])
    for index in range(MAX_PARAMETERS):
        tensor.parameters[f"p{index}"].bool_param = True
    assert len(read_infer_request(request.SerializeToString()).inputs[0].parameters) == MAX_PARAMETERS


def test_a_packed_shape_of_exactly_ten_bytes_a_dimension_is_taken_and_one_byte_more_refused() -> None:
    """Ten bytes is the longest varint, so rank 16 x 10 bytes is the longest legal shape."""
    longest = b"".join(varint(-1) for _ in range(MAX_RANK))
    assert len(longest) == MAX_RANK * 10
    parsed = read_infer_request(request_with_input(length_field(3, longest)))
    assert list(parsed.inputs[0].shape) == [-1] * MAX_RANK
    over = longest + varint(1)
    assert refusal(request_with_input(length_field(3, over))) == (
        f"input #1: its shape takes {MAX_RANK * 10 + 1} bytes; a shape has at most {MAX_RANK} dimensions"
    )


def test_a_shape_sent_as_several_packed_fields_counts_them_all() -> None:
    """Protobuf concatenates repeated packed fields: two 90-byte halves are a 180-byte shape."""
    half = b"".join(varint(-1) for _ in range(9))
    assert refusal(request_with_input(length_field(3, half) + length_field(3, half))) == (
        f"input #1: its shape takes 180 bytes; a shape has at most {MAX_RANK} dimensions"
    )
    assert len(read_infer_request(request_with_input(length_field(3, half))).inputs[0].shape) == 9


def test_unpacked_dimensions_count_one_each_whatever_their_length() -> None:
    """An unpacked dimension is one field: 17 ten-byte ones and 81 one-byte ones pass the scan
    (their rank is refused later, against the model), since neither is more than 160 dims."""
    long_dims = (key(3, VARINT) + varint(-1)) * 17
    assert list(read_infer_request(request_with_input(long_dims)).inputs[0].shape) == [-1] * 17
    short_dims = (key(3, VARINT) + varint(1)) * 81
    assert list(read_infer_request(request_with_input(short_dims)).inputs[0].shape) == [1] * 81


def test_a_ten_byte_varint_is_read_and_an_eleven_byte_one_refused() -> None:
    ten = key(3, VARINT) + b"\xff" * 9 + b"\x01"  # 2**64 - 1 as int64: -1
    assert list(read_infer_request(request_with_input(ten)).inputs[0].shape) == [-1]
    eleven = key(3, VARINT) + b"\xff" * 10 + b"\x01"
    assert (
        refusal(request_with_input(eleven)) == NOT_A_MESSAGE + "a varint is cut off or longer than ten bytes"
    )


def test_unpacked_fixed_width_contents_are_walked_by_their_width() -> None:
    """fp64 (field 7) and fp32 (field 6) sent one field per element: 8 and 4 bytes each."""
    contents = (key(7, FIXED64) + struct.pack("<d", 1.5)) * 3 + (key(6, FIXED32) + struct.pack("<f", 2.5)) * 2
    tensor = length_field(1, b"x") + length_field(2, b"FP64") + length_field(5, contents)
    parsed = read_infer_request(request_with_input(tensor)).inputs[0]
    assert list(parsed.contents.fp64_contents) == [1.5] * 3
    assert list(parsed.contents.fp32_contents) == [2.5] * 2


def test_fixed_width_fields_of_the_request_itself_are_stepped_over() -> None:
    """Unknown fixed64/fixed32 fields (15, 14) are kept by protobuf; the scan steps over them."""
    raw = length_field(1, b"m") + key(15, FIXED64) + b"\x01" * 8 + key(14, FIXED32) + b"\x02" * 4
    raw += length_field(3, b"req")
    parsed = read_infer_request(raw)
    assert (parsed.model_name, parsed.id) == ("m", "req")


def test_a_bytes_element_sent_with_the_wrong_wire_type_is_what_protobuf_makes_of_it() -> None:
    """bytes_contents (field 8) as a varint is an unknown field to protobuf, not a crash."""
    raw = request_with_input(length_field(5, key(8, VARINT) + varint(5)))
    assert read_infer_request(raw) == pb.ModelInferRequest.FromString(raw)


def bytes_element_request(size: int, *, extra_contents: bytes = b"") -> bytes:
    contents = length_field(8, b"a" * size) + extra_contents
    tensor = length_field(1, b"text") + length_field(2, b"BYTES") + length_field(5, contents)
    return request_with_input(tensor)


OVER_BUDGET = (
    f"input #1: typed contents would take over {MAX_TYPED_BYTES} bytes once parsed; "
    "send a tensor this large as raw_input_contents"
)


def test_a_bytes_element_takes_its_text_and_32_bytes_of_the_budget() -> None:
    at_limit = read_infer_request(bytes_element_request(MAX_TYPED_BYTES - 32))
    assert len(at_limit.inputs[0].contents.bytes_contents[0]) == MAX_TYPED_BYTES - 32
    assert refusal(bytes_element_request(MAX_TYPED_BYTES - 31)) == OVER_BUDGET


def test_an_unknown_contents_field_takes_none_of_the_budget() -> None:
    """Field 15 of InferTensorContents is unknown: kept as its bytes, which the message bounds."""
    unknown = key(15, VARINT) + varint(0)
    at_limit = read_infer_request(bytes_element_request(MAX_TYPED_BYTES - 32, extra_contents=unknown))
    assert len(at_limit.inputs[0].contents.bytes_contents) == 1


def test_a_packed_float_list_of_no_whole_count_is_malformed_not_over_budget() -> None:
    """MAX_TYPED_BYTES + 3 bytes of packed fp32 hold MAX_TYPED_BYTES // 4 whole floats, within
    the budget; the three left over make the bytes no message, as protobuf says."""
    contents = length_field(6, b"\x00" * (MAX_TYPED_BYTES + 3))
    tensor = length_field(1, b"x") + length_field(2, b"FP32") + length_field(5, contents)
    assert refusal(request_with_input(tensor)).startswith(NOT_A_MESSAGE)


def test_bytes_protobuf_rejects_after_the_scan_are_refused_as_no_request() -> None:
    """A model_name that is not UTF-8 passes the scan (it only counts) and fails the parse."""
    message = refusal(length_field(1, b"\xff\xfe"))
    assert message.startswith(NOT_A_MESSAGE)
    assert len(message) > len(NOT_A_MESSAGE)  # protobuf's reason follows


def test_the_header_of_a_refused_request_reads_only_its_strings() -> None:
    """A model name sent as a varint is no name; bytes that are not UTF-8 become U+FFFD; a name
    is cut to its first 256 bytes."""
    assert request_header(key(1, VARINT) + varint(65) + length_field(3, b"r-1")) == ("", "r-1")
    assert request_header(length_field(1, b"m\xff") + length_field(3, b"r\xfe")) == ("m\ufffd", "r\ufffd")
    assert request_header(length_field(1, b"n" * 300)) == ("n" * 256, "")


# -- tensors ------------------------------------------------------------------------------------
def bytes_buffer(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def raw_request(name: str, datatype: str, shape: list[int], data: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="toy")
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(data)
    return request


def test_a_raw_bytes_input_is_kept_as_sent_once_its_prefixes_check() -> None:
    data = bytes_buffer(b"abc", b"")
    tensors = Tensors.from_request(raw_request("text", "BYTES", [2], data))
    assert tensors.tensors == (RawTensor("text", "BYTES", (2,), data),)
    assert refused(
        Tensors.from_request, raw_request("text", "BYTES", [1], struct.pack("<I", 10) + b"abc")
    ) == ("tensor 'text': raw BYTES element 0 claims 10 bytes, only 3 remain")


def test_raw_inputs_with_a_bad_shape_or_datatype_are_refused_by_their_name() -> None:
    assert refused(Tensors.from_request, raw_request("x", "FP32", [-2], b"")) == (
        "tensor 'x': dimension 0 is -2; dimensions must be >= 0"
    )
    assert refused(Tensors.from_request, raw_request("x", "FP8", [1], b"\x00")).startswith(
        "tensor 'x': unknown datatype 'FP8'; expected one of "
    )


def test_bool_bytes_other_than_zero_and_one_are_refused_whatever_their_value() -> None:
    """0x58 is 'X': every byte but 0 and 1 is refused, not only small ones."""
    assert Tensors.from_request(raw_request("flag", "BOOL", [2], b"\x01\x00")).items == 2
    assert refused(Tensors.from_request, raw_request("flag", "BOOL", [2], b"\x01X")) == (
        "tensor 'flag': BOOL bytes must be 0 or 1"
    )


def test_an_input_with_contents_and_a_raw_buffer_is_refused_by_name() -> None:
    request = raw_request("x", "FP32", [1], struct.pack("<f", 1.0))
    request.inputs[0].contents.fp32_contents.append(1.0)
    assert refused(Tensors.from_request, request) == "input 'x' has both typed contents and a raw buffer"


def test_typed_inputs_become_raw_with_their_datatype_and_their_errors_name_them() -> None:
    request = pb.ModelInferRequest(model_name="toy")
    request.inputs.add(name="x", datatype="INT16", shape=[2]).contents.int_contents.extend([1, -2])
    assert Tensors.from_request(request).tensors == (
        RawTensor("x", "INT16", (2,), struct.pack("<hh", 1, -2)),
    )
    request.inputs[0].contents.int_contents.append(3)
    assert (
        refused(Tensors.from_request, request) == "tensor 'x': int_contents holds 3 values, shape [2] needs 2"
    )


def test_a_request_without_inputs_or_with_buffers_not_one_to_one_is_refused() -> None:
    assert refused(Tensors.from_request, pb.ModelInferRequest(model_name="toy")) == (
        "request for 'toy' has no inputs"
    )
    request = raw_request("x", "FP32", [1], b"\x00" * 4)
    request.raw_input_contents.append(b"")
    assert refused(Tensors.from_request, request) == (
        "request has 2 raw_input_contents buffers for 1 inputs; they must match one to one"
    )


def test_a_repeated_input_name_is_refused() -> None:
    request = raw_request("x", "FP32", [1], b"\x00" * 4)
    request.inputs.add(name="x", datatype="FP32", shape=[1])
    request.raw_input_contents.append(b"\x00" * 4)
    assert refused(Tensors.from_request, request) == "input 'x' appears more than once"


def test_a_typed_response_becomes_raw_buffers_with_datatypes_from_its_values() -> None:
    response = pb.ModelInferResponse(model_name="toy")
    response.outputs.add(name="scores", datatype="FP32", shape=[2]).contents.fp32_contents.extend([0.5, 2.0])
    response.outputs.add(name="label", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"cat")
    assert Tensors.from_response(response).tensors == (
        RawTensor("scores", "FP32", (2,), struct.pack("<ff", 0.5, 2.0)),
        RawTensor("label", "BYTES", (1,), bytes_buffer(b"cat")),
    )


def test_a_raw_response_is_checked_from_metadata_never_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(response: pb.ModelInferResponse) -> None:
        raise AssertionError("a raw response was decoded")

    monkeypatch.setattr(codec, "decode_response_outputs", no_decoding)
    response = pb.ModelInferResponse(model_name="toy")
    response.outputs.add(name="scores", datatype="FP32", shape=[1])
    response.raw_output_contents.append(struct.pack("<f", 0.25))
    assert Tensors.from_response(response).tensors == (
        RawTensor("scores", "FP32", (1,), struct.pack("<f", 0.25)),
    )
    response.raw_output_contents.append(b"")
    assert (
        refused(Tensors.from_response, response) == "response has 2 raw_output_contents buffers for 1 outputs"
    )


def rows_tensor(name: str, rows: int, *, datatype: str = "INT8") -> RawTensor:
    """``rows`` rows of two INT8 items, row i holding (i, i)."""
    return RawTensor(name, datatype, (rows, 2), bytes(i for i in range(rows) for _ in range(2)))


def test_rows_from_a_start_past_zero_are_that_many_rows() -> None:
    tensors = Tensors((rows_tensor("a", 4),))
    assert tensors.rows(1, 4).tensors == (RawTensor("a", "INT8", (3, 2), bytes([1, 1, 2, 2, 3, 3])),)
    assert tensors.rows(1, 3).tensors == (RawTensor("a", "INT8", (2, 2), bytes([1, 1, 2, 2])),)
    assert tensors.rows(0, 4) is tensors


def test_rows_taken_keep_their_name_and_datatype() -> None:
    taken = Tensors((rows_tensor("a", 3, datatype="UINT8"),)).take([2, 0])
    assert taken.tensors == (RawTensor("a", "UINT8", (2, 2), bytes([2, 2, 0, 0])),)


def test_joined_tensors_follow_the_first_part() -> None:
    """One part is itself; several follow the first's order of inputs and its description."""
    one = Tensors((rows_tensor("a", 1),))
    assert Tensors.join([one]) is one
    first = Tensors((rows_tensor("a", 1), rows_tensor("b", 1)))
    second = Tensors((rows_tensor("b", 2), rows_tensor("a", 2)))
    assert Tensors.join([first, second]).names() == ["a", "b"]
    joined = RawTensor.join(
        [RawTensor("a", "INT8", (1, 2), b"\x00\x00"), RawTensor("z", "UINT8", (1, 2), b"\x01\x01")]
    )
    assert joined == RawTensor("a", "INT8", (2, 2), b"\x00\x00\x01\x01")


def test_a_missing_tensor_is_a_key_error_naming_it() -> None:
    with pytest.raises(KeyError) as missing:
        Tensors((rows_tensor("a", 1),)).get("b")
    assert missing.value.args == ("b",)


def test_the_batch_key_holds_variant_inputs_outputs_and_whether_it_splits() -> None:
    fixed = Tensors((rows_tensor("a", 3),))
    assert fixed.batch_key("digits-v2", ["scores", "label"]) == BatchKey(
        variant="digits-v2", inputs=(("a", "INT8", (2,)),), outputs=("scores", "label"), batchable=True
    )
    text = Tensors((RawTensor("text", "BYTES", (1,), bytes_buffer(b"hi")),))
    assert text.batch_key("arith", []) == BatchKey(
        variant="arith", inputs=(("text", "BYTES", ()),), outputs=(), batchable=False
    )


def test_write_request_appends_each_tensor_as_an_input_and_its_buffer() -> None:
    request = pb.ModelInferRequest(model_name="toy")
    Tensors((rows_tensor("a", 2), RawTensor("b", "FP32", (1,), struct.pack("<f", 1.0)))).write_request(
        request
    )
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [
        ("a", "INT8", [2, 2]),
        ("b", "FP32", [1]),
    ]
    assert list(request.raw_input_contents) == [bytes([0, 0, 1, 1]), struct.pack("<f", 1.0)]


def test_write_response_raw_keeps_buffers_and_typed_refuses_a_bad_one_by_name() -> None:
    good = RawTensor("scores", "FP32", (2,), struct.pack("<ff", 1.0, 2.0))
    raw = pb.ModelInferResponse()
    Tensors((good,)).write_response(raw, raw=True)
    assert list(raw.raw_output_contents) == [good.data]
    bad = Tensors((RawTensor("scores", "FP32", (2,), b"\x00" * 7),))
    with pytest.raises(InvalidInput) as error:
        bad.write_response(pb.ModelInferResponse(), raw=False)
    assert str(error.value) == "tensor 'scores': raw buffer holds 7 bytes, but shape [2] of FP32 needs 8"


def typed_request(*datatypes_and_values: tuple[str, list[float]]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="toy")
    for index, (datatype, values) in enumerate(datatypes_and_values):
        request.inputs.add(
            name=f"x{index}", datatype=datatype, shape=[len(values)]
        ).contents.fp32_contents.extend(values)
    return request


def test_answers_are_typed_only_for_a_typed_request_whose_outputs_can_be() -> None:
    typed = InferRequest.from_wire(typed_request(("FP32", [1.0]))).typed
    assert answer_raw(typed, ["FP32", "INT64"]) is False
    assert answer_raw(typed, ["FP32", "FP16"]) is True  # FP16 has no typed list
    assert answer_raw(typed, []) is False
    raw = InferRequest.from_wire(raw_request("x", "FP32", [1], b"\x00" * 4)).typed
    assert answer_raw(raw, ["FP32"]) is True
    nothing = InferRequest.from_wire(pb.ModelInferRequest()).typed
    assert answer_raw(nothing, ["FP32"]) is True  # no inputs: nothing came typed


def test_requested_outputs_are_those_named_or_all_and_unknown_ones_refused() -> None:
    assert requested_outputs((), "toy", ("a", "b")) == ["a", "b"]
    assert requested_outputs(("b",), "toy", ("a", "b")) == ["b"]
    assert refused(requested_outputs, ("b", "nope"), "toy", ("b", "a")) == (
        "model 'toy' has no output 'nope'; it gives ['a', 'b']"
    )


def test_inputs_must_all_be_there_and_agree_on_dimension_zero() -> None:
    specs = (
        TensorSpec(name="a", datatype="INT8", shape=(-1, -1)),
        TensorSpec(name="b", datatype="INT8", shape=(-1, -1)),
    )
    ab = Tensors((RawTensor("a", "INT8", (2, 1), b"\x00" * 2), RawTensor("b", "INT8", (2, 3), b"\x00" * 6)))
    check_inputs("toy", specs, ab)  # dimension 1 may differ
    disagree = Tensors(
        (RawTensor("a", "INT8", (2, 1), b"\x00" * 2), RawTensor("b", "INT8", (3, 1), b"\x00" * 3))
    )
    assert refused(check_inputs, "toy", specs, disagree) == "inputs disagree on the batch size: [2, 3]"
    only_a = Tensors((RawTensor("a", "INT8", (2, 1), b"\x00" * 2),))
    assert refused(check_inputs, "toy", specs, only_a) == "model 'toy' needs input 'b'"
    vectors = (
        TensorSpec(name="a", datatype="INT8", shape=(-1,)),
        TensorSpec(name="b", datatype="INT8", shape=(-1,)),
    )
    check_inputs(
        "toy",
        vectors,
        Tensors((RawTensor("a", "INT8", (2,), b"\x00" * 2), RawTensor("b", "INT8", (2,), b"\x00" * 2))),
    )


def metadata_request(shape: list[int], *, name: str = "input") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="toy")
    request.inputs.add(name=name, datatype="FP32", shape=shape)
    return request


def test_a_request_holds_at_most_max_request_items_along_the_batch_dimension() -> None:
    check_request_metadata("toy", SPEC, input_headers(metadata_request([MAX_REQUEST_ITEMS, 4])))
    assert refused(check_request_metadata, "toy", SPEC, input_headers(metadata_request([MAX_REQUEST_ITEMS + 1, 4]))) == (
        f"input 'input' holds {MAX_REQUEST_ITEMS + 1} items; a request may hold at most {MAX_REQUEST_ITEMS} "
        "(the models' max_batch_size): send the rest in further requests"
    )


def test_the_item_bound_is_on_the_batch_dimension_only() -> None:
    """A fixed dimension 0 is the model's own size, not a batch: the item bound does not apply."""
    fixed = (TensorSpec(name="input", datatype="FP32", shape=(MAX_REQUEST_ITEMS + 1, 4)),)
    check_request_metadata("toy", fixed, input_headers(metadata_request([MAX_REQUEST_ITEMS + 1, 4])))
    wide = (TensorSpec(name="input", datatype="FP32", shape=(-1, -1)),)
    check_request_metadata("toy", wide, input_headers(metadata_request([1, MAX_REQUEST_ITEMS + 1])))


def test_an_input_named_twice_is_refused_from_its_metadata_where_it_is_reached() -> None:
    request = metadata_request([1, 4])
    request.inputs.add(name="input", datatype="FP32", shape=[1, 4])
    assert refused(check_request_metadata, "toy", SPEC, input_headers(request)) == "input 'input' appears more than once"
    request = metadata_request([1, 4], name="other")  # reached first: the unknown name is said
    request.inputs.add(name="other", datatype="FP32", shape=[1, 4])
    assert refused(check_request_metadata, "toy", SPEC, input_headers(request)).startswith("model 'toy' has no input 'other'")


def test_request_metadata_refusals_name_the_input_and_the_model() -> None:
    assert refused(check_request_metadata, "toy", SPEC, input_headers(metadata_request([-3, 4]))) == (
        "tensor 'input': dimension 0 is -3; dimensions must be >= 0"
    )
    specs = (
        TensorSpec(name="input", datatype="FP32", shape=(-1, 4)),
        TensorSpec(name="extra", datatype="FP32", shape=(-1,)),
    )
    assert refused(check_request_metadata, "toy", specs, input_headers(metadata_request([1, 4], name="other"))) == (
        "model 'toy' has no input 'other'; it takes ['extra', 'input']"
    )


# -- the decoded request -----------------------------------------------------------------------
def test_input_bytes_are_the_raw_buffers_or_else_the_typed_inputs_encoded_size() -> None:
    raw = raw_request("x", "FP32", [4], b"\x00" * 16)
    raw.inputs.add(name="y", datatype="FP32", shape=[2])
    raw.raw_input_contents.append(b"\x00" * 8)
    assert InferRequest.from_wire(raw).input_bytes() == 24
    # name "x0" (4 bytes), datatype "FP32" (6), shape [1] (3), contents of one fp32 (2 + 2 + 4)
    assert InferRequest.from_wire(typed_request(("FP32", [1.0]))).input_bytes() == 4 + 6 + 3 + 8


def test_input_names_are_in_order_with_unnamed_ones_numbered() -> None:
    request = raw_request("x", "FP32", [1], b"\x00" * 4)
    request.inputs.add(datatype="FP32", shape=[1])
    assert InferRequest.from_wire(request).input_names() == ["x", "#1"]
    for index in range(MAX_INPUTS):
        request.inputs.add(name=f"more{index}")
    assert refused(InferRequest.from_wire(request).input_names) == (
        f"request names {MAX_INPUTS + 2} inputs; at most {MAX_INPUTS} are taken"
    )


def test_the_request_answers_for_its_outputs_and_its_answer_form() -> None:
    request = typed_request(("FP32", [1.0]))
    request.outputs.add(name="b")
    wrapped = InferRequest.from_wire(request)
    a, b = (TensorSpec(name=name, datatype="FP32", shape=(-1,)) for name in "ab")
    assert wrapped.checked("toy", None, [a, b]).outputs == ("b",)
    request.outputs.add(name="c")
    assert (
        refused(InferRequest.from_wire(request).checked, "toy", None, [b, a])
        == "model 'toy' has no output 'c'; it gives ['a', 'b']"
    )
    assert wrapped.answer_raw(["FP32"]) is False
    assert wrapped.answer_raw(["FP16"]) is True


def test_check_metadata_names_the_family() -> None:
    request = InferRequest.from_wire(metadata_request([1, 4], name="other"))
    assert (
        refused(request.check_metadata, "digits", SPEC)
        == "model 'digits' has no input 'other'; it takes ['input']"
    )


def test_only_a_bool_input_named_stream_asks_for_chunks() -> None:
    request = pb.ModelInferRequest(model_name="toy")
    codec.encode_request_inputs(request, {"flag": np.array([True]), "stream": np.array([1.0], np.float32)})
    assert InferRequest.from_wire(request).streams() is False


def test_a_result_of_raw_tensors_goes_back_as_raw_buffers() -> None:
    tensor = RawTensor("scores", "FP32", (1,), struct.pack("<f", 0.75))
    response = InferResult(model_name="toy", id="r", outputs=Tensors((tensor,)), raw=True).to_wire()
    assert list(response.raw_output_contents) == [tensor.data]
    assert not response.outputs[0].HasField("contents")
