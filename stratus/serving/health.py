"""The standard gRPC health service for every Stratus server, following its data plane's
readiness, so that Kubernetes ``grpc`` probes see what the process can really do."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

import grpc


class Health:
    """The standard ``grpc.health.v1.Health`` service, so Kubernetes ``grpc`` probes work.

    Service ``""`` follows the data plane's readiness (checked every ``interval_s``);
    ``"liveness"`` is SERVING for as long as the process serves at all. On shutdown both
    turn NOT_SERVING at once, before in-flight work is finished.
    """

    LIVENESS: Final = "liveness"

    def __init__(
        self, server: grpc.aio.Server, ready: Callable[[], bool], *, interval_s: float = 0.5
    ) -> None:
        from grpc_health.v1 import health, health_pb2_grpc

        self._servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self._ready = ready
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._set(self.LIVENESS, serving=True)
        await self._set("", serving=self._ready())
        self._task = asyncio.create_task(self._follow(), name="stratus-health")

    async def _follow(self) -> None:
        current = self._ready()
        while True:
            await asyncio.sleep(self._interval_s)
            now = self._ready()
            if now != current:
                await self._set("", serving=now)
                current = now

    async def _set(self, service: str, *, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._servicer.set(service, status)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._servicer.enter_graceful_shutdown()
