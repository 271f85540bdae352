"""A TCP balancer that behaves as a Kubernetes Service does in front of a site's routers: each
new connection goes to the next backend that is ready (its gRPC health service says SERVING on
``""``, asked every ``check_s``, as a readiness probe would), and a connection once made stays on
its backend until one side closes it. Clients behind it are "plain": one address, no health
checking, no service config (a tritonclient pointed at the Service)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stratus.devtools.launcher import free_port

CHUNK = 64 * 1024


class Balancer:
    def __init__(self, backends: Sequence[str], *, check_s: float = 0.1) -> None:
        self.backends = list(backends)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.ready: set[str] = set()
        self.connections: dict[str, int] = dict.fromkeys(self.backends, 0)  # made to each, in all
        self._check_s = check_s
        self._turn = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-balancer", daemon=True)

    def __enter__(self) -> Balancer:
        self._thread.start()
        assert self._started.wait(10), "the balancer did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the balancer did not stop"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        checker = self._loop.create_task(self._check())
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            checker.cancel()
            server.close()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _check(self) -> None:
        channels = {b: grpc.aio.insecure_channel(b) for b in self.backends}
        try:
            while True:
                for backend, channel in channels.items():
                    try:
                        reply = await health_pb2_grpc.HealthStub(channel).Check(
                            health_pb2.HealthCheckRequest(service=""), timeout=self._check_s
                        )
                        serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    except grpc.RpcError:
                        serving = False
                    (self.ready.add if serving else self.ready.discard)(backend)
                await asyncio.sleep(self._check_s)
        finally:
            for channel in channels.values():
                await channel.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ready = [b for b in self.backends if b in self.ready]
        if not ready:
            writer.close()
            return
        backend = ready[next(self._turn) % len(ready)]
        host, port = backend.rsplit(":", 1)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        self.connections[backend] += 1
        with contextlib.suppress(asyncio.CancelledError):  # the balancer stopping
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
