"""The security review's attacks, each at its strongest within today's limits, against a live fleet.

A real fleet on loopback (a cloud gateway, a router with agent, operator and peer tokens and the
OpenAI API, two device agents and an edge agent) serves legitimate digits traffic at 100 req/s
from a process of its own, which also pings ServerLive every 20 ms and samples the router's
RSS from /proc. Each attack runs for ``--duration-s`` while that goes on; then one row says what
the attack did, what it got, and whether the legitimate side stayed within the goals:

- no legitimate request failed in the window (an attack may cost the cloud, never a client);
- ServerLive never took 100 ms or more (nothing a stranger sends stalls the router's loop);
- the router's RSS grew by less than 50 MB (nothing a stranger sends is kept, or amplified).

It measures and does not assert: an attack outside the goals is a FAIL row, not an error; the
exit code is 0 unless the fleet does not start.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/abuse.py [--only F5,F6] [--duration-s 5]

The fleet's flags are built in one place (:func:`role_args`); the attacks are one function
each, listed in :data:`ATTACKS` in the order they run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.peers import sync_parts  # noqa: E402
from router.registry import MAX_VARIANTS_PER_AGENT  # noqa: E402
from stratus import codec  # noqa: E402
from stratus.auth import sync_proof  # noqa: E402
from stratus.channels import MAX_MESSAGE_BYTES, MAX_STREAMS_PER_CONNECTION, grpc_options  # noqa: E402
from stratus.demo import wait_for_agents  # noqa: E402
from stratus.generation import MAX_TOKENS, TEXT_INPUT  # noqa: E402
from stratus.launcher import Launched, free_port, launch  # noqa: E402
from stratus.protocol import MAX_BUDGET_MS, set_parameter  # noqa: E402
from stratus.serving import STREAM_WINDOW  # noqa: E402
from stratus.text_wire import MAX_PROMPT_BYTES  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import fleet_pb2 as fpb  # noqa: E402
from stratus.wire import fleet_pb2_grpc as fpb_grpc  # noqa: E402
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


# ---------------------------------------------------------------------------------------------
# The fleet


@dataclass(frozen=True)
class Tokens:
    """One credential per role, as a production router is started: files, not flags."""

    agent: str  # the agents' shared token: what an attacker who took one device holds
    operator: str
    peer: str
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
            agent="agent-s3cret", operator="operator-s3cret", peer="peer-s3cret", client="client-s3cret",
            folder=folder,
        )  # fmt: skip
        for role in ("agent", "operator", "peer", "client"):
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
            "router", "--listen", "127.0.0.1:0", "--cloud", cloud, "--no-advertise",
            "--cloud-token-file", str(tokens.file("client")),
            "--agent-tokens-file", str(tokens.folder / "agents.tokens"),
            "--agent-token-file", str(tokens.file("agent")),
            "--operator-token-file", str(tokens.file("operator")),
            "--peer-token-file", str(tokens.file("peer")),
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


# ---------------------------------------------------------------------------------------------
# The legitimate side: its own process, so that an attacker's CPU (building a 16 MiB message)
# never delays a probe or a request here. Every event is stamped with time.monotonic, which is
# one clock for every process on Linux, so the attacker asks for a window by its own times.


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


# ---------------------------------------------------------------------------------------------
# Attack helpers


@dataclass(frozen=True)
class Outcome:
    did: str
    result: str


@dataclass
class Context:
    fleet: Fleet
    duration_s: float
    window_start: float = 0.0  # set by mark(): an attack that builds its payload first
    seen: dict[str, str] = field(default_factory=dict)  # the first message of each error code

    @property
    def router(self) -> str:
        return self.fleet.router.address

    @property
    def cloud(self) -> str:
        return self.fleet.cloud.address

    def mark(self) -> float:
        """The window starts now (the payload is built); the time the attack should stop."""
        self.window_start = time.monotonic()
        return self.window_start + self.duration_s

    def name(self, error: grpc.aio.AioRpcError) -> str:
        """The error's code, keeping the first message seen for each code, to print."""
        code = error.code().name
        self.seen.setdefault(code, error.details() or "")
        return code

    async def code_of(self, call: Awaitable[Any]) -> str:
        try:
            await call
        except grpc.aio.AioRpcError as error:
            return self.name(error)
        return "OK"

    def channel(self, address: str = "", options: Iterable[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address or self.router, options=[*grpc_options(), *options])


def codes(counts: Counter[str], expected: str = "") -> str:
    """A tally as a row reads it: "UNAUTHENTICATED 812/812", or "X 800, OK 12 of 812"."""
    total = sum(counts.values())
    if not total:
        return "nothing sent"
    if len(counts) == 1:
        ((code, count),) = counts.items()
        return f"{code} {count}/{total}"
    parts = ", ".join(f"{code} {count}" for code, count in counts.most_common())
    return f"{parts} of {total}" + (f" (expected {expected})" if expected else "")


def aio(stub: object) -> Any:
    """A generated stub on a grpc.aio channel: its calls are awaitable and async-iterable,
    which the generated (synchronous) type hints do not say."""
    return stub


async def repeat(until: float, concurrency: int, one: Callable[[], Awaitable[str]]) -> Counter[str]:
    """``one()`` again and again from ``concurrency`` loops until ``until``: its codes."""
    tally: Counter[str] = Counter()

    async def loop() -> None:
        while time.monotonic() < until:
            tally[await one()] += 1

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return tally


def raw_infer(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
    """ModelInfer that sends bytes serialized once: the attacker's CPU goes on sending."""
    return channel.unary_unary(INFER)


def digits_hello(agent_id: str, token: str, *families: fpb.FamilyInfo) -> fpb.AgentMessage:
    """A Hello as a rogue agent sends it: the digits variant, the largest capacity it may claim."""
    return fpb.AgentMessage(
        hello=fpb.Hello(
            agent_id=agent_id,
            tier=fpb.TIER_DEVICE,
            variants=[
                fpb.VariantInfo(name="digits-small", family="digits", dynamic_batch=True, max_batch=1024)
            ],
            capacity=1024,
            queue_limit=4096,
            token=token,
            families=families,
        )
    )


async def hello_once(ctx: Context, stub: Any, message: fpb.AgentMessage, hold_s: float = 0.0) -> str:
    """One AgentLink: the Hello, then (if welcomed) held ``hold_s`` and closed: its code, or
    WELCOMED."""

    async def messages() -> Any:
        yield message
        await asyncio.sleep(hold_s)

    call = stub.Connect(messages())
    try:
        async for reply in call:
            if reply.WhichOneof("kind") == "welcome":
                call.cancel()
                return "WELCOMED"
    except grpc.aio.AioRpcError as error:
        return ctx.name(error)
    return "CLOSED"


async def fleet_status(ctx: Context, include_agents: bool = True) -> fpb.FleetStatus:
    async with ctx.channel() as channel:
        status: fpb.FleetStatus = await aio(fpb_grpc.FleetStub(channel)).Status(
            fpb.FleetStatusRequest(include_agents=include_agents), timeout=10
        )
        return status


async def ready_after(ctx: Context) -> str:
    agents = {a.id: a.state for a in (await fleet_status(ctx)).agents}
    ready = sum(1 for _, name in AGENTS if agents.get(name) == fpb.AGENT_STATE_READY)
    return f"{ready}/{len(AGENTS)} agents ready after"


# ---------------------------------------------------------------------------------------------
# The attacks, one function each: what it sends, as hard as today's limits allow.


async def baseline(ctx: Context) -> Outcome:
    """No attack: what the window's figures are on their own, to read the rows against."""
    await asyncio.sleep(ctx.duration_s)
    return Outcome(f"legit load alone x {ctx.duration_s:g} s", "-")


async def f1_rogue_hello(ctx: Context) -> Outcome:
    """Join without the agent token, with a wrong one, or with another role's: as a new
    agent, and under the ids of the real agents (a takeover)."""
    tokens = ctx.fleet.tokens
    tries = [("rogue", ""), ("device-1", ""), ("device-1", "guess"), ("device-2", tokens.operator),
             ("edge-1", tokens.peer)]  # fmt: skip
    async with ctx.channel() as channel:
        stub = aio(fpb_grpc.AgentLinkStub(channel))
        sent = 0

        async def one() -> str:
            nonlocal sent
            agent_id, token = tries[sent % len(tries)]
            sent += 1
            return await hello_once(ctx, stub, digits_hello(agent_id, token), hold_s=0.5)

        tally = await repeat(ctx.mark(), 16, one)
    return Outcome(f"{sum(tally.values())} Hellos: no/wrong/other-role token, real ids",
                   f"{codes(tally)}; {await ready_after(ctx)}")  # fmt: skip


async def f1_stolen_token_takeover(ctx: Context) -> Outcome:
    """The shared agent token is on every device (F9, F10): a second real agent process that
    calls itself device-1 with it tries to take the id over. device-1's id is bound to its own
    token (--agent-tokens-file), so the twin is refused and device-1 keeps its link."""
    fleet = ctx.fleet
    args = role_args("agent", fleet.tokens, router=ctx.router, name="device-1")
    args[args.index("--agent-token-file") + 1] = str(fleet.tokens.file("agent"))
    args[args.index("--models") + 2 : args.index("--models") + 2] = ["--variants", "digits-small"]
    twin = await asyncio.to_thread(launch, args, role="twin-device-1", log_dir=fleet.log_dir)
    fleet.extra.append(twin)
    log_from = len(fleet.router.log())
    await asyncio.sleep(ctx.mark() - time.monotonic())
    await asyncio.to_thread(twin.stop)
    replaced = fleet.router.log()[log_from:].count("agent device-1 reconnected from")
    refused = twin.log().count("token of agent 'device-1' is missing or wrong")
    return Outcome(f"twin device-1 with the shared token x {ctx.duration_s:g} s",
                   f"refused {refused} times; device-1's link replaced {replaced} times")  # fmt: skip


async def f2_conflicting_family(ctx: Context) -> Outcome:
    """With the agent token: describe digits unlike the fleet (no tensors, threshold 0, so
    every answer settles at once), beside a family of its own, hold the link and answer no
    Work: a black hole if the router sent it any digits request."""
    forged = fpb.FamilyInfo(name="digits", thresholds={"device": 0.0, "edge": 0.0})
    own = fpb.FamilyInfo(name="rogue-family")
    message = digits_hello("rogue-f2", ctx.fleet.tokens.agent, forged, own)
    message.hello.variants.add(name="rogue-variant", family="rogue-family")
    works, received, outcome = 0, 0, "CLOSED"
    until = ctx.mark()
    async with ctx.channel() as channel:

        async def messages() -> Any:  # the Hello, then heartbeats that say it reads: it stays
            yield message
            while time.monotonic() < until:
                await asyncio.sleep(0.5)
                yield fpb.AgentMessage(heartbeat=fpb.Heartbeat(received=received))

        call = aio(fpb_grpc.AgentLinkStub(channel)).Connect(messages())
        try:
            async with asyncio.timeout(ctx.duration_s + 5):
                async for reply in call:
                    received += 1
                    kind = reply.WhichOneof("kind")
                    outcome = "WELCOMED" if kind == "welcome" else outcome
                    works += kind == "work"
        except grpc.aio.AioRpcError as error:
            outcome = ctx.name(error)
        except TimeoutError:
            call.cancel()
    refused = [u for a in (await fleet_status(ctx)).agents if a.id == "rogue-f2" for u in a.unavailable]
    said = "digits refused" if any("digits" in u for u in refused) else "digits NOT refused"
    return Outcome(f"forged digits + own family, held {ctx.duration_s:g} s",
                   f"{outcome}, {said}, {works} Work sent to it")  # fmt: skip


async def f3_drain_reload(ctx: Context) -> Outcome:
    """Drain, Reload and rollout changes in a loop, anonymously and with the agent and peer
    tokens (credentials that are not the operator's)."""
    tokens = ctx.fleet.tokens
    async with ctx.channel() as channel:
        stub = aio(fpb_grpc.FleetStub(channel))
        calls: list[Callable[[str], Awaitable[Any]]] = [
            lambda t: stub.Drain(fpb.DrainRequest(agent_id="device-1", token=t), timeout=5),
            lambda t: stub.Reload(fpb.ReloadRequest(agent_id="device-2", token=t, timeout_s=1e9), timeout=5),
            lambda t: stub.Drain(fpb.DrainRequest(agent_id="edge-1", token=t), timeout=5),
            lambda t: stub.Rollout(fpb.RolloutRequest(action=fpb.ROLLOUT_ACTION_ABORT, family="digits",
                                                       tier=fpb.TIER_DEVICE, token=t), timeout=5),
        ]  # fmt: skip
        wrong = ["", tokens.agent, tokens.peer]
        sent = 0

        async def one() -> str:
            nonlocal sent
            sent += 1
            return await ctx.code_of(calls[sent % len(calls)](wrong[sent % len(wrong)]))

        tally = await repeat(ctx.mark(), 8, one)
    return Outcome(f"{sum(tally.values())} Drain/Reload/abort, no/agent/peer token",
                   f"{codes(tally)}; {await ready_after(ctx)}")  # fmt: skip


def poisoned_state(revision: int) -> list[str]:
    """Rollout states a peer might push: the plan that made every digits request INTERNAL,
    a 15 MiB history, and 1,000 plans for made-up families."""
    base = {"family": "digits", "tier": "device", "candidate": "digits-small", "min_requests": 1,
            "state": "running", "reason": "x", "revision": revision, "updated": 0.0, "origin": "evil"}  # fmt: skip
    step9 = {**base, "steps": [5.0], "step": 9}
    history = {**base, "steps": [5.0, 100.0], "step": 0, "history": ["h" * 1000] * 15_000}
    many = [{**base, "family": f"made-up-{i}", "steps": [5.0, 100.0], "step": 0} for i in range(1000)]
    return [json.dumps({"version": 1, "rollouts": rollouts}) for rollouts in ([step9], [history], many)]


async def f4_poisoned_sync(ctx: Context) -> Outcome:
    """SyncRollouts of poisoned states, anonymously, with the agent and operator tokens as
    proof, and with a real proof of the peer token (a malicious or hijacked peer): only
    validation stands then."""
    tokens = ctx.fleet.tokens
    states = poisoned_state(revision=10**9)
    async with ctx.channel() as channel:
        stub = aio(fpb_grpc.FleetStub(channel))
        outsiders: Counter[str] = Counter()
        peer: Counter[str] = Counter()
        sent = 0

        async def one() -> str:
            nonlocal sent
            sent += 1
            token = ["", tokens.agent, tokens.operator, tokens.peer][sent % 4]
            message = fpb.RolloutSync(router_id=f"evil-{sent}", state_json=states[sent % 3], token=token)
            if token == tokens.peer:  # a real peer proves the token over the message (HMAC)
                message.token = sync_proof(token, *sync_parts(message))
            code = await ctx.code_of(stub.SyncRollouts(message, timeout=10))
            (peer if token == tokens.peer else outsiders)[code] += 1
            return code

        await repeat(ctx.mark(), 4, one)
        plans = await stub.Rollout(fpb.RolloutRequest(action=fpb.ROLLOUT_ACTION_STATUS), timeout=10)
    digits = [p for p in plans.rollouts if p.family == "digits"]
    return Outcome(f"{sent} syncs: step 9/15 MiB history/1000 plans",
                   f"others {codes(outsiders)}; peer {codes(peer)}; "
                   f"{len(plans.rollouts)} plans kept, {len(digits)} for digits")  # fmt: skip


async def f5_many_inputs(ctx: Context) -> Outcome:
    """As many empty inputs as fit under the 16 MiB limit (each [0], about 18 bytes), four
    requests at once, again and again: the parse alone is all the router should pay."""
    request = pb.ModelInferRequest(model_name="digits")
    one = pb.ModelInferRequest(
        inputs=[pb.ModelInferRequest.InferInputTensor(name="x0000000", datatype="FP32", shape=[0])]
    )
    count = (MAX_MESSAGE_BYTES - 64 * 1024) // one.ByteSize()
    for index in range(count):
        request.inputs.add(name=f"x{index:07d}", datatype="FP32", shape=[0])
    payload = request.SerializeToString()
    async with ctx.channel() as channel:
        infer = raw_infer(channel)
        tally = await repeat(ctx.mark(), 4, lambda: ctx.code_of(infer(payload, timeout=60)))
    return Outcome(f"{count:,} inputs ({len(payload) / 2**20:.1f} MiB) x 4 at once", codes(tally))


async def f6_int64_contents(ctx: Context) -> Outcome:
    """Typed INT64 zeros, one byte each on the wire and eight once parsed, 15 MiB a request,
    four at once, again and again."""
    values = 15 * 2**20 // 64 * 64
    request = pb.ModelInferRequest(model_name="digits")
    tensor = request.inputs.add(name="input", datatype="INT64", shape=[values // 64, 64])
    tensor.contents.int64_contents.extend(np.zeros(values, np.int64).tolist())
    payload = request.SerializeToString()
    del request, tensor
    async with ctx.channel() as channel:
        infer = raw_infer(channel)
        tally = await repeat(ctx.mark(), 4, lambda: ctx.code_of(infer(payload, timeout=60)))
    return Outcome(f"{values / 1e6:.1f} M INT64 ({len(payload) / 2**20:.1f} MiB) x 4 at once", codes(tally))


def prompt_request(text: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="arith")
    request.inputs.add(name=TEXT_INPUT, datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
    set_parameter(request.parameters, MAX_TOKENS, 4)
    return request


def padded_to(request: pb.ModelInferRequest, size: int) -> pb.ModelInferRequest:
    """``request`` with a parameter that is not Stratus's, bringing it to ``size`` bytes."""
    set_parameter(request.parameters, "padding", "")
    for _ in range(3):  # the length prefixes grow with the padding
        padding = request.parameters["padding"].string_param
        set_parameter(request.parameters, "padding", "x" * (len(padding) + size - request.ByteSize()))
    return request


async def serves(ctx: Context, model: str) -> bool:
    async with ctx.channel() as channel:
        try:
            ready = await aio(pb_grpc.GRPCInferenceServiceStub(channel)).ModelReady(
                pb.ModelReadyRequest(name=model), timeout=5
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(ready.ready)


async def f7_huge_prompt(ctx: Context) -> Outcome | None:
    """A prompt just under 16 MiB, and a tiny prompt padded with parameters to 8 bytes under
    16 MiB (its Work once went over the link limit and ended every agent's link in turn)."""
    if not await serves(ctx, "arith"):
        return None
    huge = prompt_request(b"1+" * ((MAX_MESSAGE_BYTES - 4096) // 2)).SerializeToString()
    padded = padded_to(prompt_request(b"37+48="), MAX_MESSAGE_BYTES - 8).SerializeToString()
    log_from = len(ctx.fleet.router.log())
    async with ctx.channel() as channel:
        infer = raw_infer(channel)
        sent = 0

        async def one() -> str:
            nonlocal sent
            sent += 1
            return await ctx.code_of(infer(huge if sent % 2 else padded, timeout=60))

        tally = await repeat(ctx.mark(), 2, one)
    lost = ctx.fleet.router.log()[log_from:].count(" lost: ")
    return Outcome("16 MiB prompt / padded prompt, 2 at once", f"{codes(tally)}; {lost} links lost")


async def f11_unread_streams(ctx: Context) -> Outcome:
    """ModelStreamInfer on four connections, 4,096 items a request, written as fast as the
    server takes them and never read; the streams are dropped at the end."""
    request = pb.ModelInferRequest(model_name="digits")
    codec.encode_request_inputs(request, {"input": np.zeros((4096, 64), np.float32)})
    written = 0
    until = ctx.mark()

    async def stream() -> None:
        nonlocal written
        async with ctx.channel(options=[("grpc.http2.bdp_probe", 0)]) as channel:
            call = aio(pb_grpc.GRPCInferenceServiceStub(channel)).ModelStreamInfer()
            with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
                while time.monotonic() < until:
                    await asyncio.wait_for(call.write(request), timeout=max(0.01, until - time.monotonic()))
                    written += 1
            call.cancel()

    await asyncio.gather(*(stream() for _ in range(4)))
    return Outcome(
        "4 streams x 4,096 items, never read", f"{written} requests taken (window {STREAM_WINDOW} each)"
    )


async def f12_hello_flood(ctx: Context) -> Outcome:
    """With the agent token: Hellos with new 128-character ids, each with the most variants a Hello may have and 64
    families of 128-character names, joining and leaving as fast as admission lets them."""

    def hello(index: int) -> fpb.AgentMessage:
        message = fpb.AgentMessage(hello=fpb.Hello(agent_id=f"flood-{index:08d}".ljust(128, "x"),
                                                   tier=fpb.TIER_DEVICE, token=ctx.fleet.tokens.agent))  # fmt: skip
        families = [f"fam-{index:08d}-{f:02d}".ljust(128, "f") for f in range(64)]
        message.hello.families.extend(fpb.FamilyInfo(name=name) for name in families)
        message.hello.variants.extend(
            fpb.VariantInfo(name=f"var-{index:08d}-{v:03d}".ljust(128, "v"), family=families[v % 64])
            for v in range(MAX_VARIANTS_PER_AGENT)
        )
        return message

    counter = 0
    async with ctx.channel() as channel:
        stub = aio(fpb_grpc.AgentLinkStub(channel))

        async def one() -> str:
            nonlocal counter
            counter += 1
            return await hello_once(ctx, stub, hello(counter))

        tally = await repeat(ctx.mark(), 16, one)
        status = await fleet_status(ctx)
        try:
            unknown = pb.ModelInferRequest(model_name="nope")
            codec.encode_request_inputs(unknown, {"input": np.zeros((1, 64), np.float32)})
            await aio(pb_grpc.GRPCInferenceServiceStub(channel)).ModelInfer(unknown, timeout=5)
            missing = "OK"
        except grpc.aio.AioRpcError as error:
            missing = f"{ctx.name(error)}, {len(error.details() or '')} chars"
    return Outcome(f"{counter} Hellos, 128-char ids, {MAX_VARIANTS_PER_AGENT} variants",
                   f"{codes(tally)}; status lists {len(status.agents)} agents, "
                   f"{status.ByteSize() / 2**20:.1f} MiB; unknown model: {missing}")  # fmt: skip


async def f13_silent_streams(ctx: Context) -> Outcome:
    """AgentLink streams that never say Hello: as many as a connection takes, on four
    connections, held past the router's Hello deadline."""
    per_connection = MAX_STREAMS_PER_CONNECTION
    hold_s = max(ctx.duration_s, HELLO_TIMEOUT_S + 1.5)
    tally: Counter[str] = Counter()
    ctx.mark()

    async def silent(stub: Any) -> None:
        call = stub.Connect()
        try:
            async with asyncio.timeout(hold_s):
                await call.read()
            tally["ended"] += 1
        except grpc.aio.AioRpcError as error:
            tally[ctx.name(error)] += 1
        except TimeoutError:
            tally["still open"] += 1
            call.cancel()

    async def connection() -> None:
        async with ctx.channel() as channel:
            stub = aio(fpb_grpc.AgentLinkStub(channel))
            await asyncio.gather(*(silent(stub) for _ in range(per_connection)))

    await asyncio.gather(*(connection() for _ in range(4)))
    return Outcome(f"4 x {per_connection} silent AgentLinks x {hold_s:g} s", codes(tally))


async def http(session: aiohttp.ClientSession, url: str, body: bytes | None, headers: dict[str, str]) -> str:
    method = session.post if body is not None else session.get
    try:
        async with method(
            url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=30)
        ) as response:
            await response.read()
            return str(response.status)
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def f14_openai(ctx: Context) -> Outcome:
    """The OpenAI API without a key: text/plain (CSRF), a foreign Host (DNS rebinding), a huge
    max_tokens and budget, 1 MiB of '[' and a 2 MiB body, eight at once, again and again."""
    url = f"http://{ctx.fleet.openai}"
    json_type = {"Content-Type": "application/json"}

    def completion(**extra: object) -> bytes:
        return json.dumps({"model": "arith", "prompt": "37+48=", "max_tokens": 4, **extra}).encode()

    budget = completion().replace(
        b'"max_tokens": 4', b'"max_tokens": 4, "stratus": {"budget_ms": 1' + b"0" * 400 + b"}"
    )
    cases: list[tuple[str, bytes | None, dict[str, str]]] = [
        ("/v1/completions", completion(), {"Content-Type": "text/plain"}),
        ("/v1/models", None, {"Host": "attacker.example"}),
        ("/v1/completions", completion(max_tokens=10**6), json_type),
        ("/v1/completions", budget, json_type),
        ("/v1/completions", b"[" * (2**20 - 4096), json_type),
        ("/v1/completions", completion(prompt="1" * 2 * 2**20), json_type),
    ]
    sent = 0
    async with aiohttp.ClientSession() as session:

        async def one() -> str:
            nonlocal sent
            sent += 1
            path, body, headers = cases[sent % len(cases)]
            return await http(session, url + path, body, headers)

        tally = await repeat(ctx.mark(), 8, one)
    errors = sum(n for code, n in tally.items() if code.startswith("5") or not code.isdigit())
    return Outcome(f"{sum(tally.values())} bad calls, 6 kinds, 8 at once",
                   f"{' '.join(f'{c}:{n}' for c, n in sorted(tally.items()))}; 5xx/errors {errors}")  # fmt: skip


async def f15_cloud_direct(ctx: Context) -> Outcome:
    """At the cloud gateway itself: anonymous calls (it now asks for its client token), then,
    as an insider with the token, 32,000 items in one call (the advertised max_batch_size is
    1,024) and 80 concurrent prompts of the largest size it takes."""
    batch = pb.ModelInferRequest(model_name="digits")
    codec.encode_request_inputs(batch, {"input": np.zeros((32_000, 64), np.float32)})
    batch_bytes = batch.SerializeToString()
    prompt = prompt_request(b"1+" * (MAX_PROMPT_BYTES // 2 - 8)).SerializeToString()
    insider = (("authorization", f"Bearer {ctx.fleet.tokens.client}"),)
    async with ctx.channel(ctx.cloud) as channel:
        infer = raw_infer(channel)
        until = ctx.mark()
        anonymous, batches, prompts = await asyncio.gather(
            repeat(until, 2, lambda: ctx.code_of(infer(batch_bytes, timeout=60))),
            repeat(until, 2, lambda: ctx.code_of(infer(batch_bytes, timeout=60, metadata=insider))),
            repeat(until, 80, lambda: ctx.code_of(infer(prompt, timeout=60, metadata=insider))),
        )
    return Outcome("anonymous + insider 32,000-item batches x 2, 80 x 1 MiB prompts",
                   f"anonymous {codes(anonymous)}; batches {codes(batches)}; prompts {codes(prompts)}")  # fmt: skip


async def f16_watchers(ctx: Context) -> Outcome:
    """Watch with include_agents from 80 streams (the router keeps 64) for the whole window,
    over whatever fleet the attacks before left listed."""
    events, received = 0, 0
    tally: Counter[str] = Counter()
    until = ctx.mark()
    async with ctx.channel() as channel:
        stub = aio(fpb_grpc.FleetStub(channel))

        async def watch() -> None:
            nonlocal events, received
            call = stub.Watch(fpb.FleetWatchRequest(include_agents=True))
            try:
                async with asyncio.timeout(max(0.0, until - time.monotonic())):
                    async for event in call:
                        events += 1
                        received += event.ByteSize()
                tally["ended"] += 1
            except grpc.aio.AioRpcError as error:
                tally[ctx.name(error)] += 1
            except TimeoutError:
                tally["held"] += 1
                call.cancel()

        await asyncio.gather(*(watch() for _ in range(80)))
    return Outcome(f"80 watchers x {ctx.duration_s:g} s, include_agents",
                   f"{codes(tally)}; {events} events, {received / 2**20:.1f} MiB")  # fmt: skip


async def f18_huge_shape(ctx: Context) -> Outcome:
    """Shape [0, 2^40, 2^40] at the router and at the cloud, eight at once, again and again."""
    request = pb.ModelInferRequest(model_name="digits")
    request.inputs.add(name="input", datatype="FP32", shape=[0, 2**40, 2**40])
    payload = request.SerializeToString()
    async with ctx.channel() as router, ctx.channel(ctx.cloud) as cloud:
        at_router, at_cloud = raw_infer(router), raw_infer(cloud)
        sent = 0

        async def one() -> str:
            nonlocal sent
            sent += 1
            return await ctx.code_of((at_router if sent % 2 else at_cloud)(payload, timeout=10))

        tally = await repeat(ctx.mark(), 8, one)
    return Outcome("[0, 2^40, 2^40] to router and cloud, 8 at once", codes(tally))


async def f21_huge_budget(ctx: Context) -> Outcome:
    """A budget of 10^12 ms; then the longest budget taken (600 s) on 4,000 requests at once
    (nearly the router's whole max_requests of 4,096, on four connections under the stream
    cap) of 256 items each, re-sent as each is answered and cut off at the window's end."""

    def request(budget_ms: float, items: int) -> bytes:
        message = pb.ModelInferRequest(model_name="digits")
        codec.encode_request_inputs(message, {"input": np.zeros((items, 64), np.float32)})
        set_parameter(message.parameters, "stratus.budget_ms", budget_ms)
        return message.SerializeToString()

    huge, long = request(1e12, 1), request(MAX_BUDGET_MS, 256)
    per_connection = MAX_STREAMS_PER_CONNECTION - 24  # under the stream cap: none refused by it
    async with contextlib.AsyncExitStack() as stack:
        channels = [await stack.enter_async_context(ctx.channel()) for _ in range(5)]
        until = ctx.mark()

        def holder(channel: grpc.aio.Channel) -> Callable[[], Awaitable[str]]:
            infer = raw_infer(channel)
            return lambda: ctx.code_of(infer(long, timeout=max(0.1, until - time.monotonic())))

        refused, *held = await asyncio.gather(
            repeat(until, 2, lambda: ctx.code_of(raw_infer(channels[0])(huge, timeout=10))),
            *(repeat(until, per_connection, holder(channel)) for channel in channels[1:]),
        )
    held_codes = sum(held, start=Counter[str]())
    return Outcome(f"budget 1e12; 4 x {per_connection} x 600 s-budget x 256 items",
                   f"1e12 {codes(refused)}; 600 s {codes(held_codes)}")  # fmt: skip


@dataclass(frozen=True)
class Attack:
    key: str
    name: str
    run: Callable[[Context], Awaitable[Outcome | None]]


# The order they run in: F12 leaves its agents listed as lost (kept for status, by design), so
# it runs late; F16 runs on the plain fleet and again over what F12 left, as an attacker would.
ATTACKS: tuple[Attack, ...] = (
    Attack("base", "baseline", baseline),
    Attack("F1", "rogue Hello", f1_rogue_hello),
    Attack("F1b", "stolen-token takeover", f1_stolen_token_takeover),
    Attack("F2", "conflicting family", f2_conflicting_family),
    Attack("F3", "Drain/Reload loop", f3_drain_reload),
    Attack("F4", "poisoned SyncRollouts", f4_poisoned_sync),
    Attack("F5", "thousands of inputs", f5_many_inputs),
    Attack("F6", "INT64 contents", f6_int64_contents),
    Attack("F7", "16 MiB prompt", f7_huge_prompt),
    Attack("F11", "unread stream", f11_unread_streams),
    Attack("F13", "silent AgentLinks", f13_silent_streams),
    Attack("F14", "OpenAI API", f14_openai),
    Attack("F15", "cloud direct", f15_cloud_direct),
    Attack("F18", "huge empty shape", f18_huge_shape),
    Attack("F21", "huge budget", f21_huge_budget),
    Attack("F16", "Watch flood", f16_watchers),
    Attack("F12", "Hello flood", f12_hello_flood),
    Attack("F16", "Watch flood after F12", f16_watchers),
)


# ---------------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True)
class Row:
    attack: Attack
    outcome: Outcome
    report: WindowReport
    seconds: float
    seen: dict[str, str]

    @property
    def passed(self) -> bool:
        return (
            self.report.failed <= MAX_FAILED
            and self.report.worst_live_ms < MAX_LIVE_MS
            and self.report.growth("router") < MAX_RSS_MB
        )


WIDTHS = (28, 48, 70, 12, 7, 14, 5)
HEADERS = (
    "attack",
    "what it did",
    "the attack's own outcome",
    "legit s/fail",
    "live ms",
    "RSS pk/end",
    "goals",
)


def print_header(duration_s: float) -> None:
    print(f"goals per window: legit failed <= {MAX_FAILED}, worst ServerLive < {MAX_LIVE_MS:g} ms, "
          f"router RSS growth < {MAX_RSS_MB:g} MB (peak in window minus start)")  # fmt: skip
    print(f"legit load {LEGIT_RATE:g} req/s digits through the router; ServerLive probed every "
          f"{PROBE_EVERY_S * 1000:g} ms; attack windows {duration_s:g} s + {TAIL_S:g} s tail")  # fmt: skip
    print(" ".join(h.ljust(w) for h, w in zip(HEADERS, WIDTHS, strict=True)))
    print(" ".join("-" * w for w in WIDTHS))


def print_row(row: Row) -> None:
    report = row.report
    cells = (
        f"{row.attack.name} ({row.attack.key})",
        row.outcome.did,
        row.outcome.result,
        f"{report.sent}/{report.failed}",
        f"{report.worst_live_ms:.0f}",
        f"{report.growth('router'):+.0f}/{report.rss_end_mb.get('router', 0) - report.rss_start_mb.get('router', 0):+.0f} MB",
        "PASS" if row.passed else "FAIL",
    )
    print(" ".join(c.ljust(w) for c, w in zip(cells, WIDTHS, strict=True)), flush=True)
    if report.failures:
        print(f"{'':>29}legit failures: {', '.join(f'{k} {v}' for k, v in report.failures.items())}")
        for code, details in report.failure_details.items():
            print(f"{'':>31}{code}: {details[:108]}")
    for code, details in row.seen.items():
        print(f"{'':>29}{code}: {details[:110]}")
    cloud = report.growth("cloud")
    if cloud >= MAX_RSS_MB:
        print(f"{'':>29}cloud RSS +{cloud:.0f} MB (peak)")


async def run_one(attack: Attack, ctx: Context, legit: LegitSide) -> Row | None:
    ctx.window_start = 0.0
    ctx.seen.clear()
    started = time.monotonic()
    try:
        outcome = await asyncio.wait_for(attack.run(ctx), timeout=ctx.duration_s + 120)
    except Exception as exc:  # a benchmark reports what an attack could not do, and goes on
        outcome = Outcome("(the attack itself failed)", f"{type(exc).__name__}: {str(exc)[:60]}")
    if outcome is None:
        print(f"{attack.name} ({attack.key}): skipped, the fleet serves no generative family (arith)")
        return None
    ended = time.monotonic()
    await asyncio.sleep(TAIL_S)
    report = await asyncio.to_thread(legit.report, ctx.window_start or started, ended + TAIL_S)
    return Row(attack=attack, outcome=outcome, report=report, seconds=ended - started, seen=dict(ctx.seen))


async def settle(ctx: Context) -> None:
    """Wait until the fleet is whole again, so that the next attack starts from the same place."""
    with contextlib.suppress(Exception):
        await asyncio.to_thread(wait_for_agents, ctx.router, len(AGENTS), 30.0)
    await asyncio.sleep(0.5)


async def run_all(attacks: Iterable[Attack], ctx: Context, legit: LegitSide) -> list[Row]:
    rows = []
    for attack in attacks:
        row = await run_one(attack, ctx, legit)
        if row is not None:
            print_row(row)
            rows.append(row)
        await settle(ctx)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated attack keys, e.g. F5,F6 (default: all)")
    parser.add_argument("--duration-s", type=float, default=5.0, help="each attack's window (default 5)")
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="keep the fleet's logs here (default: dropped)"
    )
    args = parser.parse_args()
    wanted = {k.strip().upper() for k in args.only.split(",") if k.strip()}
    attacks = [a for a in ATTACKS if not wanted or a.key.upper() in wanted or a.key == "base"]
    with tempfile.TemporaryDirectory(prefix="stratus-abuse-") as folder:
        tokens = Tokens.write(Path(folder))
        try:
            fleet = start_fleet(args.log_dir or Path(folder) / "logs", tokens)
        except Exception as exc:
            print(f"abuse: the fleet did not start: {exc}", file=sys.stderr)
            return 1
        legit = LegitSide(
            fleet.router.address, {"router": fleet.router.process.pid, "cloud": fleet.cloud.process.pid}
        )
        try:
            time.sleep(2.0)  # the legitimate side warms its channel and the fleet's curves
            print_header(args.duration_s)
            rows = asyncio.run(run_all(attacks, Context(fleet=fleet, duration_s=args.duration_s), legit))
        finally:
            legit.stop()
            fleet.stop()
    attacked = [r for r in rows if r.attack.key != "base"]
    print(f"\n{sum(r.passed for r in attacked)} of {len(attacked)} attacks within goals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
