"""A cloud's answers read the same way whatever the cloud: a request named as the cloud serves
it, a foreign cloud's answer given the variant and confidence Stratus's would carry, a
generation's text and end, and a failed call as the error it names."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import grpc

from router.cloud.catalog import LINK_DOWN, Headers
from stratus.convert import codec
from stratus.convert.errors import error_from_call
from stratus.convert.parameters import CONFIDENCE, VARIANT, set_parameter
from stratus.errors import DeadlineExceeded, StratusError, Unavailable
from stratus.families.confidence import max_probability
from stratus.families.description import FamilyDescription
from stratus.families.generation import FINAL, TEXT_OUTPUT, Chunk
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

# How long a new stream may take to be refused (UNIMPLEMENTED comes at once); a server that
# sends its headers with its first answer (Triton) is taken to accept it.
STREAM_CHECK_S = 0.2


def on_the_wire(request: pb.ModelInferRequest, wire_names: Mapping[str, str]) -> pb.ModelInferRequest:
    """The request as the cloud knows it: the family named as the cloud serves it."""
    wire_name = wire_names.get(request.model_name, request.model_name)
    if wire_name == request.model_name:
        return request
    asked = pb.ModelInferRequest()
    asked.CopyFrom(request)
    asked.model_name = wire_name
    return asked


def judged(response: pb.ModelInferResponse, family: FamilyDescription | None, wire_name: str) -> None:
    """A cloud that is not Stratus's says neither how sure it is nor which variant answered:
    the variant is the model it was asked for (``wire_name``), and the confidence is the
    ``family``'s (the top probability of its first output; the batch's least sure item)."""
    params = response.parameters
    if VARIANT not in params:
        set_parameter(params, VARIANT, wire_name)
    if CONFIDENCE in params or family is None or family.generative or not family.outputs:
        return
    scores = codec.decode_response_outputs(response).get(family.outputs[0].name)
    if scores is not None and scores.ndim >= 1 and scores.size:
        rows = scores.astype("float64").reshape(scores.shape[0], -1)
        set_parameter(params, CONFIDENCE, float(max_probability(rows).min()))


async def refused_at_once(call: Any) -> bool:
    """Whether a new stream was refused before any answer: True for UNIMPLEMENTED (KServe
    has no stream), Unavailable for any other refusal (Triton without its token)."""
    try:
        async with asyncio.timeout(STREAM_CHECK_S):
            await asyncio.shield(call.initial_metadata())
    except TimeoutError:
        return False  # headers come with the first answer: a stream that is being served
    if not call.done():
        return False
    code = await call.code()
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return True
    raise Unavailable(f"the cloud refused the stream: {code.name}: {await call.details()}")


def call_error(exc: grpc.aio.AioRpcError, timeout_s: float | None) -> StratusError:
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"cloud did not finish within {(timeout_s or 0) * 1000:.1f} ms")
    return error_from_call(exc, "cloud")


def described(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def is_final(response: pb.ModelInferResponse) -> bool:
    parameter = response.parameters.get(FINAL)
    return parameter is not None and parameter.bool_param


def text_output(response: pb.ModelInferResponse) -> str:
    """The response's ``text_output`` (one UTF-8 string), or "" when it has none."""
    outputs = codec.decode_response_outputs(response)
    values = outputs.get(TEXT_OUTPUT)
    if values is None or values.size == 0:
        return ""
    first = values.reshape(-1)[0]
    return first.decode("utf-8", "replace") if isinstance(first, bytes) else str(first)


def chunk_of(response: pb.ModelInferResponse) -> Chunk:
    """A generation's piece as the cloud sent it: its text and its string parameters."""
    params = {k: v.string_param for k, v in response.parameters.items() if v.string_param}
    return Chunk.from_parts(text_output(response), params, final=False)


async def server_of(stub: pb_grpc.GRPCInferenceServiceAsyncStub, headers: Headers) -> str:
    """ "name version" from ServerMetadata ("triton 2.59.0"); "unknown" where not told."""
    try:
        metadata = await stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=2.0, metadata=headers)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in LINK_DOWN:
            raise
        return "unknown"
    return f"{metadata.name or 'unknown'} {metadata.version}".strip()
