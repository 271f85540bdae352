"""Calls a busy server has not yet taken wait their turn: gRPC's own defaults drop them at
random past 1,000 waiting and all past 3,000, whoever sent them, so one client's burst of
4,000 calls cost another client's calls CANCELLED within a millisecond (security F21)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import grpc
import pytest

from stratus.serving.channels import create_server

BURST = 3_500  # past gRPC's default 3,000, under the server's 4 x 1,024 streams
CONNECTIONS = 4


async def _busy_server(blocked: threading.Event) -> tuple[grpc.aio.Server, int]:
    async def block(request: bytes, context: object) -> bytes:
        blocked.set()
        time.sleep(1.5)  # the event loop taken: calls pile up in gRPC's queue meanwhile
        return request

    async def echo(request: bytes, context: object) -> bytes:
        return request

    server = create_server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Pending", {
        "Block": grpc.unary_unary_rpc_method_handler(block),
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
    }),))  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _method(channel: grpc.aio.Channel, name: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
    return channel.unary_unary(f"/test.Pending/{name}")


async def _burst(port: int, blocked: threading.Event) -> Counter[str]:
    """On a loop of its own: one call that blocks the server's loop, then BURST calls at once."""
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(CONNECTIONS)
    ]
    try:
        await asyncio.gather(*(channel.channel_ready() for channel in channels))
        blocking = asyncio.ensure_future(_method(channels[0], "Block")(b"", timeout=30))
        assert await asyncio.to_thread(blocked.wait, 10)
        calls = [
            _method(channels[index % CONNECTIONS], "Echo")(b"x", timeout=30)
            for index in range(BURST)
        ]
        codes: Counter[str] = Counter()
        for outcome in await asyncio.gather(blocking, *calls, return_exceptions=True):
            codes[outcome.code().name if isinstance(outcome, grpc.aio.AioRpcError) else "OK"] += 1
        return codes
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


@pytest.mark.timeout(60)
def test_a_burst_past_grpcs_pending_limit_is_served_not_dropped() -> None:
    async def scenario() -> Counter[str]:
        blocked = threading.Event()
        server, port = await _busy_server(blocked)
        try:
            return await asyncio.to_thread(asyncio.run, _burst(port, blocked))
        finally:
            await server.stop(None)

    assert asyncio.run(scenario()) == Counter({"OK": BURST + 1})
