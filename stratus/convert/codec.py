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
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from stratus.errors import InvalidInput
from stratus.wire import inference_pb2 as pb

Array = npt.NDArray[Any]

# Largest tensor a peer may describe; the message size limits bound it further in practice.
MAX_ELEMENTS: Final = 1 << 31
MAX_RANK: Final = 16
# Inputs one request may name: the Open Inference Protocol sets no bound, and each input is
# checked on the serving event loop; no model here takes more than a handful.
MAX_INPUTS: Final = 64
_LENGTH_PREFIX: Final = struct.Struct("<I")


@dataclass(frozen=True)
class _Datatype:
    """How one protocol datatype maps to numpy and to the typed ``contents`` lists."""

    name: str
    dtype: np.dtype[Any]
    field: str | None  # the InferTensorContents field, or None where only raw is allowed


_DATATYPES: Final[dict[str, _Datatype]] = {
    d.name: d
    for d in (
        _Datatype("BOOL", np.dtype(np.bool_), "bool_contents"),
        _Datatype("UINT8", np.dtype("<u1"), "uint_contents"),
        _Datatype("UINT16", np.dtype("<u2"), "uint_contents"),
        _Datatype("UINT32", np.dtype("<u4"), "uint_contents"),
        _Datatype("UINT64", np.dtype("<u8"), "uint64_contents"),
        _Datatype("INT8", np.dtype("<i1"), "int_contents"),
        _Datatype("INT16", np.dtype("<i2"), "int_contents"),
        _Datatype("INT32", np.dtype("<i4"), "int_contents"),
        _Datatype("INT64", np.dtype("<i8"), "int64_contents"),
        # The protocol has no typed list for half precision: FP16 travels raw only.
        _Datatype("FP16", np.dtype("<f2"), None),
        _Datatype("FP32", np.dtype("<f4"), "fp32_contents"),
        _Datatype("FP64", np.dtype("<f8"), "fp64_contents"),
        _Datatype("BYTES", np.dtype(object), "bytes_contents"),
    )
}
DATATYPES: Final = tuple(_DATATYPES)


# Native and little-endian spellings of each fixed-size dtype, looked up once per array.
_NAMES: Final[dict[np.dtype[Any], str]] = {
    variant: d.name
    for d in _DATATYPES.values()
    if d.name != "BYTES"
    for variant in (d.dtype, d.dtype.newbyteorder("="), d.dtype.newbyteorder("<"))
}


def datatype_of(array: Array) -> str:
    """The protocol datatype for a numpy array (strings and bytes become BYTES)."""
    kind = array.dtype
    name = _NAMES.get(kind)
    if name is not None:
        return name
    if kind.kind in "OSU":
        return "BYTES"
    name = _NAMES.get(kind.newbyteorder("<"))
    if name is None:
        raise InvalidInput(f"numpy dtype {kind} has no Open Inference Protocol datatype")
    return name


def numpy_dtype(datatype: str, *, tensor: str = "tensor") -> np.dtype[Any]:
    """The numpy dtype for a protocol datatype, or InvalidInput naming the tensor."""
    return _spec(datatype, tensor).dtype


def _spec(datatype: str, tensor: str) -> _Datatype:
    spec = _DATATYPES.get(datatype)
    if spec is None:
        raise InvalidInput(
            f"tensor '{tensor}': unknown datatype '{datatype}'; expected one of {', '.join(DATATYPES)}"
        )
    return spec


def checked_shape(shape: Sequence[int], *, tensor: str) -> tuple[int, ...]:
    """Validate a wire shape: bounded rank, no negative dims, a sane element count."""
    dims = tuple(shape)  # one pass over a protobuf repeated field; the rest on a tuple
    if len(dims) > MAX_RANK:
        raise InvalidInput(f"tensor '{tensor}': rank {len(dims)} exceeds the limit of {MAX_RANK}")
    if dims and min(dims) < 0:
        axis = next(i for i, d in enumerate(dims) if d < 0)
        raise InvalidInput(f"tensor '{tensor}': dimension {axis} is {dims[axis]}; dimensions must be >= 0")
    count = math.prod(dims)
    # Every dimension counts, zero or not: [0, 2**40, 2**40] holds nothing, yet no array of
    # that shape can be made.
    spread = math.prod(d for d in dims if d)
    if count > MAX_ELEMENTS or spread > MAX_ELEMENTS:
        raise InvalidInput(
            f"tensor '{tensor}': shape {list(dims)} has {spread} elements, more than the limit of {MAX_ELEMENTS}"
        )
    return dims


def decode_raw(raw: bytes, *, tensor: str, datatype: str, shape: Sequence[int]) -> Array:
    """Decode one raw buffer; its length must match shape x datatype exactly."""
    spec = _spec(datatype, tensor)
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
    spec = _spec(datatype, tensor)
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


def _wide_dtype(spec: _Datatype) -> type[np.generic]:
    """A dtype that holds every value of the typed list, so narrowing can be range-checked."""
    if spec.dtype.kind == "f":
        return np.float64
    if spec.dtype.kind == "b":
        return np.bool_
    return np.uint64 if spec.name == "UINT64" else np.int64


def _check_no_other_contents(contents: pb.InferTensorContents, field: str, tensor: str) -> None:
    for other in {d.field for d in _DATATYPES.values() if d.field and d.field != field}:
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
    spec = _DATATYPES[datatype_of(array)]
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
        _spec(tensor.datatype, name)
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
