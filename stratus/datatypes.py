"""The Open Inference Protocol's datatypes and shapes, as numpy knows them: which dtype each
datatype is, which datatype an array travels as, and the bounds a described shape must keep.
Core: no wire types, so the domain (:mod:`stratus.families`) and the runtimes use it too."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from stratus.errors import InvalidInput

Array = npt.NDArray[Any]
# What a ``parameters`` entry holds (bool, int64, double or string), as Python has it.
ParameterValue = bool | int | float | str

# Largest tensor a peer may describe; the message size limits bound it further in practice.
MAX_ELEMENTS: Final = 1 << 31
MAX_RANK: Final = 16


@dataclass(frozen=True)
class Datatype:
    """How one protocol datatype maps to numpy and to the typed ``contents`` lists."""

    name: str
    dtype: np.dtype[Any]
    field: str | None  # the InferTensorContents field, or None where only raw is allowed


SPECS: Final[dict[str, Datatype]] = {
    d.name: d
    for d in (
        Datatype("BOOL", np.dtype(np.bool_), "bool_contents"),
        Datatype("UINT8", np.dtype("<u1"), "uint_contents"),
        Datatype("UINT16", np.dtype("<u2"), "uint_contents"),
        Datatype("UINT32", np.dtype("<u4"), "uint_contents"),
        Datatype("UINT64", np.dtype("<u8"), "uint64_contents"),
        Datatype("INT8", np.dtype("<i1"), "int_contents"),
        Datatype("INT16", np.dtype("<i2"), "int_contents"),
        Datatype("INT32", np.dtype("<i4"), "int_contents"),
        Datatype("INT64", np.dtype("<i8"), "int64_contents"),
        # The protocol has no typed list for half precision: FP16 travels raw only.
        Datatype("FP16", np.dtype("<f2"), None),
        Datatype("FP32", np.dtype("<f4"), "fp32_contents"),
        Datatype("FP64", np.dtype("<f8"), "fp64_contents"),
        Datatype("BYTES", np.dtype(object), "bytes_contents"),
    )
}
DATATYPES: Final = tuple(SPECS)


# Native and little-endian spellings of each fixed-size dtype, looked up once per array.
_NAMES: Final[dict[np.dtype[Any], str]] = {
    variant: d.name
    for d in SPECS.values()
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
    return spec_of(datatype, tensor).dtype


def spec_of(datatype: str, tensor: str) -> Datatype:
    spec = SPECS.get(datatype)
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
