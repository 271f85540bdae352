"""Inference requests and results as every data plane takes and gives them, converted from
and to the Open Inference Protocol here, once, by the servicer (as KServe's servicer calls
``InferRequest.from_grpc``) and by the agent for the Work it is sent.

A request's header (its model, id, ``parameters`` as Python values, the outputs it asks for,
whether its tensors came typed) is read when it arrives. Its tensors are converted on demand,
after the data plane has checked their metadata against the family, so a request the family
cannot take is refused before a byte of it is decoded: 16 M typed INT64 zeros are 15 MiB on
the wire and were 500 MB decoded. A result holds its outputs (raw buffers as the router
handles them, or arrays as a runtime made them) and its ``stratus.*`` parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from stratus.convert import codec
from stratus.convert.parameters import (
    COMPUTE_MS,
    QUEUE_MS,
    RequestOptions,
    parameter_value,
    reported_value,
    set_parameter,
)
from stratus.convert.tensors import (
    InputHeader,
    Tensors,
    answer_raw,
    check_inputs,
    check_request_metadata,
    input_headers,
    requested_outputs,
    unique_names,
)
from stratus.datatypes import Array, ParameterValue
from stratus.errors import InvalidInput
from stratus.families.chat import Message
from stratus.families.generation import STREAM, GenerationParams
from stratus.families.spec import TensorSpec
from stratus.wire import inference_pb2 as pb

# The longest prompt taken, in UTF-8 bytes: far more than any context here holds (a 128k-token
# context is about 0.5 MiB of text), and far below what a link carries.
MAX_PROMPT_BYTES = 1 << 20

Parameters = Mapping[str, ParameterValue | None]  # None: a parameter sent with no value set


class Addressed(Protocol):
    """What an answer, or an error, is addressed by: the request's model and id."""

    @property
    def model_name(self) -> str: ...

    @property
    def id(self) -> str: ...


@dataclass(frozen=True, eq=False)
class InferRequest:
    """One inference request, read at the door (:meth:`from_wire`) into values: its model,
    id, ``parameters``, the outputs it asks for, whether its tensors came typed, and each
    input's header (name, datatype, shape) when first asked. Every check runs on these
    values; the wire message stays inside only as the reference to the tensors' data, which
    :meth:`tensors` and :meth:`arrays` read once the checks have passed."""

    _wire: pb.ModelInferRequest = field(repr=False)  # the data, read by tensors() and arrays()
    parameters: Parameters
    model_name: str
    model_version: str
    id: str
    outputs: tuple[str, ...]  # the outputs asked for by name; () asks for all of them
    typed: bool  # the inputs came as typed contents (then the answer is typed where it can be)
    items: int  # dimension 0 of the first input: the items a statistic counts (1 without one)
    stream_input: bool  # a BOOL input named "stream" came (how tritonclient asks for chunks)

    @classmethod
    def from_wire(cls, request: pb.ModelInferRequest) -> InferRequest:
        """Reads the header only; nothing here can fail, so a stream can always answer."""
        return cls(
            request,
            parameters={key: parameter_value(value) for key, value in request.parameters.items()},
            model_name=request.model_name,
            model_version=request.model_version,
            id=request.id,
            outputs=tuple(o.name for o in request.outputs),
            typed=bool(request.inputs) and not request.raw_input_contents,
            items=int(request.inputs[0].shape[0]) if request.inputs and request.inputs[0].shape else 1,
            stream_input=any(t.name == STREAM and t.datatype == "BOOL" for t in request.inputs),
        )

    @functools.cached_property
    def inputs(self) -> tuple[InputHeader, ...]:
        """Each input's header; more inputs than any model takes refused first."""
        return input_headers(self._wire)

    @property
    def raw(self) -> bool:
        """Whether a text answer goes back as raw buffers (the inputs did not come typed)."""
        return not self.typed

    def input_names(self) -> list[str]:
        """Each input's name (``#i`` for an unnamed one), in order; too many inputs, or a
        repeated name, refused."""
        return [header.name for header in unique_names(self.inputs)]

    def input_bytes(self) -> int:
        """The inputs' data as sent: raw buffers, or typed contents' encoded size."""
        return sum(len(b) for b in self._wire.raw_input_contents) or sum(t.ByteSize() for t in self._wire.inputs)

    def options(self) -> RequestOptions:
        """What the client asked of the router (``stratus.*``), checked."""
        return RequestOptions.from_values(self.parameters)

    def streams(self) -> bool:
        """Whether the client asked for chunks: a ``stream`` parameter, or a BOOL input (typed or
        raw, as tritonclient sends it), true."""
        parameter = self.parameters.get(STREAM)
        if isinstance(parameter, bool):
            return parameter
        if not self.stream_input:
            return False
        return bool(self.arrays()[STREAM].all())

    def checked(
        self, family: str, inputs: Sequence[TensorSpec] | None, outputs: Sequence[TensorSpec] | None
    ) -> Checked:
        """Everything the request says checked against the family's tensors, in the one call
        both planes make: names, datatypes and shapes first, from metadata alone, before a
        byte is read (a request the family cannot take costs no memory); then each buffer's
        length; then the outputs it names. ``None``: a family with no description here (a
        model only the cloud serves), whose server checks what it takes."""
        if inputs is not None:
            self.check_metadata(family, inputs)
        tensors = self.tensors()
        if inputs is not None:
            check_inputs(family, inputs, tensors)
        named = self.outputs
        if outputs is not None and named:
            named = tuple(requested_outputs(self.outputs, family, [o.name for o in outputs]))
        return Checked(inputs=tensors, outputs=named)

    def check_metadata(self, family: str, specs: Sequence[TensorSpec]) -> None:
        """Names, datatypes and shapes against the family, before anything is decoded."""
        check_request_metadata(family, specs, self.inputs)

    def answer_raw(self, datatypes: Iterable[str]) -> bool:
        """Raw buffers, unless the request was typed and every output can be typed."""
        return answer_raw(self.typed, datatypes)

    def tensors(self) -> Tensors:
        """The inputs as checked raw buffers, never decoded (the router's view)."""
        return Tensors.from_request(self._wire, self.inputs)

    def arrays(self) -> dict[str, Array]:
        """The inputs decoded, as a runtime takes them."""
        return codec.decode_request_inputs(self._wire)


@dataclass(frozen=True, kw_only=True, slots=True)
class Checked:
    """A request's tensors as :meth:`InferRequest.checked` found them fit for its family."""

    inputs: Tensors  # raw buffers, never decoded (an agent's runtime views them as arrays)
    outputs: tuple[str, ...]  # the outputs it asked for by name, each one the family gives; (): all

    def wanted(self, outputs: Sequence[TensorSpec]) -> list[TensorSpec]:
        """Of the family's ``outputs``, those to answer with, in the order asked (all: the family's)."""
        if not self.outputs:
            return list(outputs)
        by_name = {o.name: o for o in outputs}
        return [by_name[name] for name in self.outputs]


@dataclass(frozen=True, kw_only=True)
class TextRequest:
    """A generative request as the router's cascade takes it: from an OIP request
    (:func:`stratus.convert.text.text_request`) or built by the OpenAI API, which has no
    protobuf to make."""

    model_name: str  # a family, or a pinned variant
    id: str
    prompt: str  # what a variant without a chat template generates from
    params: GenerationParams
    options: RequestOptions = field(default_factory=RequestOptions)
    raw: bool = True  # the answer's text as a raw buffer (or typed, as a typed prompt came)
    messages: tuple[Message, ...] = ()  # a chat's conversation, checked, for each tier's template

    def __post_init__(self) -> None:
        """Whichever front built it, a prompt over MAX_PROMPT_BYTES goes no further."""
        if len(self.prompt) * 4 > MAX_PROMPT_BYTES and len(self.prompt.encode("utf-8")) > MAX_PROMPT_BYTES:
            raise InvalidInput(f"the prompt is over {MAX_PROMPT_BYTES} bytes of UTF-8; at most that many are taken")


@dataclass(kw_only=True, eq=False)
class InferResult:
    """One answer, or one chunk of a streamed one: what :meth:`to_wire` sends."""

    model_name: str
    id: str
    outputs: Tensors | Mapping[str, Array]  # raw buffers (the router's), or arrays (a runtime's)
    raw: bool = True  # raw buffers on the wire, or typed contents
    parameters: dict[str, ParameterValue] = field(default_factory=dict)

    def to_wire(self) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse(model_name=self.model_name, id=self.id)
        if isinstance(self.outputs, Tensors):
            self.outputs.write_response(response, raw=self.raw)
        else:
            codec.encode_response_outputs(response, self.outputs, raw=self.raw)
        for key, value in self.parameters.items():
            set_parameter(response.parameters, key, value)
        return response

    @property
    def queue_ms(self) -> float | None:
        """The time this result reports waiting for a slot (``stratus.queue_ms``), if any."""
        return reported_value(self.parameters.get(QUEUE_MS))

    @property
    def compute_ms(self) -> float | None:
        """... and running (``stratus.compute_ms``)."""
        return reported_value(self.parameters.get(COMPUTE_MS))
