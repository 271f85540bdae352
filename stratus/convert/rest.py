"""The Open Inference Protocol's HTTP/REST wire (KServe v2, as Triton serves it) to and from
the protocol's protobuf messages: requests here, answers in ``rest_answers``, and nowhere else.

A REST request is a JSON header, optionally followed by binary tensor data (Triton's binary
extension, which ``tritonclient.http`` uses by default): the header's length is then the
``Inference-Header-Content-Length`` HTTP header, and each input sent so says its length in
``parameters.binary_data_size``. A request becomes the same ``ModelInferRequest`` a gRPC
client would send, so both fronts share one data plane, one set of checks and one set of
errors: JSON ``data`` lands in the typed ``contents`` lists (checked for count and range by
:func:`stratus.codec.decode_contents`, as a gRPC client's typed tensors are) and binary data
in ``raw_input_contents``. Where a request mixes the two, every input goes raw, as the
protocol wants raw for all inputs or none.

Answers go back through :mod:`stratus.convert.rest_answers`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from stratus.convert import codec
from stratus.convert.parameters import set_parameter
from stratus.datatypes import spec_of
from stratus.errors import InvalidInput
from stratus.wire import inference_pb2 as pb

HEADER_LENGTH: Final = "Inference-Header-Content-Length"
BINARY_SIZE: Final = "binary_data_size"
BINARY_OUTPUT: Final = "binary_data"
ALL_BINARY: Final = "binary_data_output"
_REQUEST_FIELDS: Final = frozenset({"id", "parameters", "inputs", "outputs"})
_INPUT_FIELDS: Final = frozenset({"name", "shape", "datatype", "parameters", "data"})
_OUTPUT_FIELDS: Final = frozenset({"name", "parameters"})


@dataclass(frozen=True, kw_only=True)
class RestRequest:
    """A REST inference request as the protocol's message, and how its answer is to be written."""

    message: pb.ModelInferRequest
    binary_outputs: frozenset[str] = frozenset()  # outputs asked as binary data
    all_binary: bool = False  # every output binary (``binary_data_output``)
    json_outputs: frozenset[str] = field(default_factory=frozenset)  # asked as JSON explicitly

    def binary(self, output: str) -> bool:
        return output in self.binary_outputs or (self.all_binary and output not in self.json_outputs)


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """(the JSON header, the binary data after it), from the body and the HTTP header that says
    where the JSON ends (absent: the whole body is JSON)."""
    if header_length is None:
        return body, memoryview(b"")
    try:
        length = int(header_length)
    except ValueError:
        raise InvalidInput(
            f"{HEADER_LENGTH} must be a whole number of bytes, not {header_length[:32]!r}"
        ) from None
    if not 0 <= length <= len(body):
        raise InvalidInput(f"{HEADER_LENGTH} is {length}, but the body holds {len(body)} bytes")
    return body[:length], memoryview(body)[length:]


def parse_json(text: bytes, what: str = "the request") -> dict[str, Any]:
    """A JSON object, or InvalidInput saying why not (nesting too deep included)."""
    try:
        value = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput(f"{what} nests JSON deeper than any tensor") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def infer_request(model: str, version: str, body: bytes, header_length: str | None) -> RestRequest:
    """The ``ModelInferRequest`` a REST body asks for, every field checked; InvalidInput
    naming the field otherwise."""
    header, binary = split_body(body, header_length)
    document = parse_json(header)
    _check_keys(document, _REQUEST_FIELDS, "the request")
    message = pb.ModelInferRequest(
        model_name=model, model_version=version, id=_text(document, "id", "the request")
    )
    parameters = dict(_object(document, "parameters", "the request"))
    all_binary = parameters.pop(ALL_BINARY, False)
    if not isinstance(all_binary, bool):
        raise InvalidInput(f"parameters.{ALL_BINARY} must be true or false")
    _write_parameters(message.parameters, parameters, "the request")
    _write_inputs(message, _list(document, "inputs", "the request"), binary)
    binary_outputs, json_outputs = _write_outputs(
        message, _list(document, "outputs", "the request", required=False)
    )
    return RestRequest(
        message=message, binary_outputs=binary_outputs, all_binary=all_binary, json_outputs=json_outputs
    )


def _write_inputs(message: pb.ModelInferRequest, inputs: Sequence[Any], binary: memoryview) -> None:
    if len(inputs) > codec.MAX_INPUTS:
        raise InvalidInput(f"the request names {len(inputs)} inputs; at most {codec.MAX_INPUTS} are taken")
    raws: list[bytes | None] = []
    offset = 0
    for index, entry in enumerate(inputs):
        where = f"inputs[{index}]"
        if not isinstance(entry, dict):
            raise InvalidInput(f"{where} must be a JSON object")
        _check_keys(entry, _INPUT_FIELDS, where)
        tensor = message.inputs.add(name=_text(entry, "name", where, required=True))
        tensor.datatype = _text(entry, "datatype", where, required=True)
        tensor.shape.extend(_shape(entry, where))
        parameters = dict(_object(entry, "parameters", where))
        size = parameters.pop(BINARY_SIZE, None)
        _write_parameters(tensor.parameters, parameters, where)
        if size is None:
            raws.append(_write_data(tensor, entry, where))
            continue
        if "data" in entry:
            raise InvalidInput(f"{where} has both data and parameters.{BINARY_SIZE}; send one")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInput(f"{where}: parameters.{BINARY_SIZE} must be a whole number of bytes")
        if offset + size > len(binary):
            raise InvalidInput(
                f"{where} ('{tensor.name}') claims {size} bytes of binary data, {len(binary) - offset} remain"
            )
        raws.append(bytes(binary[offset : offset + size]))
        offset += size
    if offset != len(binary):
        raise InvalidInput(f"the body holds {len(binary) - offset} bytes of binary data no input claims")
    if any(raw is not None for raw in raws):
        _all_raw(message, raws)


def _write_data(
    tensor: pb.ModelInferRequest.InferInputTensor, entry: Mapping[str, Any], where: str
) -> bytes | None:
    """JSON data into the typed contents list of its datatype (flattened, row-major); FP16,
    which has no typed list, comes back as its raw buffer instead."""
    if "data" not in entry:
        raise InvalidInput(f"{where} ('{tensor.name}') has neither data nor parameters.{BINARY_SIZE}")
    spec = spec_of(tensor.datatype, tensor.name)
    values = _flat(entry["data"], math.prod(tensor.shape), f"{where} ('{tensor.name}')")
    if spec.name == "FP16":
        return np.asarray(_numbers(values, where, tensor.name), dtype=spec.dtype).tobytes()
    target = getattr(tensor.contents, str(spec.field))
    try:
        if spec.name == "BYTES":
            target.extend(v.encode() if isinstance(v, str) else _bad_bytes(v, where) for v in values)
        else:
            target.extend(values)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{where} ('{tensor.name}'): data does not fit {tensor.datatype}: {exc}") from None
    return None


def _bad_bytes(value: object, where: str) -> bytes:
    raise InvalidInput(f"{where}: BYTES data must be strings, not {type(value).__name__}")


def _numbers(values: Sequence[Any], where: str, name: str) -> list[float]:
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise InvalidInput(f"{where} ('{name}'): FP16 data must be numbers")
    return [float(v) for v in values]


def _flat(data: Any, expected: int, where: str) -> list[Any]:
    """Nested JSON lists flattened in row-major order, without recursion; the count checked."""
    if not isinstance(data, list):
        data = [data]
    flat: list[Any] = []
    pending = [iter(data)]
    while pending:
        item = next(pending[-1], _END)
        if item is _END:
            pending.pop()
        elif isinstance(item, list):
            pending.append(iter(item))
        else:
            flat.append(item)
            if len(flat) > expected:
                break
    if len(flat) != expected:
        shown = f"more than {expected}" if len(flat) > expected else str(len(flat))
        raise InvalidInput(f"{where}: data holds {shown} values, its shape needs {expected}")
    return flat


_END: Final = object()


def _all_raw(message: pb.ModelInferRequest, raws: Sequence[bytes | None]) -> None:
    """Every input as a raw buffer: the protocol takes raw for all inputs or for none."""
    for tensor, given in zip(message.inputs, raws, strict=True):
        if given is None:
            array = codec.decode_contents(
                tensor.contents, tensor=tensor.name, datatype=tensor.datatype, shape=tensor.shape
            )
            tensor.ClearField("contents")
        message.raw_input_contents.append(codec.encode_raw(array) if given is None else given)


def _write_outputs(
    message: pb.ModelInferRequest, outputs: Sequence[Any]
) -> tuple[frozenset[str], frozenset[str]]:
    binary: set[str] = set()
    text: set[str] = set()
    for index, entry in enumerate(outputs):
        where = f"outputs[{index}]"
        if not isinstance(entry, dict):
            raise InvalidInput(f"{where} must be a JSON object")
        _check_keys(entry, _OUTPUT_FIELDS, where)
        name = _text(entry, "name", where, required=True)
        parameters = dict(_object(entry, "parameters", where))
        wants = parameters.pop(BINARY_OUTPUT, None)
        if "classification" in parameters:
            raise InvalidInput(
                f"{where}: the classification extension is not served here; read the output's data"
            )
        if wants is not None and not isinstance(wants, bool):
            raise InvalidInput(f"{where}: parameters.{BINARY_OUTPUT} must be true or false")
        (binary if wants else text if wants is False else set()).add(name)
        requested = message.outputs.add(name=name)
        _write_parameters(requested.parameters, parameters, where)
    return frozenset(binary), frozenset(text)


def _write_parameters(target: Mapping[str, pb.InferParameter], values: Mapping[str, Any], where: str) -> None:
    for key, value in values.items():
        if not isinstance(value, bool | int | float | str):
            raise InvalidInput(f"{where}: parameter '{key}' must be a boolean, number or string")
        try:
            set_parameter(target, key, value)
        except ValueError:
            raise InvalidInput(f"{where}: parameter '{key}' is out of range") from None


def _check_keys(document: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(set(document) - known)
    if unknown:
        raise InvalidInput(f"{where} has unknown field '{unknown[0]}'; it takes {', '.join(sorted(known))}")


def _text(document: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> str:
    value = document.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise InvalidInput(f"{where}: '{key}' must be a {'non-empty ' if required else ''}string")
    return value


def _object(document: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = document.get(key, {})
    if not isinstance(value, dict):
        raise InvalidInput(f"{where}: '{key}' must be a JSON object")
    return value


def _list(document: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> list[Any]:
    if key not in document and not required:
        return []
    value = document.get(key)
    if not isinstance(value, list) or (required and not value):
        raise InvalidInput(f"{where}: '{key}' must be a {'non-empty ' if required else ''}list")
    return value


def _shape(entry: Mapping[str, Any], where: str) -> list[int]:
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise InvalidInput(f"{where}: 'shape' must be a list of whole numbers")
    if any(d < 0 for d in shape):
        raise InvalidInput(f"{where}: 'shape' {shape} has a negative dimension")
    return shape


def generate_request(model: str, version: str, body: bytes) -> pb.ModelInferRequest:
    """Triton's generate extension: each field of the JSON object but ``id`` and ``parameters``
    is an input of that name (a string is BYTES, a boolean BOOL, a whole number INT64, any other
    number FP64; a list of one kind, a tensor of its length), ``parameters`` are the request's."""
    document = parse_json(body)
    message = pb.ModelInferRequest(
        model_name=model, model_version=version, id=_text(document, "id", "the request")
    )
    _write_parameters(message.parameters, _object(document, "parameters", "the request"), "the request")
    fields = [(key, value) for key, value in document.items() if key not in ("id", "parameters")]
    if not fields:
        raise InvalidInput("the request names no input (a generative model takes 'text_input')")
    if len(fields) > codec.MAX_INPUTS:
        raise InvalidInput(f"the request names {len(fields)} inputs; at most {codec.MAX_INPUTS} are taken")
    inputs = {key: _generate_input(key, value) for key, value in fields}
    codec.encode_request_inputs(message, inputs)
    return message


def _generate_input(name: str, value: Any) -> Any:
    values = value if isinstance(value, list) else [value]
    kinds = {_kind(v) for v in values}
    if len(kinds) != 1 or None in kinds:
        raise InvalidInput(f"'{name}' must be a string, boolean or number, or a list of one of those")
    kind = kinds.pop()
    if kind == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = [v.encode() for v in values]
        return array
    try:
        return np.asarray(values, dtype={"BOOL": np.bool_, "INT64": np.int64, "FP64": np.float64}[str(kind)])
    except OverflowError:
        raise InvalidInput(f"'{name}' holds a number out of range") from None


def _kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "BYTES"
    if isinstance(value, bool):
        return "BOOL"
    if isinstance(value, int):
        return "INT64"
    return "FP64" if isinstance(value, float) else None
