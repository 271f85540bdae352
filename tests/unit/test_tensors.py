"""Raw tensors as the router handles them: checked from metadata, merged and split as bytes."""

from __future__ import annotations

import numpy as np
import pytest

from stratus.convert import codec
from stratus.convert.tensors import Tensors, check_inputs
from stratus.errors import InvalidInput
from stratus.families.spec import TensorSpec
from stratus.obs.stats import ServiceCurve
from stratus.wire import inference_pb2 as pb

SPEC = (TensorSpec(name="input", datatype="FP32", shape=(-1, 4)),)


def request_of(array: np.ndarray, *, raw: bool = True, name: str = "input") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    codec.encode_request_inputs(request, {name: array}, raw=raw)
    return request


def test_rows_taken_and_joined_are_the_arrays_rows_byte_for_byte() -> None:
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    tensors = Tensors.from_request(request_of(x))
    picked = tensors.take([4, 1, 5])
    joined = Tensors.join([tensors.rows(0, 2), picked])
    out = joined.get("input")
    decoded = codec.decode_raw(out.data, tensor="input", datatype=out.datatype, shape=out.shape)
    assert np.array_equal(decoded, np.concatenate([x[0:2], x[[4, 1, 5]]]))
    assert joined.items == 5 and joined.batch_key("v", ()).inputs == (("input", "FP32", (4,)),)


def test_typed_contents_become_the_same_raw_bytes_as_a_raw_request() -> None:
    x = np.random.default_rng(0).random((3, 4), dtype=np.float32)
    typed = Tensors.from_request(request_of(x, raw=False))
    raw = Tensors.from_request(request_of(x))
    assert typed == raw


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.raw_input_contents.__setitem__(0, b"\x00" * 12), "holds 12 bytes, but shape"),
        (lambda r: r.inputs[0].__setattr__("datatype", "FP33"), "unknown datatype 'FP33'"),
        (lambda r: r.raw_input_contents.append(b""), "2 raw_input_contents buffers for 1 inputs"),
        (lambda r: r.inputs[0].shape.__setitem__(0, -2), "dimension 0 is -2"),
    ],
)
def test_malformed_buffers_are_refused_by_name_without_decoding(mutate, message) -> None:  # type: ignore[no-untyped-def]
    request = request_of(np.zeros((2, 4), np.float32))
    mutate(request)
    with pytest.raises(InvalidInput, match=message):
        Tensors.from_request(request)


def test_bool_bytes_must_be_zero_or_one() -> None:
    request = request_of(np.array([[True, False]]), name="flags")
    assert Tensors.from_request(request).items == 1
    request.raw_input_contents[0] = b"\x01\x02"
    with pytest.raises(InvalidInput, match="BOOL bytes must be 0 or 1"):
        Tensors.from_request(request)


def test_inputs_are_checked_against_the_family_from_metadata() -> None:
    check_inputs("digits", SPEC, Tensors.from_request(request_of(np.zeros((2, 4), np.float32))))
    with pytest.raises(InvalidInput, match=r"shape \[2, 5\] does not fit the model's \[-1, 4\]"):
        check_inputs("digits", SPEC, Tensors.from_request(request_of(np.zeros((2, 5), np.float32))))
    with pytest.raises(InvalidInput, match="datatype is FP64, the model takes FP32"):
        check_inputs("digits", SPEC, Tensors.from_request(request_of(np.zeros((2, 4), np.float64))))
    with pytest.raises(InvalidInput, match="has no input 'other'"):
        check_inputs(
            "digits", SPEC, Tensors.from_request(request_of(np.zeros((2, 4), np.float32), name="other"))
        )


def test_the_service_curve_learns_per_batch_size_and_interpolates() -> None:
    curve = ServiceCurve()
    assert curve.estimate(4, default=2.0) == 8.0  # nothing known: proportional to items
    curve.add(1, 1.0)
    curve.add(32, 5.0)
    assert curve.estimate(1) == 1.0 and curve.estimate(32) == 5.0
    assert 1.0 < curve.estimate(16) < 5.0
    assert curve.estimate(64) == pytest.approx(10.0)  # beyond what ran: grows with the items
