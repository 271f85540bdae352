"""Generative requests and responses in the Open Inference Protocol, as Triton's vLLM
backend has them: one prompt in ``text_input`` (and optional ``sampling_parameters``), text
out in ``text_output``, streamed chunk by chunk with token log-probabilities and counts as
parameters. A chat's conversation rides beside the prompt as the ``stratus.messages``
parameter, and an answer says ``stratus.chat_template`` where a tier rendered it
(:mod:`stratus.families.chat`). Read and written here for every server and client of a text
model."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Protocol

from stratus import datatypes
from stratus.convert import codec
from stratus.convert.inference import MAX_PROMPT_BYTES, Addressed, InferRequest, InferResult, TextRequest
from stratus.convert.parameters import MODEL_VERSION, VARIANT, RequestOptions, set_parameter
from stratus.datatypes import ParameterValue
from stratus.errors import InvalidInput
from stratus.families.chat import CHAT_TEMPLATE, MESSAGES, Message, conversation_json, read_conversation
from stratus.families.generation import (
    COMPLETION_TOKENS,
    MAX_TOKENS,
    PROMPT_TOKENS,
    STREAM,
    TEXT_INPUT,
    TEXT_OUTPUT,
    Chunk,
    GenerationParams,
    token_count,
)
from stratus.families.sampling import MAX_SETTINGS_BYTES, SAMPLING_PARAMETERS, read_settings, sampling_object
from stratus.families.spec import FamilySpec
from stratus.wire import inference_pb2 as pb

# The inputs a generative request may have, as Triton's vLLM backend takes them (the prompt first).
EXCLUDE_INPUT = "exclude_input_in_output"
_TAKEN = (TEXT_INPUT, SAMPLING_PARAMETERS, STREAM, EXCLUDE_INPUT)


def prompt_and_params(request: InferRequest, family: FamilySpec) -> tuple[str, GenerationParams]:
    """The prompt (one ``text_input`` string) and the generation's settings, checked; the
    family's own stop strings are added to the request's."""
    assert family.generation is not None
    prompt, params = read_generation(request, family.name, family.generation.max_tokens)
    return prompt, params.stopping_also_at(family.generation.stop)


def text_request(request: InferRequest, family: str, limit: int) -> TextRequest:
    """An OIP generative request as the router's cascade takes it (as the OpenAI API builds
    one): its prompt and settings read and checked, and what it asks of the router."""
    prompt, params = read_generation(request, family, limit)
    asked = {key: value for key, value in request.parameters.items() if key != MESSAGES}
    return TextRequest(
        model_name=request.model_name,
        id=request.id,
        prompt=prompt,
        params=params,
        options=RequestOptions.from_values(asked),
        raw=not request.typed,
        messages=conversation_of(request),
    )


def conversation_of(request: InferRequest) -> tuple[Message, ...]:
    """The conversation a request carries in ``stratus.messages``, checked; () without one."""
    return read_conversation(request.parameters[MESSAGES]) if MESSAGES in request.parameters else ()


def chat_templated(parameters: Mapping[str, ParameterValue | None], *, asked: bool) -> bool | None:
    """Whether the tier that answered rendered the request's conversation with its chat
    template (a tier that does not say did not: it generated from ``text_input``); None for
    a request with no conversation."""
    return parameters.get(CHAT_TEMPLATE) is True if asked else None


def read_generation(request: InferRequest, family: str, limit: int) -> tuple[str, GenerationParams]:
    """One prompt in ``text_input``, and the settings (:mod:`stratus.families.sampling`) from the
    parameters and an optional ``sampling_parameters`` input, ``max_tokens`` within
    1..limit; a prompt over MAX_PROMPT_BYTES is refused before it is decoded. Triton's BOOL
    inputs ``stream`` (the servicer reads it) and ``exclude_input_in_output`` (true: what
    Stratus answers anyway) are taken too."""
    names = request.input_names()
    if TEXT_INPUT not in names or not set(names) <= set(_TAKEN):
        raise InvalidInput(
            f"model '{family}' takes the input '{TEXT_INPUT}' (BYTES), and optionally {list(_TAKEN[1:])}, "
            f"not {names[: len(_TAKEN) + 1]}"
        )
    check_prompt_size(request)
    inputs = request.arrays()
    if EXCLUDE_INPUT in inputs and not all(inputs[EXCLUDE_INPUT].reshape(-1)):
        raise InvalidInput(
            f"'{EXCLUDE_INPUT}' false is not supported: the answer is the generated text alone"
        )
    settings = _one_string(inputs, SAMPLING_PARAMETERS) if SAMPLING_PARAMETERS in inputs else None
    params = read_settings(request.parameters, settings, limit=limit, model=family)
    try:
        prompt = _one_string(inputs, TEXT_INPUT).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"'{TEXT_INPUT}' is not UTF-8 text") from None
    if not prompt:  # a runtime has nothing to continue (OpenVINO GenAI fails an assertion)
        raise InvalidInput(f"'{TEXT_INPUT}' is empty: a generation needs a prompt")
    return prompt, params


def _one_string(inputs: Mapping[str, datatypes.Array], name: str) -> bytes:
    values = inputs[name].reshape(-1)
    if len(values) != 1:
        raise InvalidInput(f"'{name}' must hold exactly one string, not {len(values)}")
    raw = values[0]
    return raw if isinstance(raw, bytes) else str(raw).encode("utf-8")


class Answered(Addressed, Protocol):
    """An addressed request that also says how it wants tensors back."""

    @property
    def raw(self) -> bool: ...


def text_result(request: Answered, text: str) -> InferResult:
    """``text_output`` in the form the client sent its input: raw bytes (as tritonclient
    does and expects back) or typed contents."""
    return InferResult(
        model_name=request.model_name, id=request.id, outputs={TEXT_OUTPUT: text_array(text)}, raw=request.raw
    )


def check_prompt_size(request: InferRequest) -> None:
    """Refuse a prompt over MAX_PROMPT_BYTES before it is decoded (or tokenized)."""
    size = request.input_bytes()
    settings = MAX_SETTINGS_BYTES + 64 if len(request.input_names()) > 1 else 0  # sampling_parameters, BOOL inputs
    if size > MAX_PROMPT_BYTES + 4 + settings:  # a BYTES element's 4-byte length prefix
        raise InvalidInput(f"the prompt is {size} bytes; at most {MAX_PROMPT_BYTES} are taken")


def prompt_request(
    model: str, request_id: str, prompt: str, params: GenerationParams, messages: Sequence[Message] = ()
) -> pb.ModelInferRequest:
    """A generative request holding only a checked prompt and its settings (what agents and
    the cloud are sent): ``max_tokens`` as a parameter, the rest, where asked for, in a
    ``sampling_parameters`` input as Triton's vLLM backend takes them; a chat's checked
    conversation as ``stratus.messages``."""
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    if messages:
        set_parameter(request.parameters, MESSAGES, conversation_json(messages))
    inputs = {TEXT_INPUT: text_array(prompt)}
    settings = sampling_object(params)
    if settings is not None:
        inputs[SAMPLING_PARAMETERS] = text_array(json.dumps(settings))
    codec.encode_request_inputs(request, inputs)
    set_parameter(request.parameters, MAX_TOKENS, params.max_tokens)
    return request


def read_usage(parameters: Mapping[str, ParameterValue | None]) -> tuple[int | None, int | None]:
    """(prompt tokens, completion tokens) as a final response gives them; None where it does not."""

    def count(key: str) -> int | None:
        return token_count(parameters[key]) if key in parameters else None

    return count(PROMPT_TOKENS), count(COMPLETION_TOKENS)


def text_array(text: str) -> datatypes.Array:
    """One string as the BYTES tensor the Open Inference Protocol carries."""
    import numpy as np

    return np.array([text.encode("utf-8")], dtype=object)


def chunk_result(request: Answered, chunk: Chunk) -> InferResult:
    """One streamed chunk as Triton's vLLM backend sends it: its text in ``text_output``,
    its tokens' log-probabilities (and the finish reason and token counts, on the last) as
    parameters."""
    result = text_result(request, chunk.text)
    result.parameters.update(chunk.parameters())
    result.parameters.update(chunk.usage())
    return result


def generative_metadata(name: str, platform: str) -> pb.ModelMetadataResponse:
    """ModelMetadata of a generative model: one prompt in, text out (Triton's vLLM layout)."""
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=name,
        versions=[MODEL_VERSION],
        platform=platform,
        inputs=[tensor(name=TEXT_INPUT, datatype="BYTES", shape=[1])],
        outputs=[tensor(name=TEXT_OUTPUT, datatype="BYTES", shape=[-1])],
    )


def generative_config(name: str, platform: str, max_tokens: int, *, variant: str = "") -> pb.ModelConfig:
    """ModelConfig of a generative model: one prompt per request, no batch dimension, and
    the most tokens a request may ask for (a router that learns the family from here
    checks requests against it); ``variant``: the one that answers ``name`` here."""
    parameters = {MAX_TOKENS: pb.ModelParameter(string_value=str(max_tokens))}
    if variant:
        parameters[VARIANT] = pb.ModelParameter(string_value=variant)
    return pb.ModelConfig(
        parameters=parameters,
        name=name,
        platform=platform,
        backend=platform,
        max_batch_size=0,
        input=[pb.ModelInput(name=TEXT_INPUT, data_type=pb.DataType.TYPE_STRING, dims=[1])],
        output=[pb.ModelOutput(name=TEXT_OUTPUT, data_type=pb.DataType.TYPE_STRING, dims=[-1])],
    )
