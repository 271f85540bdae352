"""Triton's ModelStatistics as every Stratus server keeps them, from what answers report."""

from __future__ import annotations

import time

import pytest

from stratus.convert.inference import InferRequest, InferResult
from stratus.convert.parameters import (
    COMPUTE_MS,
    QUEUE_MS,
    check_version,
    reported_ms,
    set_parameter,
    values_of,
)
from stratus.errors import NotFound
from stratus.serving.servicer import DataPlane, Statistics, version_ready
from stratus.wire import inference_pb2 as pb


class _Plane(DataPlane):
    """A data plane serving two names (``ready`` says which answer now), and nothing else."""

    def __init__(self, ready: set[str]) -> None:
        self.serving = {"digits", "digits-large"}
        self.now_ready = ready

    def ready(self) -> bool:
        return True

    def model_ready(self, name: str) -> bool:
        return name in self.now_ready

    def knows(self, name: str) -> bool:
        return name in self.serving

    def model_metadata(self, name: str) -> pb.ModelMetadataResponse:
        raise NotImplementedError

    def model_config(self, name: str) -> pb.ModelConfig:
        raise NotImplementedError

    def model_names(self) -> list[str]:
        return sorted(self.serving)

    async def infer(self, request: InferRequest, *, timeout_s: float | None) -> InferResult:
        raise NotImplementedError


def request(model: str, items: int) -> InferRequest:
    message = pb.ModelInferRequest(model_name=model)
    message.inputs.add(name="input", datatype="FP32", shape=[items, 64])
    return InferRequest.from_wire(message)


def answer(**ms: float) -> InferResult:
    """An answer that reports its split as a gateway's does: read back from the wire."""
    response = pb.ModelInferResponse()
    for key, value in (("queue", QUEUE_MS), ("compute", COMPUTE_MS)):
        if key in ms:
            set_parameter(response.parameters, value, ms[key])
    return InferResult(model_name="", id="", outputs={}, parameters={k: v for k, v in values_of(response.parameters).items() if v is not None})


def test_counts_times_and_the_split_each_answer_reported() -> None:
    statistics = Statistics(_Plane(ready={"digits"}))
    started = time.perf_counter_ns()
    statistics.record(request("digits", 3), started, answer(queue=1.5, compute=0.25))
    statistics.record(request("digits", 2), started, answer())  # a foreign cloud's: no split
    statistics.record(request("digits", 9), started, None)  # failed
    (stats,) = statistics.response("digits").model_stats
    assert (stats.name, stats.version, stats.inference_count, stats.execution_count) == ("digits", "1", 5, 2)
    inference = stats.inference_stats
    assert (inference.success.count, inference.fail.count) == (2, 1)
    assert (inference.queue.count, inference.queue.ns) == (1, 1_500_000)
    assert (inference.compute_infer.count, inference.compute_infer.ns) == (1, 250_000)
    assert inference.success.ns > 0 and inference.fail.ns > 0 and stats.last_inference > 0


def test_a_known_model_that_is_not_ready_still_counts_its_failures() -> None:
    statistics = Statistics(_Plane(ready=set()))  # the cloud is down: digits-large answers nothing
    statistics.record(request("digits-large", 1), time.perf_counter_ns(), None)
    (stats,) = statistics.response("digits-large").model_stats
    assert stats.inference_stats.fail.count == 1


def test_made_up_names_grow_nothing_and_are_refused() -> None:
    statistics = Statistics(_Plane(ready={"digits"}))
    statistics.record(request("made-up", 1), time.perf_counter_ns(), answer(queue=1.0))
    assert [s.name for s in statistics.response("").model_stats] == ["digits", "digits-large"]  # all known
    with pytest.raises(NotFound, match="no model 'made-up'"):
        statistics.response("made-up")
    with pytest.raises(NotFound, match="has no version '2'"):
        statistics.response("digits", "2")


def test_every_model_has_version_one_alone() -> None:
    plane = _Plane(ready={"digits"})
    assert version_ready(plane, "digits", "") and version_ready(plane, "digits", "1")
    assert not version_ready(plane, "digits", "2") and not version_ready(plane, "digits-large", "1")
    check_version("digits", "")
    check_version("digits", "1")
    with pytest.raises(NotFound, match=r"model 'digits' has no version '2': every model here has one version, '1'"):
        check_version("digits", "2")


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), 1e300, True, "3"])
def test_a_peers_nonsense_duration_is_no_duration(value: object) -> None:
    parameters = pb.ModelInferResponse().parameters
    set_parameter(parameters, QUEUE_MS, value)  # type: ignore[arg-type]
    assert reported_ms(parameters, QUEUE_MS) is None
    set_parameter(parameters, QUEUE_MS, 2.5)
    assert reported_ms(parameters, QUEUE_MS) == 2.5 and reported_ms(parameters, COMPUTE_MS) is None
