"""Where a Stratus error meets a wire, both ways, and nowhere else.

An error leaves as a gRPC status (the interceptor, :mod:`stratus.serving.interceptor`), as an agent's
``fpb.Error``, as a streamed error (a ``ModelStreamInferResponse`` that cannot end the
stream other requests share), or as an HTTP status; it comes back from each of those the
same way, so a failure on an agent or a cloud reaches the client as the error it was.
Codes travel as numbers (gRPC's own), never parsed out of the text, except from a peer
that sends none (an older gateway, mid rolling update).
"""

from __future__ import annotations

from typing import Final

import grpc

from stratus import errors
from stratus.convert.inference import Addressed
from stratus.errors import StratusError
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

# Longest message from a peer's error passed on: an agent's 70 KB message used to become
# trailing metadata past gRPC's limit, and the client got RESOURCE_EXHAUSTED about that instead.
MAX_PEER_MESSAGE = 1024
# A streamed error's gRPC code, as a number, in its infer_response's parameters: the
# protocol's error_message is text only, and keeps the human "CODE: text" clients show.
ERROR_CODE: Final = "stratus.error_code"
# The errors a peer's status comes back as; FAILED_PRECONDITION is a ConfigError's (a
# RuntimeUnavailable shares the code, and cannot be told apart on the wire).
_RETURNED: Final = (
    errors.InvalidInput,
    errors.NotFound,
    errors.Unavailable,
    errors.Overloaded,
    errors.DeadlineExceeded,
    errors.Unauthenticated,
    errors.PermissionDenied,
    errors.ConfigError,
)
_BY_CODE: Final = {code.value[0]: code for code in grpc.StatusCode}


def status_code(error: StratusError) -> grpc.StatusCode:
    """The status the error's class names."""
    code: grpc.StatusCode = getattr(grpc.StatusCode, error.status_name)
    return code


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """A Stratus error's status and message; anything else is a bug, INTERNAL naming it."""
    if isinstance(exc, StratusError):
        return status_code(exc), str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def status_for(code: int) -> grpc.StatusCode:
    """The StatusCode for a number carried in a message; UNKNOWN for one gRPC lacks."""
    return _BY_CODE.get(code, grpc.StatusCode.UNKNOWN)


def error_label(error: StratusError) -> str:
    """A metric's label for an error: its status, in lower case (``invalid_argument``)."""
    return status_label(status_code(error))


def status_label(code: grpc.StatusCode) -> str:
    """A metric's label for a status (an agent's failed Work counts under its code's)."""
    return code.name.lower()


def error_from_status(code: grpc.StatusCode, message: str) -> StratusError:
    """The error a status that crossed a hop (agent -> router -> client) stands for.

    A code the request cannot have caused (OK, UNKNOWN, INTERNAL, CANCELLED, a number gRPC
    does not know) says the hop failed, not the request: UNAVAILABLE, which fails over."""
    if len(message) > MAX_PEER_MESSAGE:
        message = f"{message[:MAX_PEER_MESSAGE]}... ({len(message)} characters)"
    for kind in _RETURNED:
        if kind.status_name == code.name:
            return kind(message)
    return errors.Unavailable(f"{message} ({code.name})")


def error_from_call(exc: grpc.aio.AioRpcError, peer: str) -> StratusError:
    """A failed call to ``peer`` (``cloud``) as the error it names."""
    return error_from_status(exc.code(), f"{peer}: {exc.details()}")


def wire_error(code: grpc.StatusCode, message: str) -> fpb.Error:
    """An agent's failure as its Result carries it: gRPC's number and the text."""
    return fpb.Error(code=code.value[0], message=message)


def error_to_wire(exc: BaseException) -> fpb.Error:
    return wire_error(*status_of(exc))


def error_from_wire(error: fpb.Error, peer: str) -> StratusError:
    """An agent's ``fpb.Error`` as the error it names, the message prefixed with ``peer``."""
    return error_from_status(status_for(error.code), f"{peer}: {error.message}")


def stream_error(request: Addressed, exc: BaseException) -> pb.ModelStreamInferResponse:
    """A streamed error keeps the request's id and model, so a multiplexing peer can match
    it; its code travels as a number, and its text as "CODE: text" for people to read."""
    code, message = status_of(exc)
    response = pb.ModelStreamInferResponse(
        error_message=f"{code.name}: {message}",
        infer_response=pb.ModelInferResponse(id=request.id, model_name=request.model_name),
    )
    response.infer_response.parameters[ERROR_CODE].int64_param = code.value[0]
    return response


def error_from_stream(message: pb.ModelStreamInferResponse, peer: str) -> StratusError:
    """A streamed error as the error it names. A peer that sends no code (an older Stratus
    gateway) wrote it as "CODE: text"; a foreign server's text names no code: UNKNOWN,
    which fails over."""
    text = message.error_message
    sent = message.infer_response.parameters.get(ERROR_CODE)
    if sent is not None and sent.WhichOneof("parameter_choice") == "int64_param":
        code = status_for(sent.int64_param)
        return error_from_status(code, f"{peer}: {text.removeprefix(f'{code.name}: ') or text}")
    code_name, _, rest = text.partition(": ")
    code = getattr(grpc.StatusCode, code_name, grpc.StatusCode.UNKNOWN)
    return error_from_status(code, f"{peer}: {rest or text}")


def error_from_http(status: int, message: str) -> StratusError:
    """An HTTP status from an upstream server as the Stratus error a caller can act on."""
    text = f"upstream HTTP {status}: {message}"
    if status in (429, 503):
        return errors.Overloaded(text)
    if status in (408, 504):
        return errors.DeadlineExceeded(text)
    if status >= 500:
        return errors.Unavailable(text)
    kinds: dict[int, type[StratusError]] = {
        401: errors.Unauthenticated,
        403: errors.PermissionDenied,
        404: errors.NotFound,
    }
    return kinds.get(status, errors.InvalidInput)(text)


def http_status(exc: StratusError) -> tuple[int, str]:
    """The HTTP status and OpenAI error type a client of the OpenAI API gets for an error."""
    return next((v for kind, v in _HTTP.items() if isinstance(exc, kind)), (500, "internal_error"))


_HTTP: Final[dict[type[StratusError], tuple[int, str]]] = {
    errors.InvalidInput: (400, "invalid_request_error"),
    errors.NotFound: (404, "not_found_error"),
    errors.Unauthenticated: (401, "authentication_error"),
    errors.PermissionDenied: (403, "permission_error"),
    errors.Overloaded: (429, "rate_limit_error"),
    errors.Unavailable: (503, "service_unavailable"),
    errors.DeadlineExceeded: (504, "timeout"),
}
