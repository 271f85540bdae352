"""A user-space link emulator for tests and benchmarks (this kernel has no ``tc netem``).

``python -m stratus.devtools.netem --target HOST:PORT [--delay-ms D]`` listens on a free loopback
port, prints ``STRATUS READY netem HOST:PORT`` and forwards every connection to the
target, holding each chunk ``D`` ms in each direction. SIGUSR1 cuts the link (open
connections go silent: bytes are swallowed, nothing is answered or closed, as when a
cable is pulled); SIGUSR2 restores it for new connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from stratus.process import announce, stop_on_signals


class LinkEmulator:
    def __init__(self, *, target: str, delay_ms: float) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.delay_s = delay_ms / 1000.0
        self.cut = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.cut:
                    continue  # swallow: the far side hears nothing
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not self.cut:
                writer.close()

    async def handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.cut:
            return  # accepted, never answered
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        pumps = [
            asyncio.create_task(self._pump(client_reader, server_writer)),
            asyncio.create_task(self._pump(server_reader, client_writer)),
        ]
        self._tasks.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        self._tasks.difference_update(pumps)


async def main(target: str, delay_ms: float) -> None:
    emulator = LinkEmulator(target=target, delay_ms=delay_ms)
    stop = asyncio.Event()
    stop_on_signals(stop)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(emulator, "cut", True))
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(emulator, "cut", False))
    server = await asyncio.start_server(emulator.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    announce("netem", f"127.0.0.1:{port}")
    await stop.wait()
    server.close()
    with contextlib.suppress(Exception):
        await server.wait_closed()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(main(args.target, args.delay_ms))
