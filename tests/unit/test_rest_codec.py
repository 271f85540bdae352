"""The REST wire's codec (stratus/convert/rest.py) against tritonclient.http's own request
writer and response reader, and every refusal by the field it names."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton_http

from stratus.convert import codec, rest, rest_answers
from stratus.convert.parameters import values_of
from stratus.errors import InvalidInput
from stratus.wire import inference_pb2 as pb


def client_body(inputs: list[triton_http.InferInput], **kwargs: Any) -> tuple[bytes, str | None]:
    body, json_size = triton_http.InferenceServerClient.generate_request_body(inputs, **kwargs)
    return body, None if json_size is None else str(json_size)


def tensor(name: str, array: np.ndarray, datatype: str, *, binary: bool) -> triton_http.InferInput:
    made = triton_http.InferInput(name, list(array.shape), datatype)
    made.set_data_from_numpy(array, binary_data=binary)
    return made


def decoded(message: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    return codec.decode_request_inputs(message)


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_requests_decode_to_the_arrays_sent(binary: bool) -> None:
    rng = np.random.default_rng(3)
    floats = rng.random((3, 4), dtype=np.float32)
    ints = rng.integers(-100, 100, (3,), dtype=np.int64)
    texts = np.array([b"a", "\u00e9".encode(), b""], dtype=object)
    inputs = [
        tensor("x", floats, "FP32", binary=binary),
        tensor("n", ints, "INT64", binary=binary),
        tensor("t", texts, "BYTES", binary=binary),
    ]
    body, length = client_body(inputs, request_id="9", parameters={"stratus.max_tier": "edge", "k": 2})
    asked = rest.infer_request("m", "1", body, length)
    assert (asked.message.model_name, asked.message.model_version, asked.message.id) == ("m", "1", "9")
    assert values_of(asked.message.parameters) == {"stratus.max_tier": "edge", "k": 2}
    arrays = decoded(asked.message)
    assert np.array_equal(arrays["x"], floats) and arrays["x"].dtype == np.float32
    assert np.array_equal(arrays["n"], ints)
    assert list(arrays["t"]) == list(texts)
    assert bool(asked.message.raw_input_contents) is binary


def test_json_and_binary_inputs_mixed_all_go_raw() -> None:
    a, b = np.arange(4, dtype=np.float32).reshape(2, 2), np.array([True, False])
    body, length = client_body([tensor("a", a, "FP32", binary=True), tensor("b", b, "BOOL", binary=False)])
    message = rest.infer_request("m", "", body, length).message
    assert len(message.raw_input_contents) == 2
    assert not any(t.HasField("contents") for t in message.inputs)
    arrays = decoded(message)
    assert np.array_equal(arrays["a"], a) and np.array_equal(arrays["b"], b)


def test_nested_json_data_is_row_major_and_fp16_is_taken_as_numbers() -> None:
    document = {
        "inputs": [
            {"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [[1, 2, 3], [4, 5, 6]]},
            {"name": "h", "shape": [2], "datatype": "FP16", "data": [0.5, -2]},
        ]
    }
    message = rest.infer_request("m", "", json.dumps(document).encode(), None).message
    arrays = decoded(message)
    assert arrays["x"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert arrays["h"].dtype == np.float16 and arrays["h"].tolist() == [0.5, -2.0]


def _refusal(document: Any, header_length: str | None = None, tail: bytes = b"") -> str:
    body = (document if isinstance(document, bytes) else json.dumps(document).encode()) + tail
    with pytest.raises(InvalidInput) as refused:
        rest.infer_request("m", "", body, header_length)
    return str(refused.value)


def _one(**entry: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", **entry}]}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (b"{", "not valid JSON"),
        (b"[" * 100_000, "nests JSON deeper"),
        (b"[1]", "must be a JSON object, not list"),
        ({"inputs": [], "extra": 1}, "unknown field 'extra'"),
        ({"inputs": []}, "'inputs' must be a non-empty list"),
        (_one(data=[1.0]), "holds 1 values, its shape needs 2"),
        (_one(data=[[1.0, 2.0, 3.0]]), "holds more than 2 values"),
        (_one(data=["a", "b"]), "does not fit FP32"),
        (_one(), "has neither data nor parameters.binary_data_size"),
        (_one(data=[1, 2], parameters={"binary_data_size": 8}), "has both data and"),
        ({"inputs": [{"name": "x", "shape": [1, -2], "datatype": "FP32", "data": []}]}, "negative dimension"),
        (
            {"inputs": [{"name": "x", "shape": "1,2", "datatype": "FP32", "data": []}]},
            "list of whole numbers",
        ),
        ({"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]}, "'name' must be a non-empty string"),
        (_one(data=[1, 2], parameters={"p": [1]}), "parameter 'p' must be a boolean, number or string"),
        (_one(data=[1, 2], parameters={"p": 1 << 70}), "parameter 'p' is out of range"),
        (
            {**_one(data=[1, 2]), "outputs": [{"name": "y", "parameters": {"classification": 3}}]},
            "classification",
        ),
        ({**_one(data=[1, 2]), "parameters": {"binary_data_output": "yes"}}, "must be true or false"),
        (
            {"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": [3]}]},
            "BYTES data must be strings",
        ),
        (
            {"inputs": [{"name": "h", "shape": [1], "datatype": "FP16", "data": [True]}]},
            "FP16 data must be numbers",
        ),
    ],
)
def test_malformed_requests_are_refused_by_what_is_wrong(document: Any, message: str) -> None:
    assert message in _refusal(document)


def test_typed_values_are_range_checked_as_a_grpc_clients_are() -> None:
    """JSON data lands in the typed contents, so decoding checks it as it checks gRPC's."""
    document = {"inputs": [{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}]}
    message = rest.infer_request("m", "", json.dumps(document).encode(), None).message
    with pytest.raises(InvalidInput, match="outside the range of INT8"):
        decoded(message)


def test_binary_data_is_claimed_exactly() -> None:
    header = json.dumps(_one(parameters={"binary_data_size": 8})).encode()
    data = np.array([1.0, 2.0], np.float32).tobytes()
    message = rest.infer_request("m", "", header + data, str(len(header))).message
    assert decoded(message)["x"].tolist() == [[1.0, 2.0]]
    assert "claims 8 bytes of binary data, 4 remain" in _refusal(header, str(len(header)), data[:4])
    assert "4 bytes of binary data no input claims" in _refusal(header, str(len(header)), data + b"\0" * 4)
    assert "must be a whole number of bytes" in _refusal(header, "ten", data)
    assert f"is {len(header) + 99}, but the body holds" in _refusal(header, str(len(header) + 99), data)


def _answer() -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name="m", model_version="1", id="r")
    codec.encode_response_outputs(
        response,
        {"p": np.array([[0.25, 0.75]], np.float32), "t": np.array([b"ok"], dtype=object)},
        raw=True,
    )
    response.parameters["stratus.tier"].string_param = "edge"
    return response


@pytest.mark.parametrize(
    ("outputs", "all_binary", "binary"),
    [
        (None, False, set()),
        (None, True, {"p", "t"}),
        ([("p", True)], False, {"p"}),
        ([("p", False), ("t", None)], True, {"t"}),  # binary_data false overrides the request's default
    ],
)
def test_answers_read_back_by_tritonclient(outputs: Any, all_binary: bool, binary: set[str]) -> None:
    document: dict[str, Any] = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}
    if outputs is not None:
        document["outputs"] = [
            {"name": n, **({"parameters": {"binary_data": b}} if b is not None else {})} for n, b in outputs
        ]
    if all_binary:
        document["parameters"] = {"binary_data_output": True}
    asked = rest.infer_request("m", "", json.dumps(document).encode(), None)
    body, header_length = rest_answers.infer_response(_answer(), asked)
    assert (header_length is not None) is bool(binary)
    result = triton_http.InferResult.from_response_body(body, header_length=header_length)
    assert result.as_numpy("p").tolist() == [[0.25, 0.75]]
    # tritonclient reads BYTES as str from JSON, as bytes from binary data: both are 'ok'
    assert [v if isinstance(v, bytes) else v.encode() for v in result.as_numpy("t")] == [b"ok"]
    response = result.get_response()
    assert response["id"] == "r" and response["parameters"] == {"stratus.tier": "edge"}
    sent_binary = {o["name"] for o in response["outputs"] if "binary_data_size" in o.get("parameters", {})}
    assert sent_binary == binary


def test_text_that_is_not_utf8_must_be_asked_as_binary() -> None:
    response = pb.ModelInferResponse(model_name="m")
    codec.encode_response_outputs(response, {"t": np.array([b"\xff"], dtype=object)}, raw=True)
    asked = rest.infer_request("m", "", json.dumps(_one(data=[1, 2])).encode(), None)
    with pytest.raises(InvalidInput, match="not UTF-8 text; ask for it as binary data"):
        rest_answers.infer_response(response, asked)


def test_messages_become_the_json_triton_writes() -> None:
    metadata = pb.ModelMetadataResponse(name="m", versions=["1"], platform="p")
    metadata.inputs.add(name="x", datatype="FP32", shape=[-1, 64])
    assert rest_answers.message_json(metadata) == {
        "name": "m",
        "versions": ["1"],
        "platform": "p",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}],
    }
    stats = pb.ModelStatisticsResponse()
    stats.model_stats.add(name="m", inference_count=5).inference_stats.success.ns = 1 << 40
    assert rest_answers.message_json(stats) == {
        "model_stats": [{"name": "m", "inference_count": 5, "inference_stats": {"success": {"ns": 1 << 40}}}]
    }


def test_generate_fields_become_inputs_and_its_answer_fields() -> None:
    body = {"id": "g", "text_input": "1+1=", "stream": False, "k": [1, 2], "parameters": {"max_tokens": 3}}
    message = rest.generate_request("arith", "", json.dumps(body).encode())
    arrays = decoded(message)
    assert list(arrays["text_input"]) == [b"1+1="]
    assert arrays["stream"].tolist() == [False] and arrays["k"].tolist() == [1, 2]
    assert message.id == "g" and values_of(message.parameters) == {"max_tokens": 3}
    for bad, why in (({"parameters": {}}, "names no input"), ({"x": [1, "a"]}, "'x' must be a string")):
        with pytest.raises(InvalidInput, match=why):
            rest.generate_request("arith", "", json.dumps(bad).encode())
    response = pb.ModelInferResponse(model_name="arith", id="g")
    codec.encode_response_outputs(response, {"text_output": np.array([b"2"], dtype=object)}, raw=True)
    assert rest_answers.generate_response(response) == {
        "model_name": "arith",
        "model_version": "",
        "id": "g",
        "text_output": "2",
    }
