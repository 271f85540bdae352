"""Numpy arrays to and from the Open Inference Protocol's tensors.

A tensor travels either as one little-endian buffer in ``raw_input_contents`` /
``raw_output_contents`` (the fast path every serious client uses) or in the typed
``contents`` lists. Decoding never trusts the sender: every size, count and dimension is
checked before numpy sees the bytes, and each problem raises
:class:`~stratus.errors.InvalidInput` naming the tensor and what is wrong.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Final

import numpy as np

from stratus.datatypes import SPECS, Array, Datatype, checked_shape, datatype_of, numpy_dtype, spec_of
from stratus.errors import InvalidInput
from stratus.wire import inference_pb2 as pb

# Inputs one request may name: the Open Inference Protocol sets no bound, and each input is
# checked on the serving event loop; no model here takes more than a handful.
MAX_INPUTS: Final = 64
_LENGTH_PREFIX: Final = struct.Struct("<I")


def decode_raw(raw: bytes, *, tensor: str, datatype: str, shape: Sequence[int]) -> Array:
    """Decode one raw buffer; its length must match shape x datatype exactly."""
    spec = spec_of(datatype, tensor)
    dims = checked_shape(shape, tensor=tensor)
    count = math.prod(dims)
    if spec.name == "BYTES":
        return _decode_raw_bytes(raw, tensor=tensor, dims=dims)
    expected = count * spec.dtype.itemsize
    if len(raw) != expected:
        raise InvalidInput(
            f"tensor '{tensor}': raw buffer holds {len(raw)} bytes, but shape {list(dims)} "
            f"of {datatype} needs {expected}"
        )
    array = np.frombuffer(raw, dtype=spec.dtype).reshape(dims)
    if spec.name == "BOOL" and count and not np.isin(array.view(np.uint8), (0, 1)).all():
        raise InvalidInput(f"tensor '{tensor}': BOOL bytes must be 0 or 1")
    return array


def _decode_raw_bytes(raw: bytes, *, tensor: str, dims: tuple[int, ...]) -> Array:
    """BYTES raw format: each element is a 4-byte little-endian length, then the bytes."""
    count = math.prod(dims)
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if len(items) == count:
            raise InvalidInput(f"tensor '{tensor}': raw BYTES buffer holds more than {count} elements")
        if offset + 4 > len(raw):
            raise InvalidInput(f"tensor '{tensor}': raw BYTES buffer ends inside a length prefix")
        (length,) = _LENGTH_PREFIX.unpack_from(raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput(
                f"tensor '{tensor}': raw BYTES element {len(items)} claims {length} bytes, "
                f"only {len(raw) - offset} remain"
            )
        items.append(raw[offset : offset + length])
        offset += length
    if len(items) != count:
        raise InvalidInput(
            f"tensor '{tensor}': raw BYTES buffer holds {len(items)} elements, shape {list(dims)} needs {count}"
        )
    return _object_array(items, dims)


def _object_array(items: Sequence[bytes], dims: tuple[int, ...]) -> Array:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array.reshape(dims)


def decode_contents(
    contents: pb.InferTensorContents, *, tensor: str, datatype: str, shape: Sequence[int]
) -> Array:
    """Decode the typed ``contents`` of one tensor, checking count and value range."""
    spec = spec_of(datatype, tensor)
    dims = checked_shape(shape, tensor=tensor)
    if spec.field is None:
        raise InvalidInput(f"tensor '{tensor}': {datatype} has no typed contents; send it raw")
    values = getattr(contents, spec.field)
    count = math.prod(dims)
    if len(values) != count:
        raise InvalidInput(
            f"tensor '{tensor}': {spec.field} holds {len(values)} values, shape {list(dims)} needs {count}"
        )
    _check_no_other_contents(contents, spec.field, tensor)
    if spec.name == "BYTES":
        return _object_array(list(values), dims)
    wide = np.fromiter(values, dtype=_wide_dtype(spec), count=count)  # no list of Python objects
    if spec.dtype.kind in "iu" and count:
        info = np.iinfo(spec.dtype)
        if int(wide.min()) < info.min or int(wide.max()) > info.max:
            raise InvalidInput(f"tensor '{tensor}': a value lies outside the range of {datatype}")
    return wide.astype(spec.dtype).reshape(dims)


def _wide_dtype(spec: Datatype) -> type[np.generic]:
    """A dtype that holds every value of the typed list, so narrowing can be range-checked."""
    if spec.dtype.kind == "f":
        return np.float64
    if spec.dtype.kind == "b":
        return np.bool_
    return np.uint64 if spec.name == "UINT64" else np.int64


def _check_no_other_contents(contents: pb.InferTensorContents, field: str, tensor: str) -> None:
    for other in {d.field for d in SPECS.values() if d.field and d.field != field}:
        if len(getattr(contents, other)):
            raise InvalidInput(f"tensor '{tensor}': {other} is set, but its datatype uses {field}")


def encode_raw(array: Array) -> bytes:
    """One little-endian buffer for an array (length-prefixed elements for BYTES)."""
    if datatype_of(array) == "BYTES":
        return b"".join(_LENGTH_PREFIX.pack(len(b)) + b for b in (_as_bytes(v) for v in array.flat))
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def _as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise InvalidInput(f"a BYTES tensor holds a {type(value).__name__}; expected bytes or str")


def encode_contents(array: Array, contents: pb.InferTensorContents) -> None:
    """Fill the typed ``contents`` lists (for clients that do not read raw buffers)."""
    spec = SPECS[datatype_of(array)]
    if spec.field is None:
        raise InvalidInput(f"{spec.name} has no typed contents; encode it raw")
    target = getattr(contents, spec.field)
    if spec.name == "BYTES":
        target.extend(_as_bytes(v) for v in array.flat)
    else:
        target.extend(array.ravel().tolist())


def decode_request_inputs(request: pb.ModelInferRequest) -> dict[str, Array]:
    """All inputs of a request as arrays, after checking their number, names and sizes."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"request has {len(raw)} raw_input_contents buffers for {len(request.inputs)} inputs; "
            "they must match one to one"
        )
    check_input_count(request)
    decoded: dict[str, Array] = {}
    for index, tensor in enumerate(request.inputs):
        name = tensor.name or f"#{index}"
        if name in decoded:
            raise InvalidInput(f"input '{name}' appears more than once")
        decoded[name] = decode_input(tensor, raw[index] if raw else None, name)
    return decoded


def check_input_count(request: pb.ModelInferRequest) -> None:
    """Refuse more inputs than any model takes, before looking at any of them."""
    if len(request.inputs) > MAX_INPUTS:
        raise InvalidInput(f"request names {len(request.inputs)} inputs; at most {MAX_INPUTS} are taken")


def decode_input(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, name: str) -> Array:
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidInput(f"input '{name}' has both typed contents and a raw buffer")
        return decode_raw(raw, tensor=name, datatype=tensor.datatype, shape=tensor.shape)
    if not tensor.HasField("contents"):
        spec_of(tensor.datatype, name)
        checked_shape(tensor.shape, tensor=name)
        if math.prod(tensor.shape) == 0:
            return np.empty(tuple(tensor.shape), dtype=numpy_dtype(tensor.datatype, tensor=name))
        raise InvalidInput(f"input '{name}' carries no data: neither contents nor a raw buffer")
    return decode_contents(tensor.contents, tensor=name, datatype=tensor.datatype, shape=tensor.shape)


def encode_request_inputs(
    request: pb.ModelInferRequest, inputs: Mapping[str, Array], *, raw: bool = True
) -> None:
    """Append inputs to a request, raw (default) or as typed contents."""
    for name, array in inputs.items():
        tensor = request.inputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
        if raw:
            request.raw_input_contents.append(encode_raw(array))
        else:
            encode_contents(array, tensor.contents)


def encode_response_outputs(
    response: pb.ModelInferResponse, outputs: Mapping[str, Array], *, raw: bool = True
) -> None:
    """Append outputs to a response; raw buffers unless the caller asks for typed contents."""
    for name, array in outputs.items():
        tensor = response.outputs.add(name=name, datatype=datatype_of(array), shape=array.shape)
        if raw:
            response.raw_output_contents.append(encode_raw(array))
        else:
            encode_contents(array, tensor.contents)


def decode_response_outputs(response: pb.ModelInferResponse) -> dict[str, Array]:
    """All outputs of a response as arrays, checked like inputs."""
    raw = response.raw_output_contents
    if raw and len(raw) != len(response.outputs):
        raise InvalidInput(
            f"response has {len(raw)} raw_output_contents buffers for {len(response.outputs)} outputs"
        )
    decoded: dict[str, Array] = {}
    for index, tensor in enumerate(response.outputs):
        if raw:
            decoded[tensor.name] = decode_raw(
                raw[index], tensor=tensor.name, datatype=tensor.datatype, shape=tensor.shape
            )
        else:
            decoded[tensor.name] = decode_contents(
                tensor.contents, tensor=tensor.name, datatype=tensor.datatype, shape=tensor.shape
            )
    return decoded
