"""Errors cross every wire and come back as the errors they were."""

from __future__ import annotations

import grpc
import pytest

from stratus import errors
from stratus.convert.errors import (
    ERROR_CODE,
    MAX_PEER_MESSAGE,
    error_from_http,
    error_from_status,
    error_from_stream,
    error_from_wire,
    error_label,
    error_to_wire,
    http_status,
    status_for,
    status_label,
    stream_error,
    wire_error,
)
from stratus.families.sampling import FieldError
from stratus.wire import inference_pb2 as pb

# What each error is once it crossed a hop: FAILED_PRECONDITION reads as ConfigError (a
# RuntimeUnavailable shares it), and INTERNAL says the hop failed, which fails over.
CROSSED = [
    (errors.InvalidInput, errors.InvalidInput),
    (errors.NotFound, errors.NotFound),
    (errors.ConfigError, errors.ConfigError),
    (errors.RuntimeUnavailable, errors.ConfigError),
    (errors.ModelLoadError, errors.Unavailable),
    (errors.StratusError, errors.Unavailable),
    (errors.Unavailable, errors.Unavailable),
    (errors.Overloaded, errors.Overloaded),
    (errors.DeadlineExceeded, errors.DeadlineExceeded),
    (errors.Unauthenticated, errors.Unauthenticated),
    (errors.PermissionDenied, errors.PermissionDenied),
]


def test_every_status_number_names_its_code() -> None:
    assert status_for(3) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(14) is grpc.StatusCode.UNAVAILABLE
    assert status_for(0) is grpc.StatusCode.OK
    assert [status_for(-1), status_for(2**31 - 1)] == [grpc.StatusCode.UNKNOWN] * 2


@pytest.mark.parametrize(("raised", "returned"), CROSSED)
def test_an_agents_error_comes_back_as_the_one_it_raised(
    raised: type[errors.StratusError], returned: type[errors.StratusError]
) -> None:
    back = error_from_wire(error_to_wire(raised("the model said no")), "agent a1")
    assert type(back) is returned
    assert str(back).startswith("agent a1: the model said no")


def test_an_agents_unexpected_failure_is_internal_and_fails_over() -> None:
    sent = error_to_wire(ZeroDivisionError("division by zero"))
    assert (sent.code, sent.message) == (13, "ZeroDivisionError: division by zero")
    assert status_label(status_for(sent.code)) == "internal"
    back = error_from_wire(sent, "agent a1")
    assert type(back) is errors.Unavailable
    assert str(back) == "agent a1: ZeroDivisionError: division by zero (INTERNAL)"


def test_a_cancelled_work_is_labelled_cancelled() -> None:
    sent = wire_error(grpc.StatusCode.CANCELLED, "cancelled by the router")
    assert (sent.code, status_label(status_for(sent.code))) == (1, "cancelled")
    assert type(error_from_wire(sent, "agent a1")) is errors.Unavailable


def test_a_code_no_request_causes_says_the_hop_failed() -> None:
    for code in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS):
        back = error_from_status(code, "odd")
        assert type(back) is errors.Unavailable and str(back) == f"odd ({code.name})"


def test_a_peers_long_message_is_cut_and_says_how_long_it_was() -> None:
    back = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "x" * 70_000)
    assert str(back) == "x" * MAX_PEER_MESSAGE + "... (70000 characters)"


def test_metric_labels_are_the_status_in_lower_case() -> None:
    assert error_label(errors.Overloaded("full")) == "resource_exhausted"
    assert error_label(errors.ModelLoadError("bad file")) == "internal"


def _request() -> pb.ModelInferRequest:
    return pb.ModelInferRequest(id="r7", model_name="digits")


def test_a_streamed_error_keeps_the_request_and_carries_its_code_as_a_number() -> None:
    sent = stream_error(_request(), errors.NotFound("no model 'digits'"))
    assert sent.error_message == "NOT_FOUND: no model 'digits'"
    assert (sent.infer_response.id, sent.infer_response.model_name) == ("r7", "digits")
    assert sent.infer_response.parameters[ERROR_CODE].int64_param == 5
    back = error_from_stream(sent, "cloud")
    assert type(back) is errors.NotFound and str(back) == "cloud: no model 'digits'"


def test_a_streamed_bug_is_internal_naming_the_exception() -> None:
    sent = stream_error(_request(), KeyError("k"))
    assert sent.error_message == "INTERNAL: KeyError: 'k'"
    assert sent.infer_response.parameters[ERROR_CODE].int64_param == 13


def test_a_streamed_errors_code_is_read_not_parsed_from_its_text() -> None:
    """Text that looks like another code does not change the error the number names."""
    sent = pb.ModelStreamInferResponse(error_message="INVALID_ARGUMENT: looks like one")
    sent.infer_response.parameters[ERROR_CODE].int64_param = 8
    back = error_from_stream(sent, "cloud")
    assert type(back) is errors.Overloaded
    assert str(back) == "cloud: INVALID_ARGUMENT: looks like one"


def test_a_streamed_error_without_a_code_is_read_as_an_older_gateway_wrote_it() -> None:
    back = error_from_stream(
        pb.ModelStreamInferResponse(error_message="INVALID_ARGUMENT: bad shape"), "cloud"
    )
    assert type(back) is errors.InvalidInput and str(back) == "cloud: bad shape"


def test_a_foreign_servers_streamed_error_fails_over() -> None:
    back = error_from_stream(pb.ModelStreamInferResponse(error_message="model busy"), "cloud")
    assert type(back) is errors.Unavailable and str(back) == "cloud: model busy (UNKNOWN)"


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, errors.InvalidInput),
        (422, errors.InvalidInput),
        (401, errors.Unauthenticated),
        (403, errors.PermissionDenied),
        (404, errors.NotFound),
        (408, errors.DeadlineExceeded),
        (429, errors.Overloaded),
        (503, errors.Overloaded),
        (500, errors.Unavailable),
        (502, errors.Unavailable),
        (504, errors.DeadlineExceeded),
    ],
)
def test_http_statuses_map_to_stratus_errors(status: int, kind: type[errors.StratusError]) -> None:
    error = error_from_http(status, "why")
    assert type(error) is kind
    assert str(error) == f"upstream HTTP {status}: why"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (errors.InvalidInput("bad"), (400, "invalid_request_error")),
        (FieldError("temperature", "too hot"), (400, "invalid_request_error")),
        (errors.NotFound("no"), (404, "not_found_error")),
        (errors.Unauthenticated("who"), (401, "authentication_error")),
        (errors.PermissionDenied("no"), (403, "permission_error")),
        (errors.Overloaded("full"), (429, "rate_limit_error")),
        (errors.Unavailable("down"), (503, "service_unavailable")),
        (errors.DeadlineExceeded("late"), (504, "timeout")),
        (errors.ConfigError("broken"), (500, "internal_error")),
        (errors.ModelLoadError("broken"), (500, "internal_error")),
    ],
)
def test_openai_clients_get_the_http_status_and_type_of_each_error(
    error: errors.StratusError, expected: tuple[int, str]
) -> None:
    assert http_status(error) == expected
