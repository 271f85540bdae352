"""The fleet ``benchmarks/abuse.py`` attacks (a cloud gateway, a router with every kind of token and
the OpenAI API, two device agents and an edge agent, on loopback), and the legitimate side that
measures it from a process of its own: digits traffic at a fixed rate, a ServerLive prober and an
RSS sampler, reported per attack window."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.devtools.launcher import Launched, free_port, launch  # noqa: E402
from stratus.serving.channels import grpc_options  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402
from stratus.wire import inference_pb2_grpc as pb_grpc  # noqa: E402

MODELS = ROOT / "models"


MAX_FAILED = 0


MAX_LIVE_MS = 100.0


MAX_RSS_MB = 50.0


LEGIT_RATE = 100.0


PROBE_EVERY_S = 0.020


RSS_EVERY_S = 0.050


# After each attack: the window stays open this long (a link an attack broke fails requests
# just after it), then the fleet must be whole again before the next attack starts.
TAIL_S = 1.0


HELLO_TIMEOUT_S = 10.0


AGENTS = (("device", "device-1"), ("device", "device-2"), ("edge", "edge-1"))


INFER = "/inference.GRPCInferenceService/ModelInfer"


@dataclass(frozen=True)
class Tokens:
    """One credential per role, as a production router is started: files, not flags."""

    agent: str  # the agents' shared token: what an attacker who took one device holds
    operator: str
    client: str  # the cloud gateway's client token, which the router presents
    folder: Path

    def file(self, role: str) -> Path:
        return self.folder / f"{role}.token"

    def own_file(self, agent: str) -> Path:
        """Each real agent's own token: the router binds its id to it (--agent-tokens-file)."""
        return self.folder / f"agent-{agent}.token"

    @classmethod
    def write(cls, folder: Path) -> Tokens:
        tokens = cls(
            agent="agent-s3cret", operator="operator-s3cret", client="client-s3cret",
            folder=folder,
        )  # fmt: skip
        for role in ("agent", "operator", "client"):
            _secret_file(tokens.file(role), getattr(tokens, role))
        lines = []
        for _, name in AGENTS:
            own = f"{name}-own-s3cret-token"
            _secret_file(tokens.own_file(name), own)
            lines.append(f"{name} {own}\n")
        _secret_file(folder / "agents.tokens", "".join(lines))
        return tokens


def _secret_file(path: Path, text: str) -> None:
    path.write_text(text if text.endswith("\n") else text + "\n")
    path.chmod(0o600)


def role_args(role: str, tokens: Tokens, *, cloud: str = "", router: str = "", openai: str = "",
              name: str = "", tier: str = "device") -> list[str]:  # fmt: skip
    """Every process's flags, in one place, so that a change of the defaults (a flag that
    becomes required, a credential a role must now carry) is made here only."""
    quiet = ["--log-level", "WARNING"]
    if role == "cloud":
        return [
            "cloud", "--listen", "127.0.0.1:0", "--models", str(MODELS),
            "--client-token-file", str(tokens.file("client")), *quiet,
        ]  # fmt: skip
    if role == "router":
        return [
            # both loopbacks, so that the attacker (::1) and the legitimate side (127.0.0.1) are
            # two clients to the router, as they are off one machine
            "router", "--listen", "localhost:0", "--cloud", cloud, "--no-advertise",
            "--cloud-token-file", str(tokens.file("client")),
            # per-agent tokens only: beside them a shared agent token is refused (security2 N4),
            # so the attacks that hold it (F1, F12) meet the refusal a real router gives
            "--agent-tokens-file", str(tokens.folder / "agents.tokens"),
            "--operator-token-file", str(tokens.file("operator")),
            "--hello-timeout-s", str(HELLO_TIMEOUT_S),
            "--openai", openai, *quiet,
        ]  # fmt: skip
    if role == "agent":
        return [
            "agent", "--tier", tier, "--models", str(MODELS), "--router", router, "--name", name,
            "--agent-token-file", str(tokens.own_file(name)), *quiet,
        ]  # fmt: skip
    raise ValueError(f"no role {role!r}")


@dataclass
class Fleet:
    cloud: Launched
    router: Launched
    agents: list[Launched]
    openai: str
    tokens: Tokens
    log_dir: Path
    extra: list[Launched] = field(default_factory=list)  # started by an attack

    @property
    def attacker_address(self) -> str:
        """The router as the attacker dials it: a client of its own (IPv6 loopback)."""
        return f"[::1]:{self.router.address.rsplit(':', 1)[1]}"

    @property
    def legit_address(self) -> str:
        """The router as the legitimate side dials it (IPv4 loopback)."""
        return f"127.0.0.1:{self.router.address.rsplit(':', 1)[1]}"

    def stop(self) -> None:
        for launched in reversed([self.cloud, self.router, *self.agents, *self.extra]):
            with contextlib.suppress(Exception):
                launched.stop(timeout=10)


def start_fleet(log_dir: Path, tokens: Tokens) -> Fleet:
    """The fleet, every agent ready and the cloud linked; what started is stopped on a failure."""
    started: list[Launched] = []
    try:
        cloud = launch(role_args("cloud", tokens), role="cloud", log_dir=log_dir)
        started.append(cloud)
        openai = f"127.0.0.1:{free_port()}"
        router = launch(role_args("router", tokens, cloud=cloud.address, openai=openai), role="router",
                        log_dir=log_dir)  # fmt: skip
        started.append(router)
        for tier, name in AGENTS:
            args = role_args("agent", tokens, router=router.address, name=name, tier=tier)
            started.append(launch(args, role=name, log_dir=log_dir))
        wait_for_agents(router.address, len(AGENTS), timeout_s=60)
    except BaseException:
        for launched in reversed(started):
            launched.stop()
        raise
    return Fleet(
        cloud=cloud, router=router, agents=started[2:], openai=openai, tokens=tokens, log_dir=log_dir
    )


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


@dataclass
class Sent:
    started: float
    ended: float = 0.0
    code: str = ""  # "" while in flight
    details: str = ""


@dataclass(frozen=True)
class WindowReport:
    sent: int
    failed: int
    failures: dict[str, int]
    failure_details: dict[str, str]  # the first message of each code
    worst_live_ms: float
    rss_start_mb: dict[str, float]
    rss_peak_mb: dict[str, float]
    rss_end_mb: dict[str, float]

    def growth(self, role: str) -> float:
        return self.rss_peak_mb.get(role, 0.0) - self.rss_start_mb.get(role, 0.0)


class Legit:
    """Open-loop digits requests at a fixed rate, a ServerLive prober and an RSS sampler."""

    def __init__(self, router: str, pids: dict[str, int]) -> None:
        self.router = router
        self.pids = pids
        self.sent: list[Sent] = []
        self.probes: list[tuple[float, float]] = []  # (started, ms)
        self.probing_since = 0.0  # the probe in flight, 0 when none
        self.rss: list[tuple[float, dict[str, float]]] = []
        self.stopping = threading.Event()
        x = digits_splits().held_out.x
        self.requests = []
        for index in range(len(x)):
            request = pb.ModelInferRequest(model_name="digits", id=f"legit-{index}")
            codec.encode_request_inputs(request, {"input": x[index : index + 1]})
            self.requests.append(request)

    async def load(self) -> None:
        async with grpc.aio.insecure_channel(self.router, options=grpc_options()) as channel:
            stub = aio(pb_grpc.GRPCInferenceServiceStub(channel))
            tasks: set[asyncio.Task[None]] = set()
            next_send, index = time.monotonic(), 0
            while not self.stopping.is_set():
                delay = next_send - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                    continue
                next_send += 1.0 / LEGIT_RATE
                task = asyncio.create_task(self._one(stub, self.requests[index % len(self.requests)]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                index += 1
            if tasks:
                await asyncio.wait(tasks)

    async def _one(self, stub: Any, request: pb.ModelInferRequest) -> None:
        record = Sent(started=time.monotonic())
        self.sent.append(record)
        try:
            await stub.ModelInfer(request, timeout=5.0)
            code = "OK"
        except grpc.aio.AioRpcError as error:
            code, record.details = error.code().name, error.details() or ""
        record.ended, record.code = time.monotonic(), code

    def probe(self) -> None:
        with grpc.insecure_channel(self.router, options=grpc_options()) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            while not self.stopping.is_set():
                started = self.probing_since = time.monotonic()
                with contextlib.suppress(grpc.RpcError):  # a refused probe counts by its time
                    stub.ServerLive(pb.ServerLiveRequest(), timeout=5.0)
                ended = time.monotonic()
                self.probing_since = 0.0
                self.probes.append((started, (ended - started) * 1000.0))
                time.sleep(max(0.0, PROBE_EVERY_S - (ended - started)))

    def sample(self) -> None:
        while not self.stopping.wait(RSS_EVERY_S):
            self.rss.append((time.monotonic(), {role: rss_mb(pid) for role, pid in self.pids.items()}))

    def report(self, start: float, end: float) -> WindowReport:
        """The window [start, end]: each request sent in it, once it is answered or failed."""
        deadline = time.monotonic() + 10.0
        mine = [s for s in self.sent if start <= s.started <= end]
        while any(not s.code for s in mine) and time.monotonic() < deadline:
            time.sleep(0.05)
        failures = Counter(s.code or "NO ANSWER" for s in mine if s.code != "OK")
        said = {s.code: s.details for s in reversed(mine) if s.code not in ("", "OK")}
        worst = max((ms for t, ms in self.probes if start <= t <= end), default=0.0)
        if self.probing_since and self.probing_since <= end:
            worst = max(worst, (time.monotonic() - self.probing_since) * 1000.0)
        inside = [levels for t, levels in self.rss if start <= t <= end] or [{}]
        before = [levels for t, levels in self.rss if t <= start] or inside
        return WindowReport(
            sent=len(mine),
            failed=sum(failures.values()),
            failures=dict(failures),
            failure_details=said,
            worst_live_ms=worst,
            rss_start_mb=before[-1],
            rss_peak_mb={role: max(levels.get(role, 0.0) for levels in inside) for role in self.pids},
            rss_end_mb=inside[-1],
        )


def legit_main(router: str, pids: dict[str, int], conn: multiprocessing.connection.Connection) -> None:
    """The legitimate side's process: answer each ("report", start, end) until ("stop",)."""
    legit = Legit(router, pids)
    threads = [threading.Thread(target=legit.probe, name="abuse-probe", daemon=True),
               threading.Thread(target=legit.sample, name="abuse-rss", daemon=True)]  # fmt: skip
    for thread in threads:
        thread.start()

    def serve() -> None:
        while True:
            command = conn.recv()
            if command[0] == "stop":
                legit.stopping.set()
                return
            conn.send(legit.report(command[1], command[2]))

    server = threading.Thread(target=serve, name="abuse-commands", daemon=True)
    server.start()
    conn.send("started")
    asyncio.run(legit.load())
    conn.send("stopped")


class LegitSide:
    """The attacker's handle on the legitimate side's process."""

    def __init__(self, router: str, pids: dict[str, int]) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(target=legit_main, args=(router, pids, theirs), name="abuse-legit")
        self._process.start()
        if self._conn.recv() != "started":
            raise RuntimeError("the legitimate side did not start")

    def report(self, start: float, end: float) -> WindowReport:
        self._conn.send(("report", start, end))
        report: WindowReport = self._conn.recv()
        return report

    def stop(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._conn.send(("stop",))
        self._process.join(timeout=15)
        if self._process.is_alive():
            self._process.kill()


def aio(stub: object) -> Any:
    """A generated stub on a grpc.aio channel: its calls are awaitable and async-iterable,
    which the generated (synchronous) type hints do not say."""
    return stub
