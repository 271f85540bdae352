"""The numpy <-> Open Inference Protocol codec: round trips and every malformed tensor."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stratus import datatypes
from stratus.convert import codec
from stratus.errors import InvalidInput
from stratus.wire import inference_pb2 as pb

NUMERIC = {
    "FP32": np.float32,
    "FP16": np.float16,
    "FP64": np.float64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "BOOL": np.bool_,
}
shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5)


@st.composite
def arrays(draw: st.DrawFn, datatypes: tuple[str, ...] = tuple(NUMERIC)) -> np.ndarray:
    datatype = draw(st.sampled_from(datatypes))
    return draw(
        hnp.arrays(
            NUMERIC[datatype], shapes, elements={"allow_nan": False} if datatype.startswith("FP") else None
        )
    )


def roundtrip_request(inputs: dict[str, np.ndarray], raw: bool) -> dict[str, np.ndarray]:
    request = pb.ModelInferRequest(model_name="m")
    codec.encode_request_inputs(request, inputs, raw=raw)
    wire = pb.ModelInferRequest.FromString(request.SerializeToString())
    return codec.decode_request_inputs(wire)


@given(arrays())
def test_raw_roundtrip_keeps_values_dtype_and_shape(array: np.ndarray) -> None:
    decoded = roundtrip_request({"x": array}, raw=True)["x"]
    assert decoded.dtype == array.dtype.newbyteorder("<")
    assert decoded.shape == array.shape
    np.testing.assert_array_equal(decoded, array)


@given(arrays(tuple(d for d in NUMERIC if d != "FP16")))
def test_typed_contents_roundtrip(array: np.ndarray) -> None:
    decoded = roundtrip_request({"x": array}, raw=False)["x"]
    assert decoded.dtype == array.dtype
    np.testing.assert_array_equal(decoded, array)


@given(st.lists(st.binary(max_size=20), min_size=0, max_size=6), st.booleans())
def test_bytes_roundtrip_both_encodings(items: list[bytes], raw: bool) -> None:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    decoded = roundtrip_request({"s": array}, raw=raw)["s"]
    assert list(decoded) == items


def test_response_roundtrip_and_datatype_names() -> None:
    outputs = {"p": np.arange(6, dtype=np.float32).reshape(2, 3), "k": np.array([1, 2], dtype=np.int64)}
    response = pb.ModelInferResponse()
    codec.encode_response_outputs(response, outputs)
    assert [t.datatype for t in response.outputs] == ["FP32", "INT64"]
    decoded = codec.decode_response_outputs(response)
    np.testing.assert_array_equal(decoded["p"], outputs["p"])
    np.testing.assert_array_equal(decoded["k"], outputs["k"])


def raw_request(datatype: str, shape: list[int], raw: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    return request


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            raw_request("FP32", [2, 3], b"\0" * 23),
            "raw buffer holds 23 bytes, but shape [2, 3] of FP32 needs 24",
        ),
        (raw_request("FP33", [1], b"\0" * 4), "unknown datatype 'FP33'"),
        (raw_request("FP32", [2, -3], b""), "dimension 1 is -3"),
        (raw_request("FP32", [1 << 20, 1 << 20], b""), "more than the limit"),
        (raw_request("FP32", [1] * 17, b"\0" * 4), "rank 17 exceeds"),
        (raw_request("BOOL", [2], b"\x00\x02"), "BOOL bytes must be 0 or 1"),
        (raw_request("BYTES", [2], struct.pack("<I", 1) + b"a"), "holds 1 elements, shape [2] needs 2"),
        (raw_request("BYTES", [1], struct.pack("<I", 9) + b"abc"), "claims 9 bytes, only 3 remain"),
        (raw_request("BYTES", [1], b"\x01\x00"), "ends inside a length prefix"),
    ],
)
def test_malformed_raw_tensor_names_tensor_and_problem(request_: pb.ModelInferRequest, message: str) -> None:
    with pytest.raises(InvalidInput, match="'x'") as error:
        codec.decode_request_inputs(request_)
    assert message in str(error.value)


def test_raw_buffer_count_must_match_inputs() -> None:
    request = raw_request("FP32", [1], b"\0" * 4)
    request.inputs.add(name="y", datatype="FP32", shape=[1])
    with pytest.raises(InvalidInput, match="1 raw_input_contents buffers for 2 inputs"):
        codec.decode_request_inputs(request)


def test_typed_contents_count_range_and_kind_are_checked() -> None:
    request = pb.ModelInferRequest()
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[3])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(InvalidInput, match="fp32_contents holds 2 values, shape \\[3\\] needs 3"):
        codec.decode_request_inputs(request)
    small = pb.ModelInferRequest()
    small.inputs.add(name="x", datatype="INT8", shape=[1]).contents.int_contents.append(300)
    with pytest.raises(InvalidInput, match="outside the range of INT8"):
        codec.decode_request_inputs(small)
    mixed = pb.ModelInferRequest()
    t = mixed.inputs.add(name="x", datatype="INT32", shape=[1])
    t.contents.int_contents.append(1)
    t.contents.fp32_contents.append(1.0)
    with pytest.raises(InvalidInput, match="fp32_contents is set"):
        codec.decode_request_inputs(mixed)


def test_fp16_has_no_typed_contents_and_missing_data_is_refused() -> None:
    request = pb.ModelInferRequest()
    request.inputs.add(name="h", datatype="FP16", shape=[1]).contents.fp32_contents.append(1.0)
    with pytest.raises(InvalidInput, match="FP16 has no typed contents"):
        codec.decode_request_inputs(request)
    empty = pb.ModelInferRequest()
    empty.inputs.add(name="x", datatype="FP32", shape=[2])
    with pytest.raises(InvalidInput, match="carries no data"):
        codec.decode_request_inputs(empty)


def test_duplicate_inputs_and_both_encodings_are_refused() -> None:
    request = raw_request("FP32", [1], b"\0" * 4)
    request.inputs.add(name="x", datatype="FP32", shape=[1])
    request.raw_input_contents.append(b"\0" * 4)
    with pytest.raises(InvalidInput, match="appears more than once"):
        codec.decode_request_inputs(request)
    both = raw_request("FP32", [1], b"\0" * 4)
    both.inputs[0].contents.fp32_contents.append(1.0)
    with pytest.raises(InvalidInput, match="both typed contents and a raw buffer"):
        codec.decode_request_inputs(both)


@settings(max_examples=200)
@given(
    datatype=st.sampled_from([*datatypes.DATATYPES, "FP8", "", "fp32"]),
    shape=st.lists(st.integers(min_value=-(1 << 40), max_value=1 << 40), max_size=5),
    raw=st.binary(max_size=64),
)
def test_arbitrary_raw_tensors_decode_or_raise_invalid_input(
    datatype: str, shape: list[int], raw: bytes
) -> None:
    """No input makes the decoder raise anything but InvalidInput, or allocate past the limit:
    a shape of 2**40 elements over 64 bytes is refused before anything that size is made."""
    request = raw_request(datatype, shape, raw)
    tracemalloc.start()
    try:
        array = codec.decode_request_inputs(request)["x"]
    except InvalidInput as error:
        assert "'x'" in str(error)
    else:
        assert list(array.shape) == shape
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding {len(raw)} bytes allocated {peak} bytes at its peak"


def test_numpy_dtypes_without_a_protocol_type_are_refused() -> None:
    with pytest.raises(InvalidInput, match="complex64"):
        datatypes.datatype_of(np.zeros(1, dtype=np.complex64))
