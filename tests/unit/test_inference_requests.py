"""Requests and results as the data planes take and give them: converted at the wire once,
tensors read only on demand, and written back as the client sent them."""

from __future__ import annotations

import numpy as np
import pytest

from stratus.convert import codec
from stratus.convert.inference import MAX_PROMPT_BYTES, InferRequest, InferResult, TextRequest
from stratus.convert.parameters import BUDGET_MS, MAX_TIER, RequestOptions, set_parameter
from stratus.convert.tensors import Tensors
from stratus.errors import InvalidInput
from stratus.families.generation import GenerationParams
from stratus.families.spec import TensorSpec
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

SPEC = [TensorSpec(name="input", datatype="FP32", shape=(-1, 4))]


def wire(rows: np.ndarray, *, typed: bool = False, **parameters: object) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="toy", id="r-7")
    if typed:
        tensor = message.inputs.add(name="input", datatype="FP32", shape=rows.shape)
        codec.encode_contents(rows, tensor.contents)
    else:
        codec.encode_request_inputs(message, {"input": rows})
    for key, value in parameters.items():
        set_parameter(message.parameters, key, value)  # type: ignore[arg-type]
    return message


def test_the_header_is_read_once_with_parameters_as_python_values() -> None:
    message = wire(np.ones((3, 4), np.float32), **{BUDGET_MS: 25.0, MAX_TIER: "edge", "flag": True})
    message.outputs.add(name="scores")
    message.parameters["unset"].SetInParent()  # sent with no value chosen
    request = InferRequest.from_wire(message)
    assert (request.model_name, request.id, request.items, request.outputs) == ("toy", "r-7", 3, ("scores",))
    assert request.parameters == {BUDGET_MS: 25.0, MAX_TIER: "edge", "flag": True, "unset": None}
    assert request.options() == RequestOptions(budget_ms=25.0, max_tier=Tier.EDGE)
    assert request.raw and not request.typed


def test_an_unset_stratus_parameter_is_refused_not_ignored() -> None:
    message = wire(np.ones((1, 4), np.float32))
    message.parameters[BUDGET_MS].SetInParent()
    with pytest.raises(InvalidInput, match="must be a double"):
        InferRequest.from_wire(message).options()


def test_metadata_is_checked_before_any_tensor_is_decoded() -> None:
    """16 M typed INT64 zeros: refused from the header, never built into an array."""
    message = pb.ModelInferRequest(model_name="toy")
    tensor = message.inputs.add(name="input", datatype="INT64", shape=[16_000_000, 4])
    tensor.contents.int64_contents.extend([0] * 8)  # what the header claims is never read
    request = InferRequest.from_wire(message)
    with pytest.raises(InvalidInput, match="datatype is INT64, the model takes FP32"):
        request.check_metadata("toy", SPEC)


def test_tensors_and_arrays_read_the_same_inputs_typed_or_raw() -> None:
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    for typed in (False, True):
        request = InferRequest.from_wire(wire(rows, typed=typed))
        request.check_metadata("toy", SPEC)
        assert request.typed is typed
        np.testing.assert_array_equal(request.arrays()["input"], rows)
        raw = request.tensors().get("input")
        assert (raw.shape, raw.data) == ((2, 4), rows.tobytes())


def test_streaming_is_asked_by_a_parameter_or_a_bool_input() -> None:
    rows = np.ones((1, 4), np.float32)
    assert not InferRequest.from_wire(wire(rows)).streams()
    assert InferRequest.from_wire(wire(rows, stream=True)).streams()
    assert not InferRequest.from_wire(wire(rows, stream=False)).streams()
    message = pb.ModelInferRequest(model_name="toy")
    codec.encode_request_inputs(message, {"input": rows, "stream": np.array([True])})
    assert InferRequest.from_wire(message).streams()


def test_a_result_goes_back_raw_or_typed_as_the_request_came() -> None:
    outputs = {"scores": np.array([[0.25, 0.75]], np.float32)}
    for raw in (True, False):
        result = InferResult(model_name="toy", id="r-7", outputs=outputs, raw=raw, parameters={"stratus.tier": "edge"})
        response = result.to_wire()
        assert bool(response.raw_output_contents) is raw
        assert (response.model_name, response.id) == ("toy", "r-7")
        assert response.parameters["stratus.tier"].string_param == "edge"
        np.testing.assert_array_equal(codec.decode_response_outputs(response)["scores"], outputs["scores"])
    tensors = Tensors.from_response(InferResult(model_name="toy", id="", outputs=outputs).to_wire())
    typed = InferResult(model_name="toy", id="", outputs=tensors, raw=False).to_wire()
    np.testing.assert_array_equal(codec.decode_response_outputs(typed)["scores"], outputs["scores"])
    assert not typed.raw_output_contents


def test_a_result_reports_only_sane_durations() -> None:
    result = InferResult(model_name="toy", id="", outputs={}, parameters={"stratus.queue_ms": 1.5})
    assert (result.queue_ms, result.compute_ms) == (1.5, None)
    assert InferResult(model_name="", id="", outputs={}, parameters={"stratus.queue_ms": -1.0}).queue_ms is None


def test_a_text_request_over_the_prompt_bound_is_refused_whoever_builds_it() -> None:
    params = GenerationParams(max_tokens=1)
    TextRequest(model_name="arith", id="", prompt="x" * MAX_PROMPT_BYTES, params=params)
    with pytest.raises(InvalidInput, match=f"over {MAX_PROMPT_BYTES} bytes"):
        TextRequest(model_name="arith", id="", prompt="é" * (MAX_PROMPT_BYTES // 2 + 1), params=params)
