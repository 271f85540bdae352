"""Inference callers hold at most their share of a server's RPC slots (security2 N1), on a
real gRPC server in this process: past it they are refused at once, and probes, health
checks and every other service still get through."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stratus.serving.auth import BearerTokenInterceptor
from stratus.serving.interceptor import ErrorInterceptor, InferenceShare
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc


class _Silent(pb_grpc.GRPCInferenceServiceServicer):
    """Streams that never answer, as a flood's would be held."""

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=True)

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[pb.ModelStreamInferResponse]:
        await asyncio.Event().wait()
        yield pb.ModelStreamInferResponse()


async def _run() -> None:
    share = InferenceShare(2, exempt=BearerTokenInterceptor.OPEN)
    server = grpc.aio.server(interceptors=[share, ErrorInterceptor()])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(_Silent(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            held = [stub.ModelStreamInfer(iter(())) for _ in range(2)]
            await asyncio.sleep(0.5)
            assert share.held == 2 and not any(call.done() for call in held)
            refused = stub.ModelStreamInfer(iter(()))
            assert await refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "kept for agents, operators and health checks" in (await refused.details() or "")
            try:
                await stub.ModelReady(pb.ModelReadyRequest(name="x"), timeout=5)
                raise AssertionError("a unary inference call past the share was answered")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await stub.ServerLive(pb.ServerLiveRequest(), timeout=5)).live  # a probe is never counted
            checked = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
            held[0].cancel()
            await asyncio.sleep(0.5)
            assert share.held == 1  # a closed stream gives its place back
            assert (await stub.ModelReady(pb.ModelReadyRequest(name="x"), timeout=5)).ready
            held[1].cancel()
    finally:
        await server.stop(None)


def test_inference_calls_past_their_share_are_refused_and_the_rest_get_through() -> None:
    asyncio.run(_run())
    # The refusals abort inside the server; the tracebacks' cycles hold it, and with it
    # grpc.aio's poller thread, until collected (as in test_probe.py).
    gc.collect()
