"""A ModelInferRequest's counts and sizes read from its bytes, before protobuf parses it.

gRPC hands a server the request's bytes; parsing them into a message runs on the serving event
loop and costs by what the message holds, not by its size: 4 MiB of empty inputs is 200,000
messages (about 0.2 s and 150 MB parsed), 4 MiB of one-byte INT64 varints 32 MB. Every server
therefore takes inference requests as bytes and walks their fields here first, bounded in
steps, refusing a request that holds more than any model takes before anything is built from
it. Only then is it parsed, and its names, datatypes and shapes checked against the model.

Every limit is the same one the parsed request is held to later (64 inputs, rank 16), or a
bound no client of the Open Inference Protocol comes near (parameters, unpacked lists).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from google.protobuf.message import DecodeError

from stratus.convert.codec import MAX_INPUTS
from stratus.datatypes import MAX_RANK
from stratus.errors import InvalidInput
from stratus.wire import inference_pb2 as pb

# Parameters one request, input or output may carry (Stratus's own are six).
MAX_PARAMETERS: Final = 64
# Fields of the request itself: a name, a version, an id, and the lists above.
MAX_REQUEST_FIELDS: Final = 16 + 3 * MAX_INPUTS + MAX_PARAMETERS
# Fields of one input or requested output: name, datatype, shape, parameters, contents; a shape
# sent unpacked (one field per dimension) is legal protobuf, so it counts its dimensions.
MAX_TENSOR_FIELDS: Final = 8 + MAX_RANK + MAX_PARAMETERS
# Separate fields in every typed contents of a request together: each BYTES element is one (a
# batch of prompts of the most items a request holds), and numbers are packed by every encoder.
MAX_CONTENTS_FIELDS: Final = 4096
# What typed contents may take once parsed: a one-byte INT64 varint is 8 bytes parsed, and a
# BYTES element about 32 more than its text. 4 MiB is as much as the message limit lets a raw
# buffer carry; larger tensors go in raw_input_contents, as tritonclient sends them.
MAX_TYPED_BYTES: Final = 4 * 1024 * 1024

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
# ModelInferRequest's fields.
_MODEL_NAME, _ID, _PARAMETERS, _INPUTS, _OUTPUTS, _RAW = 1, 3, 4, 5, 6, 7
# InferInputTensor's (an output's parameters are field 2).
_SHAPE, _TENSOR_PARAMETERS, _CONTENTS = 3, 4, 5
_OUTPUT_PARAMETERS: Final = 2
# InferTensorContents: the bytes one element takes once parsed, by field number.
_PARSED_WIDTH: Final = {1: 1, 2: 4, 3: 8, 4: 4, 5: 8, 6: 4, 7: 8}
_WIRE_WIDTH: Final = {6: 4, 7: 8}  # packed floats are fixed width; varints at least one byte
_BYTES_CONTENTS: Final = 8
_BYTES_OVERHEAD: Final = 32


class _Malformed(Exception):
    """The bytes are not a protobuf message: a truncated varint or a length past the end."""


def read_infer_request(raw: bytes) -> pb.ModelInferRequest:
    """The request ``raw`` holds, once its fields are within bounds (else InvalidInput)."""
    check_infer_request(raw)
    try:
        return pb.ModelInferRequest.FromString(raw)
    except DecodeError as exc:
        raise InvalidInput(f"the request is not a valid ModelInferRequest: {exc}") from None


def check_infer_request(raw: bytes) -> None:
    """Refuse (InvalidInput) a request that holds more than any model takes, in bounded steps."""
    try:
        _check_request(memoryview(raw))
    except _Malformed as exc:
        raise InvalidInput(f"the request is not a valid ModelInferRequest: {exc}") from None


def request_header(raw: bytes) -> tuple[str, str]:
    """The model name and request id a refused request named, so that a stream's error for it
    still carries them ("" where the bytes do not say)."""
    found = {_MODEL_NAME: "", _ID: ""}
    try:
        for number, wire, start, end in _fields(
            memoryview(raw), 0, len(raw), MAX_REQUEST_FIELDS, "the request"
        ):
            if number in found and wire == _LENGTH:
                found[number] = bytes(raw[start : min(end, start + 256)]).decode("utf-8", "replace")
    except (_Malformed, InvalidInput):
        pass
    return found[_MODEL_NAME], found[_ID]


def _check_request(view: memoryview) -> None:
    counts = {_PARAMETERS: 0, _INPUTS: 0, _OUTPUTS: 0, _RAW: 0}
    budget = _ContentsBudget()
    for number, wire, start, end in _fields(view, 0, len(view), MAX_REQUEST_FIELDS, "the request"):
        if number not in counts or wire != _LENGTH:
            continue
        counts[number] += 1
        if number == _INPUTS:
            _check_tensor(
                view, start, end, counts[_INPUTS], parameters_field=_TENSOR_PARAMETERS, budget=budget
            )
        elif number == _OUTPUTS:
            _check_tensor(
                view, start, end, counts[_OUTPUTS], parameters_field=_OUTPUT_PARAMETERS, budget=None
            )
    # inputs and requested outputs were counted as they came (_check_tensor refuses the 65th)
    _at_most(counts[_RAW], MAX_INPUTS, "raw_input_contents buffers", "the request")
    _at_most(counts[_PARAMETERS], MAX_PARAMETERS, "parameters", "the request")


def _check_tensor(
    view: memoryview,
    start: int,
    end: int,
    position: int,
    *,
    parameters_field: int,
    budget: _ContentsBudget | None,
) -> None:
    what = f"{'input' if budget is not None else 'requested output'} #{position}"
    _at_most(position, MAX_INPUTS, "inputs" if budget is not None else "requested outputs", "the request")
    parameters = dims = 0
    for number, wire, value_start, value_end in _fields(view, start, end, MAX_TENSOR_FIELDS, what):
        if number == parameters_field:
            parameters += 1
        elif budget is not None and number == _SHAPE:
            dims += value_end - value_start if wire == _LENGTH else 1  # packed: at least a byte each
        elif budget is not None and number == _CONTENTS and wire == _LENGTH:
            budget.take(view, value_start, value_end, what)
    _at_most(parameters, MAX_PARAMETERS, "parameters", what)
    if dims > MAX_RANK * 10:  # ten bytes is the longest varint: no rank-16 shape is longer
        raise InvalidInput(f"{what}: its shape takes {dims} bytes; a shape has at most {MAX_RANK} dimensions")


class _ContentsBudget:
    """Typed contents of one request, counted as what they would take once parsed."""

    def __init__(self) -> None:
        self.parsed = 0
        self.fields = 0

    def take(self, view: memoryview, start: int, end: int, what: str) -> None:
        # one step past the bound, so that the request-wide count below is what refuses
        for number, wire, value_start, value_end in _fields(view, start, end, MAX_CONTENTS_FIELDS + 1, what):
            self.fields += 1
            _at_most(self.fields, MAX_CONTENTS_FIELDS, "separate typed-contents fields", "the request")
            self.parsed += _parsed_bytes(number, wire, value_end - value_start)
            if self.parsed > MAX_TYPED_BYTES:
                raise InvalidInput(
                    f"{what}: typed contents would take over {MAX_TYPED_BYTES} bytes once parsed; "
                    "send a tensor this large as raw_input_contents"
                )


def _parsed_bytes(number: int, wire: int, length: int) -> int:
    """The most one typed-contents field can take parsed (``length`` is its value's bytes)."""
    if number == _BYTES_CONTENTS:
        return length + _BYTES_OVERHEAD
    width = _PARSED_WIDTH.get(number)
    if width is None:
        return 0  # an unknown field is kept as its bytes, which the message limit bounds
    if wire != _LENGTH:
        return width  # one element, unpacked
    return length // _WIRE_WIDTH.get(number, 1) * width


def _at_most(count: int, most: int, what: str, where: str) -> None:
    if count > most:
        raise InvalidInput(f"{where} holds more than {most} {what}; at most {most} are taken")


def _fields(
    view: memoryview, position: int, end: int, most: int, where: str
) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value start, value end) for each field in ``view[position:end]``;
    past ``most`` fields the message is refused, so a walk never takes more steps than that."""
    seen = 0
    while position < end:
        seen += 1
        if seen > most:
            raise InvalidInput(
                f"{where} holds more than {most} fields; no request of a model here holds as many"
            )
        key, position = _varint(view, position, end)
        number, wire = key >> 3, key & 7
        start = position
        if wire == _VARINT:
            _, position = _varint(view, position, end)
        elif wire == _FIXED64:
            position += 8
        elif wire == _FIXED32:
            position += 4
        elif wire == _LENGTH:
            length, start = _varint(view, position, end)
            position = start + length
        else:
            raise _Malformed(f"field {number} has wire type {wire}, which Stratus's messages never use")
        if position > end or number == 0:
            raise _Malformed(f"field {number} runs past the end of its message")
        yield number, wire, start, position


def _varint(view: memoryview, position: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= end or shift > 63:
            raise _Malformed("a varint is cut off or longer than ten bytes")
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
