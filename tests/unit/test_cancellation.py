"""Deadlines and cancellation on both ends of an AgentLink, with fakes of the real classes."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.link import Link, receive
from edge_agent.settings import AgentSettings
from router.fleet.registry import FleetRegistry
from stratus.convert import codec
from stratus.convert.hello import hello_from_wire
from stratus.convert.tensors import Tensors
from stratus.errors import DeadlineExceeded
from stratus.execution.local_models import LocalAnswer, LocalModels
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb


class SlowModels(LocalModels):
    """LocalModels whose answer waits until released: work that is still running."""

    def __init__(self) -> None:  # no models to load
        self.latency = {}
        self.recorder = None
        self.generators = None
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.cancelled = False

    async def answer(self, request: pb.ModelInferRequest) -> LocalAnswer:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("released work should have been cancelled first")


class RouterStream:
    """The router's side of a link as the agent's reader sees it: messages, then EOF."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[object] = asyncio.Queue()

    async def read(self) -> object:
        return await self.messages.get()


def agent_with(models: SlowModels) -> Agent:
    return Agent(AgentSettings(tier=Tier.DEVICE, router="127.0.0.1:1", name="unit"), models)


def test_cancel_from_the_router_stops_running_work_and_reports_it() -> None:
    async def scenario() -> fpb.Result:
        models = SlowModels()
        agent = agent_with(models)
        link = Link(address="router")
        agent.links[link.address] = link
        stream = RouterStream()
        reader = asyncio.create_task(receive(agent, stream, link))  # type: ignore[arg-type]
        work = fpb.Work(request_id="w1", request=pb.ModelInferRequest(model_name="digits"))
        stream.messages.put_nowait(fpb.RouterMessage(work=work))
        await asyncio.wait_for(models.started.wait(), 2)
        stream.messages.put_nowait(fpb.RouterMessage(cancel=fpb.Cancel(request_id="w1")))
        message = await asyncio.wait_for(link.outbox.get(), 2)
        assert message is not None and agent.in_flight == 0
        assert models.cancelled, "the running answer was not cancelled"
        stream.messages.put_nowait(grpc.aio.EOF)
        with pytest.raises(ConnectionError, match="router ended the link"):
            await reader
        return message.result

    result = asyncio.run(scenario())
    assert result.request_id == "w1" and result.error.code == grpc.StatusCode.CANCELLED.value[0]


def test_work_past_its_budget_is_dropped_with_deadline_exceeded() -> None:
    async def scenario() -> fpb.Result:
        agent = agent_with(SlowModels())
        link = Link(address="router")
        agent.accept(fpb.Work(request_id="w2", request=pb.ModelInferRequest(), budget_ms=20.0), link)
        message = await asyncio.wait_for(link.outbox.get(), 2)
        assert message is not None
        return message.result

    result = asyncio.run(scenario())
    assert result.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "budget of 20.0 ms ran out" in result.error.message


def one_item() -> Tensors:
    request = pb.ModelInferRequest(model_name="digits")
    codec.encode_request_inputs(request, {"input": np.zeros((1, 64), np.float32)})
    return Tensors.from_request(request)


def hello() -> fpb.Hello:
    return fpb.Hello(
        agent_id="a1",
        tier=fpb.TIER_DEVICE,
        capacity=2,
        variants=[fpb.VariantInfo(name="digits-small", family="digits")],
    )


def test_a_cancelled_request_sends_cancel_to_its_agent() -> None:
    async def scenario() -> list[str]:
        registry = FleetRegistry()
        handle = registry.register(hello_from_wire(hello()), peer="test")
        task = asyncio.create_task(
            handle.work.submit(one_item(), variant="digits", outputs=(), budget_ms=30_000.0)
        )
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        kinds = []
        while not handle.work.outbox.empty():
            message = handle.work.outbox.get_nowait()
            assert message is not None
            kinds.append(message.WhichOneof("kind"))
        assert not handle.work.pending
        return kinds

    assert asyncio.run(scenario()) == ["work", "cancel"]


def test_a_request_past_its_budget_cancels_the_work_and_says_so() -> None:
    async def scenario() -> list[str]:
        registry = FleetRegistry()
        handle = registry.register(hello_from_wire(hello()), peer="test")
        with pytest.raises(DeadlineExceeded, match=r"did not answer within \d{1,2}\.\d ms"):
            await handle.work.submit(one_item(), variant="digits", outputs=(), budget_ms=20.0)
        await asyncio.sleep(0.01)  # the Work's own task sends the Cancel as it unwinds
        return [m.WhichOneof("kind") for m in (handle.work.outbox.get_nowait(), handle.work.outbox.get_nowait()) if m]

    assert asyncio.run(scenario()) == ["work", "cancel"]


def test_losing_an_agent_fails_its_pending_requests_at_once() -> None:
    async def scenario() -> None:
        registry = FleetRegistry()
        handle = registry.register(hello_from_wire(hello()), peer="test")
        task = asyncio.create_task(
            handle.work.submit(one_item(), variant="digits", outputs=(), budget_ms=30_000.0)
        )
        await asyncio.sleep(0.01)
        registry.lose(handle, "stream broke")
        from stratus.errors import Unavailable

        with pytest.raises(Unavailable, match="agent a1 stream broke"):
            await task

    asyncio.run(scenario())
