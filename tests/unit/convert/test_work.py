"""A Work's Result and a reload's answer cross the agent's link as the values they were, and
what an agent says is made fit to compare and add up as it is read, once."""

from __future__ import annotations

import math

import grpc
import numpy as np

from stratus.convert.inference import InferResult
from stratus.convert.work import (
    Reloaded,
    failed_to_wire,
    reloaded_from_wire,
    reloaded_to_wire,
    result_from_wire,
    result_to_wire,
)
from stratus.errors import DeadlineExceeded, Unavailable
from stratus.families.generation import FINISH_REASON
from stratus.wire import fleet_pb2 as fpb

SCORES = np.array([[0.1, 0.9], [0.7, 0.3], [0.5, 0.5]], dtype=np.float32)


def sent(**overrides: object) -> fpb.Result:
    """A Result as an agent writes one, through the codec, and serialised: what the link carries."""
    fields: dict = dict(
        variant="digits-small",
        answer=InferResult(model_name="digits-small", id="r7", outputs={"probabilities": SCORES}),
        confidences=(0.9, 0.7, 0.5),
        service_ms=2.5,
        queue_ms=0.5,
        batch_size=3,
    )
    fields.update(overrides)
    return fpb.Result.FromString(result_to_wire("r7", **fields).SerializeToString())  # type: ignore[arg-type]


def test_an_answer_comes_back_as_the_value_the_agent_sent() -> None:
    read = result_from_wire(sent(), "agent d1")
    assert read.error is None
    assert (read.request_id, read.variant, read.batch_size) == ("r7", "digits-small", 3)
    assert (read.service_ms, read.queue_ms) == (2.5, 0.5)
    assert read.confidences == (0.9, 0.7, 0.5) and read.confidence == 0.5  # its least sure item's
    assert read.items == 3
    np.testing.assert_array_equal(read.outputs.arrays()["probabilities"], SCORES)


def test_an_answers_parameters_are_read_as_values() -> None:
    answer = InferResult(model_name="llm", id="g1", outputs={}, parameters={FINISH_REASON: "length"})
    read = result_from_wire(sent(answer=answer, confidences=(0.25,), batch_size=1), "agent d1")
    assert read.said[FINISH_REASON] == "length"
    assert read.item_confidences(1) == (0.25,)


def test_what_an_agent_reports_is_made_fit_to_compare_and_add_up() -> None:
    message = sent(service_ms=math.nan, queue_ms=-4.0)
    message.confidence = math.inf
    del message.confidences[:]
    message.confidences.extend([math.nan, 7.0, -1.0])
    read = result_from_wire(message, "agent d1")
    assert (read.service_ms, read.queue_ms) == (0.0, 0.0)
    assert read.confidences == (0.0, 1.0, 0.0) and read.confidence == 1.0


def test_a_work_that_named_one_confidence_gives_it_to_every_item() -> None:
    message = sent()
    del message.confidences[:]
    read = result_from_wire(message, "agent d1")
    assert read.item_confidences(3) == (0.5, 0.5, 0.5)
    assert read.items == 1


def test_a_failed_work_comes_back_as_the_error_the_agent_named() -> None:
    message = failed_to_wire("r7", grpc.StatusCode.DEADLINE_EXCEEDED, "budget of 5.0 ms ran out")
    read = result_from_wire(fpb.Result.FromString(message.SerializeToString()), "agent d1")
    assert isinstance(read.error, DeadlineExceeded)
    assert str(read.error) == "agent d1: budget of 5.0 ms ran out"
    assert read.request_id == "r7"


def test_outputs_that_cannot_be_read_are_the_agents_failure_not_the_clients() -> None:
    """An unreadable answer fails over (UNAVAILABLE): it is no fault of the request's."""
    message = sent()
    message.response.raw_output_contents.append(b"\0" * 8)  # two buffers for one output
    read = result_from_wire(message, "agent d1")
    assert isinstance(read.error, Unavailable)
    assert str(read.error).startswith("agent d1 answered what cannot be read: response has 2 raw_output_contents")


def test_a_reloads_answer_crosses_as_it_was() -> None:
    for reloaded in (
        Reloaded(ok=True, message="reloaded", variants=("digits-medium", "digits-small")),
        Reloaded(ok=False, message="still serving digits-small: no such file"),
    ):
        wire = fpb.ReloadResponse.FromString(reloaded_to_wire(reloaded).SerializeToString())
        assert reloaded_from_wire(wire) == reloaded
