"""Tensors as the router handles them: checked from metadata and byte sizes, never decoded.

The router does not compute on tensors; it checks them, groups requests into batches,
and picks items out of answers. So a request's inputs become :class:`Tensors`: each
tensor's name, datatype, shape and one little-endian buffer, checked against the
family's description and the buffer's length without building an array. Merging
requests is joining buffers, and taking items is slicing them. Typed ``contents`` (the
slow path some clients use) are converted to raw buffers once, here; the agent decodes
the buffers once, into arrays that view them.

Only fixed-size datatypes split by items; BYTES tensors are checked by the codec and
travel whole (their requests run alone, never merged).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from stratus import datatypes
from stratus.convert import codec
from stratus.errors import InvalidInput
from stratus.families.spec import TensorSpec
from stratus.sched.batching import BatchKey
from stratus.wire import inference_pb2 as pb


@dataclass(frozen=True)
class RawTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def items(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def item_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def fixed_size(self) -> bool:
        return self.datatype != "BYTES" and len(self.shape) > 0

    @property
    def item_bytes(self) -> int:
        return math.prod(self.item_shape) * datatypes.numpy_dtype(self.datatype).itemsize

    def rows(self, start: int, stop: int) -> RawTensor:
        step = self.item_bytes
        return RawTensor(
            self.name, self.datatype, (stop - start, *self.item_shape), self.data[start * step : stop * step]
        )

    def take(self, indices: Sequence[int]) -> RawTensor:
        step = self.item_bytes
        view = memoryview(self.data)
        data = b"".join(view[i * step : (i + 1) * step] for i in indices)
        return RawTensor(self.name, self.datatype, (len(indices), *self.item_shape), data)

    @classmethod
    def join(cls, parts: Sequence[RawTensor]) -> RawTensor:
        first = parts[0]
        if len(parts) == 1:
            return first
        items = sum(p.items for p in parts)
        return cls(first.name, first.datatype, (items, *first.item_shape), b"".join(p.data for p in parts))


@dataclass(frozen=True)
class Tensors:
    """A set of tensors sharing dimension 0 (one request's inputs, or one answer's outputs)."""

    tensors: tuple[RawTensor, ...]

    @property
    def items(self) -> int:
        return self.tensors[0].items if self.tensors else 0

    @property
    def splittable(self) -> bool:
        return all(t.fixed_size for t in self.tensors)

    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def get(self, name: str) -> RawTensor:
        for tensor in self.tensors:
            if tensor.name == name:
                return tensor
        raise KeyError(name)

    @property
    def nbytes(self) -> int:
        """The tensors' data, as it travels in raw buffers."""
        return sum(len(t.data) for t in self.tensors)

    def rows(self, start: int, stop: int) -> Tensors:
        if start == 0 and stop == self.items:
            return self
        return Tensors(tuple(t.rows(start, stop) for t in self.tensors))

    def take(self, indices: Sequence[int]) -> Tensors:
        if list(indices) == list(range(self.items)):
            return self
        return Tensors(tuple(t.take(indices) for t in self.tensors))

    @classmethod
    def join(cls, parts: Sequence[Tensors]) -> Tensors:
        if len(parts) == 1:
            return parts[0]
        names = parts[0].names()
        return cls(tuple(RawTensor.join([p.get(n) for p in parts]) for n in names))

    def batch_key(self, variant: str, outputs: Sequence[str]) -> BatchKey:
        return BatchKey(
            variant=variant,
            inputs=tuple((t.name, t.datatype, t.item_shape) for t in self.tensors),
            outputs=tuple(outputs),
            batchable=self.splittable,
        )

    def arrays(self) -> dict[str, datatypes.Array]:
        """Each tensor as an array over its bytes (no copy: read-only), by name."""
        return {
            t.name: codec.decode_raw(t.data, tensor=t.name, datatype=t.datatype, shape=t.shape) for t in self.tensors
        }

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, datatypes.Array]) -> Tensors:
        return cls(tuple(_from_array(name, array) for name, array in arrays.items()))

    # -- the wire boundary ---------------------------------------------------------------
    @classmethod
    def from_request(cls, request: pb.ModelInferRequest, headers: Sequence[InputHeader] | None = None) -> Tensors:
        """A request's inputs, with every count, size and shape checked; raw buffers kept as sent.
        ``headers``: the request's :func:`input_headers`, where the caller has read them already."""
        headers = input_headers(request) if headers is None else headers
        raw = request.raw_input_contents
        if raw and len(raw) != len(request.inputs):
            raise InvalidInput(
                f"request has {len(raw)} raw_input_contents buffers for {len(request.inputs)} inputs; "
                "they must match one to one"
            )
        inputs = request.inputs
        tensors = [
            _input(inputs[index], raw[index] if raw else None, header.name)
            for index, header in enumerate(unique_names(headers))
        ]
        if not tensors:
            raise InvalidInput(f"request for '{request.model_name}' has no inputs")
        return cls(tuple(tensors))

    @classmethod
    def from_response(cls, response: pb.ModelInferResponse) -> Tensors:
        raw = response.raw_output_contents
        if not raw:  # typed contents (a peer that answers typed): decode once, to raw
            arrays = codec.decode_response_outputs(response)
            return cls(tuple(_from_array(name, array) for name, array in arrays.items()))
        if len(raw) != len(response.outputs):
            raise InvalidInput(
                f"response has {len(raw)} raw_output_contents buffers for {len(response.outputs)} outputs"
            )
        return cls(
            tuple(
                _raw(tensor.name, tensor.datatype, tensor.shape, raw[i])
                for i, tensor in enumerate(response.outputs)
            )
        )

    def write_request(self, request: pb.ModelInferRequest) -> None:
        for tensor in self.tensors:
            request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            request.raw_input_contents.append(tensor.data)

    def write_response(self, response: pb.ModelInferResponse, *, raw: bool) -> None:
        """Outputs as the client asked: raw buffers, or typed contents for a typed request."""
        for tensor in self.tensors:
            out = response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            if raw:
                response.raw_output_contents.append(tensor.data)
            else:
                array = codec.decode_raw(
                    tensor.data, tensor=tensor.name, datatype=tensor.datatype, shape=tensor.shape
                )
                codec.encode_contents(array, out.contents)


def answer_raw(typed: bool, datatypes: Iterable[str]) -> bool:
    """Answer as asked: typed contents for a request whose inputs came typed (``typed``),
    where every output allows it (FP16 has no typed list)."""
    if not typed:
        return True
    return any(d == "FP16" for d in datatypes)


def _raw(name: str, datatype: str, shape: Sequence[int], data: bytes) -> RawTensor:
    """Check one raw buffer from its metadata: known datatype, sane shape, exact length."""
    dims = datatypes.checked_shape(shape, tensor=name)
    dtype = datatypes.numpy_dtype(datatype, tensor=name)
    if datatype == "BYTES":
        codec.decode_raw(data, tensor=name, datatype=datatype, shape=dims)  # length prefixes checked
        return RawTensor(name, datatype, dims, data)
    expected = math.prod(dims) * dtype.itemsize
    if len(data) != expected:
        raise InvalidInput(
            f"tensor '{name}': raw buffer holds {len(data)} bytes, but shape {list(dims)} "
            f"of {datatype} needs {expected}"
        )
    if datatype == "BOOL" and data.translate(None, b"\x00\x01"):
        raise InvalidInput(f"tensor '{name}': BOOL bytes must be 0 or 1")
    return RawTensor(name, datatype, dims, data)


def _input(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, name: str) -> RawTensor:
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidInput(f"input '{name}' has both typed contents and a raw buffer")
        return _raw(name, tensor.datatype, tensor.shape, raw)
    # The typed slow path: decode (checking counts and ranges) and re-encode as raw, once.
    array = codec.decode_input(tensor, None, name)
    return _from_array(name, array, datatype=tensor.datatype)


def _from_array(name: str, array: datatypes.Array, datatype: str | None = None) -> RawTensor:
    return RawTensor(name, datatype or datatypes.datatype_of(array), tuple(array.shape), codec.encode_raw(array))


@dataclass(frozen=True, slots=True)
class InputHeader:
    """What a request says of one input before its data is read: what it is checked by."""

    name: str  # ``#i`` for the i-th input when unnamed
    datatype: str
    shape: tuple[int, ...]


def input_headers(request: pb.ModelInferRequest) -> tuple[InputHeader, ...]:
    """Each input's header, as values (more inputs than any model takes refused first,
    before any is looked at); a repeated name is refused where it is reached, by the checks."""
    codec.check_input_count(request)
    return tuple(
        InputHeader(tensor.name or f"#{index}", tensor.datatype, tuple(tensor.shape))
        for index, tensor in enumerate(request.inputs)
    )


def unique_names(inputs: Iterable[InputHeader]) -> Iterator[InputHeader]:
    """Each input in order; a repeated name refused when it is reached (a set, not a scan:
    thousands of inputs cost no more than a few)."""
    seen: set[str] = set()
    for header in inputs:
        if header.name in seen:
            raise InvalidInput(f"input '{header.name}' appears more than once")
        seen.add(header.name)
        yield header


# Items one request may hold, advertised as every model's max_batch_size (ModelConfig) and
# enforced on every server: 32,000 items in one call used to be taken at the cloud.
MAX_REQUEST_ITEMS: Final = 1024


def check_request_metadata(family: str, specs: Sequence[TensorSpec], inputs: Sequence[InputHeader]) -> None:
    """Names, datatypes and shapes against the family, before any tensor is decoded: a
    request the family cannot take costs no memory (16 M typed INT64 zeros are 15 MiB on the
    wire and were 500 MB decoded)."""
    expected = {spec.name: spec for spec in specs}
    for header in unique_names(inputs):
        name = header.name
        spec = expected.get(name)
        if spec is None:
            raise InvalidInput(f"model '{family}' has no input '{name}'; it takes {sorted(expected)}")
        shape = datatypes.checked_shape(header.shape, tensor=name)
        check_tensor(spec, header.datatype, shape)
        if spec.shape and spec.shape[0] == -1 and shape and shape[0] > MAX_REQUEST_ITEMS:
            raise InvalidInput(
                f"input '{name}' holds {shape[0]} items; a request may hold at most {MAX_REQUEST_ITEMS} "
                "(the models' max_batch_size): send the rest in further requests"
            )


def check_inputs(family: str, specs: Sequence[TensorSpec], inputs: Tensors) -> None:
    """Refuse missing, unexpected, mistyped or misshapen inputs, from metadata alone."""
    expected = {spec.name: spec for spec in specs}
    for tensor in inputs.tensors:
        if tensor.name not in expected:
            raise InvalidInput(f"model '{family}' has no input '{tensor.name}'; it takes {sorted(expected)}")
    for name, spec in expected.items():
        try:
            tensor = inputs.get(name)
        except KeyError:
            raise InvalidInput(f"model '{family}' needs input '{name}'") from None
        check_tensor(spec, tensor.datatype, tensor.shape)
    batches = {t.shape[0] for t in inputs.tensors if t.shape}
    if len(batches) > 1:
        raise InvalidInput(f"inputs disagree on the batch size: {sorted(batches)}")


def check_tensor(spec: TensorSpec, datatype: str, shape: Sequence[int]) -> None:
    if datatype != spec.datatype:
        raise InvalidInput(f"input '{spec.name}': datatype is {datatype}, the model takes {spec.datatype}")
    fits = len(shape) == len(spec.shape) and all(
        want in (-1, got) for want, got in zip(spec.shape, shape, strict=True)
    )
    if not fits:
        raise InvalidInput(
            f"input '{spec.name}': shape {list(shape)} does not fit the model's {list(spec.shape)}"
        )


def requested_outputs(asked: Sequence[str], family: str, known: Sequence[str]) -> list[str]:
    """The outputs a request asks for (all when it names none); unknown names refused."""
    wanted = list(asked) or list(known)
    for name in wanted:
        if name not in known:
            raise InvalidInput(f"model '{family}' has no output '{name}'; it gives {sorted(known)}")
    return wanted


def top1(tensors: Tensors, output: str) -> np.ndarray[Any, Any] | None:
    """Each item's highest-scoring class in ``output``; None where it holds no scores (what
    audits, capture and the offline judge compare answers by)."""
    if output not in tensors.names():
        return None
    raw = tensors.get(output)
    if not raw.fixed_size or len(raw.shape) < 2 or not raw.items:
        return None
    values = np.frombuffer(raw.data, dtype=datatypes.numpy_dtype(raw.datatype))
    best: np.ndarray[Any, Any] = values.reshape(raw.shape[0], -1).argmax(axis=1)
    return best
