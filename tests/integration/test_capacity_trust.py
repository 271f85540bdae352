"""A declared capacity is a claim (security2 N3): the router trusts an agent with the calls at
once it has shown it serves within budget, not with what its Hello says.

A black hole, an agent holding a credential that declares capacity 1,024 and answers nothing,
beside one honest device agent: the black hole is sent a handful of Works, not the burst, and
the requests in those Works try the honest agent once the black hole has had its patience.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
import numpy as np

from stratus.convert.parameters import Served
from stratus.serving.channels import grpc_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import Cluster, ready_count, request, wait_until

BURST = 96


class BlackHole:
    """An AgentLink that says Hello with capacity 1,024, heartbeats that it reads, and answers
    no Work; counts the Works it is sent."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.works = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> BlackHole:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def _run(self) -> None:
        received = 0
        hello = fpb.Hello(
            agent_id="hole", tier=fpb.TIER_DEVICE, capacity=1024, queue_limit=4096,
            variants=[fpb.VariantInfo(name="digits-small", family="digits", dynamic_batch=True, max_batch=1024)],
        )  # fmt: skip

        async def messages() -> AsyncIterator[fpb.AgentMessage]:
            yield fpb.AgentMessage(hello=hello)
            while not self._stop.is_set():
                await asyncio.sleep(0.3)
                yield fpb.AgentMessage(heartbeat=fpb.Heartbeat(received=received))

        async with grpc.aio.insecure_channel(self.router, options=grpc_options()) as channel:
            call = fpb_grpc.AgentLinkStub(channel).Connect(messages())
            async for message in call:
                received += 1
                self.works += message.WhichOneof("kind") == "work"
                if self._stop.is_set():
                    call.cancel()
                    break


async def burst(router: str, x: np.ndarray) -> list[Served | grpc.StatusCode]:
    async with grpc.aio.insecure_channel(router, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def one(row: np.ndarray) -> Served | grpc.StatusCode:
            try:
                response = await stub.ModelInfer(request(row[None, :], max_tier="device", budget_ms=1500.0), timeout=10)
            except grpc.aio.AioRpcError as failed:
                return failed.code()
            return Served.read(response.parameters)

        return list(await asyncio.gather(*(one(row) for row in x)))


def test_an_agent_declaring_a_thousand_slots_is_trusted_with_what_it_serves(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router().address
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1, timeout_s=60)
    with BlackHole(router) as hole:
        wait_until(lambda: ready_count(router) == 2, timeout_s=15)
        outcomes = asyncio.run(burst(router, digits.held_out.x[:BURST]))
        sent_to_hole = hole.works
    honest = sum(1 for o in outcomes if isinstance(o, Served) and o.agent == "dev-1")
    # Trusted with what it declared (the window off), the black hole was sent 63-76 Works of a
    # burst of 96; trusted with 4 slots first, 6-9. What the window bounds is calls at once, not
    # items: requests merge into the few Works it holds until its load shows.
    assert sent_to_hole <= 24, f"the black hole was sent {sent_to_hole} Works"
    # A Work it holds costs its requests the agent's patience (1 s: it never answered, so nothing
    # measured earns it more), not their budget of 1.5 s: each then tries the honest agent. Waiting
    # out the budget instead, the burst lost 34-58 of 96 requests to DEADLINE_EXCEEDED.
    assert honest == BURST, f"answered by the honest agent: {honest} of {BURST}: {outcomes}"
