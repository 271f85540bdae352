"""A refused streamed request is freed when it is answered, not at the next garbage collection.

Found by the fuzzer's RSS check (tests/integration/test_fuzz.py): each decoupled
ModelStreamInfer request the router refused stayed in a reference cycle (the failed task's
exception, its traceback, the generator frame that awaited the task, the task), so a 2 MB
request (2 M packed INT64 zeros, 16 MB once parsed) held about 31 MB of the router's RSS
until a full collection; six in a row added 190 MB. Each test here runs with the collector
off and then asks it what it would have had to free.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Iterator

import pytest

from stratus.errors import StratusError, drop_frames
from stratus.execution.dataplane import LocalDataPlane
from stratus.serving.servicer import DataPlane
from stratus.serving.stream import StreamSession
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

from .cascade.fleet_fakes import fleet


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def left_in_cycles(type_name: str) -> int:
    """How many objects of ``type_name`` only a garbage collection would free."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sum(type(o).__name__ == type_name for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)


def decoupled(model: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id="1")
    request.inputs.add(name="input", datatype="INT64", shape=[4]).contents.int64_contents.extend([0] * 4)
    request.parameters["stream"].bool_param = True
    return request


async def stream_once(plane: DataPlane, request: pb.ModelInferRequest) -> list[str]:
    async def requests() -> AsyncIterator[bytes]:
        yield request.SerializeToString()  # a server's streams take their requests as bytes

    async with StreamSession(plane, requests()) as session:
        return [r.error_message async for r in session.responses()]


@pytest.mark.parametrize("model", ["toy", "nope"])
def test_a_router_refusing_a_decoupled_request_keeps_no_cycle(collector_off: None, model: str) -> None:
    """``toy`` is a classifier this router serves, ``nope`` nothing: neither streams."""

    async def main() -> list[str]:
        async with fleet() as built:
            return await stream_once(built.plane, decoupled(model))

    errors = asyncio.run(main())
    assert len(errors) == 1 and errors[0].startswith("NOT_FOUND: "), errors
    assert left_in_cycles("ModelInferRequest") == 0


class FailingModels:
    """The two calls LocalDataPlane makes of its models for a generation that fails."""

    def generates(self, model_name: str) -> bool:
        return True

    def count(self, outcome: str, model_name: str) -> None:
        pass

    async def generate(self, request: pb.ModelInferRequest, on_chunk: object) -> None:
        raise StratusError("the runtime failed")


def test_a_local_generation_that_fails_keeps_no_cycle(collector_off: None) -> None:
    plane = LocalDataPlane(FailingModels(), tier=Tier.CLOUD, name="cloud")  # type: ignore[arg-type]
    errors = asyncio.run(stream_once(plane, decoupled("chat")))
    assert len(errors) == 1 and "the runtime failed" in errors[0], errors
    assert left_in_cycles("ModelInferRequest") == 0


class Big:
    """What only the failing frame holds: a parsed request, say."""


def test_drop_frames_frees_what_a_chain_of_errors_held(collector_off: None) -> None:
    def fails_holding_its_own_error() -> None:
        held = Big()  # noqa: F841 (what the frame keeps alive)
        try:
            raise ValueError("first")
        except ValueError as first:
            kept = first  # a frame that holds its error: the cycle
            raise StratusError("then this") from kept

    try:
        fails_holding_its_own_error()
    except StratusError as exc:
        caught = exc
    drop_frames(caught)
    assert caught.__cause__ is not None and caught.__cause__.__traceback__ is None
    del caught
    assert left_in_cycles("Big") == 0
