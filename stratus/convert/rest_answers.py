"""The Open Inference Protocol's HTTP/REST answers (KServe v2, as Triton writes them), from
the protocol's protobuf messages: an inference answer as JSON ``data`` or binary where the
request asked (``parameters.binary_data`` on a requested output, or ``binary_data_output`` on
the request), Triton's generate answer, and any other message (metadata, config, statistics)
as Triton's JSON. FP16 has no JSON form in Triton's; here it does (numbers), so ``curl``
users are served too. Requests are read in :mod:`stratus.convert.rest`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from stratus.convert import codec
from stratus.convert.parameters import parameter_value
from stratus.convert.rest import BINARY_OUTPUT, BINARY_SIZE, RestRequest
from stratus.errors import InvalidInput
from stratus.wire import inference_pb2 as pb

_INT64: Final = frozenset(
    {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64}
)


def generate_response(response: pb.ModelInferResponse) -> dict[str, Any]:
    """Triton's generate answer: each output a field (one element as a value, more as a list),
    beside ``model_name`` and ``model_version`` (and Stratus's parameters)."""
    document: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        document["id"] = response.id
    raw = response.raw_output_contents
    for index, tensor in enumerate(response.outputs):
        data = _json_data(raw[index] if raw else codec.encode_raw(_output_array(tensor)), tensor)
        document[tensor.name] = data[0] if len(data) == 1 else data
    if response.parameters:
        document["parameters"] = parameters_json(response.parameters)
    return document


def infer_response(response: pb.ModelInferResponse, asked: RestRequest) -> tuple[bytes, int | None]:
    """(the body, the JSON header's length where binary data follows it, else None)."""
    outputs, blobs = [], []
    raw = response.raw_output_contents
    for index, tensor in enumerate(response.outputs):
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        parameters = parameters_json(tensor.parameters)
        data = raw[index] if raw else codec.encode_raw(_output_array(tensor))
        if asked.binary(tensor.name):
            parameters[BINARY_SIZE] = len(data)
            blobs.append(data)
        else:
            entry["data"] = _json_data(data, tensor)
        if parameters:
            entry["parameters"] = parameters
        outputs.append(entry)
    document: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        document["id"] = response.id
    if response.parameters:
        document["parameters"] = parameters_json(response.parameters)
    document["outputs"] = outputs
    header = json.dumps(document, separators=(",", ":")).encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _output_array(tensor: pb.ModelInferResponse.InferOutputTensor) -> Any:
    return codec.decode_contents(
        tensor.contents, tensor=tensor.name, datatype=tensor.datatype, shape=tensor.shape
    )


def _json_data(data: bytes, tensor: pb.ModelInferResponse.InferOutputTensor) -> list[Any]:
    array = codec.decode_raw(data, tensor=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
    if tensor.datatype != "BYTES":
        return list(array.ravel().tolist())
    try:
        return [bytes(v).decode("utf-8") for v in array.ravel()]
    except UnicodeDecodeError:
        raise InvalidInput(
            f"output '{tensor.name}' holds bytes that are not UTF-8 text; ask for it as binary data "
            f"(outputs[].parameters.{BINARY_OUTPUT} = true)"
        ) from None


def parameters_json(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in sorted(parameters.items())}


def message_json(message: Message) -> dict[str, Any]:
    """A protobuf message as the JSON Triton's REST API writes for it: field names as in the
    .proto, 64-bit integers as numbers (protobuf's own JSON mapping makes them strings, which
    no REST client of the protocol reads), maps as objects, unset fields left out."""
    out: dict[str, Any] = {}
    for descriptor, value in message.ListFields():
        out[descriptor.name] = _field_json(descriptor, value)
    return out


def _field_json(descriptor: FieldDescriptor, value: Any) -> Any:
    if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
        value_field = descriptor.message_type.fields_by_name["value"]
        return {key: _scalar_json(value_field, item) for key, item in value.items()}
    if descriptor.is_repeated:  # protobuf >= 6.31 (label() is deprecated there)
        return [_scalar_json(descriptor, item) for item in value]
    return _scalar_json(descriptor, value)


def _scalar_json(descriptor: FieldDescriptor, value: Any) -> Any:
    if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
        if isinstance(value, pb.InferParameter):
            return parameter_value(value)
        return message_json(value)
    if descriptor.type == FieldDescriptor.TYPE_ENUM and descriptor.enum_type is not None:
        known = descriptor.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if descriptor.type == FieldDescriptor.TYPE_BYTES:
        return value.decode("utf-8", "replace")
    if descriptor.type in _INT64:
        return int(value)
    return value
