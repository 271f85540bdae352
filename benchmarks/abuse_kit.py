"""What every attack of ``benchmarks/abuse.py`` is built from: its context (the fleet, the window,
the first message of each error code), its outcome, and the calls it repeats (raw ModelInfer,
rogue Hellos, fleet status, prompts, HTTP)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from abuse_fleet import AGENTS, INFER, Fleet, aio

from stratus.convert.parameters import set_parameter
from stratus.families.generation import MAX_TOKENS, TEXT_INPUT
from stratus.serving.channels import grpc_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc


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
        return self.fleet.attacker_address

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
        given = list(options)  # they replace the defaults they name: gRPC keeps an argument's first value
        named = {name for name, _ in given}
        defaults = [(name, value) for name, value in grpc_options() if name not in named]
        return grpc.aio.insecure_channel(address or self.router, options=[*given, *defaults])


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


async def hold_silent(
    ctx: Context, open_call: Callable[[grpc.aio.Channel], Any], *, connections: int, per_connection: int, hold_s: float
) -> Counter[str]:
    """Open ``per_connection`` calls that send nothing on each of ``connections`` connections and
    hold them ``hold_s``: how each ended (a status, "ended", or "still open")."""
    tally: Counter[str] = Counter()

    async def silent(channel: grpc.aio.Channel) -> None:
        call = open_call(channel)
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
            await asyncio.gather(*(silent(channel) for _ in range(per_connection)))

    await asyncio.gather(*(connection() for _ in range(connections)))
    return tally
