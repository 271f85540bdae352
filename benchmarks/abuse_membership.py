"""The attacks on fleet membership and control: rogue and flooding Hellos, a stolen token, a
conflicting family, Drain/Reload loops and Watch floods."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from abuse_fleet import HELLO_TIMEOUT_S, MODELS, aio, role_args
from abuse_kit import (
    Context,
    Outcome,
    codes,
    digits_hello,
    fleet_status,
    hello_once,
    hold_silent,
    ready_after,
    repeat,
)

from stratus.convert import codec
from stratus.convert.hello import MAX_VARIANTS_PER_AGENT
from stratus.devtools.launcher import launch
from stratus.serving.channels import MAX_STREAMS_PER_CONNECTION
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc


async def baseline(ctx: Context) -> Outcome:
    """No attack: what the window's figures are on their own, to read the rows against."""
    await asyncio.sleep(ctx.duration_s)
    return Outcome(f"legit load alone x {ctx.duration_s:g} s", "-")


async def f1_rogue_hello(ctx: Context) -> Outcome:
    """Join without the agent token, with a wrong one, or with another role's: as a new
    agent, and under the ids of the real agents (a takeover)."""
    tokens = ctx.fleet.tokens
    tries = [("rogue", ""), ("device-1", ""), ("device-1", "guess"), ("device-2", tokens.operator),
             ("edge-1", tokens.client)]  # fmt: skip
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


async def hold_link(ctx: Context, message: fpb.AgentMessage) -> tuple[str, int]:
    """An AgentLink held for the window, answering no Work: the Hello, then heartbeats that say
    it reads (so it stays linked). How it ended (WELCOMED, or the refusal's code), and the
    Works the router sent it."""
    works, received, outcome = 0, 0, "CLOSED"
    until = ctx.mark()
    async with ctx.channel() as channel:

        async def messages() -> Any:
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
    return outcome, works


async def f2_conflicting_family(ctx: Context) -> Outcome:
    """With the agent token: describe digits unlike the fleet (no tensors, threshold 0, so
    every answer settles at once), beside a family of its own, hold the link and answer no
    Work: a black hole if the router sent it any digits request."""
    forged = fpb.FamilyInfo(name="digits", thresholds={"device": 0.0, "edge": 0.0})
    own = fpb.FamilyInfo(name="rogue-family")
    message = digits_hello("rogue-f2", ctx.fleet.tokens.agent, forged, own)
    message.hello.variants.add(name="rogue-variant", family="rogue-family")
    outcome, works = await hold_link(ctx, message)
    refused = [u for a in (await fleet_status(ctx)).agents if a.id == "rogue-f2" for u in a.unavailable]
    said = "digits refused" if any("digits" in u for u in refused) else "digits NOT refused"
    return Outcome(f"forged digits + own family, held {ctx.duration_s:g} s",
                   f"{outcome}, {said}, {works} Work sent to it")  # fmt: skip


async def n3_black_hole(ctx: Context) -> Outcome:
    """device-2's own token, stolen from its machine: a device-2 declaring capacity 1,024 (the
    most a Hello may) that heartbeats that it reads and answers no Work, held for the window
    while legitimate traffic flows (the real device-2 is replaced, and comes back when it ends):
    every Work it is sent is a request held until its budget runs out."""
    stolen = ctx.fleet.tokens.own_file("device-2").read_text(encoding="ascii").strip()
    message = digits_hello("device-2", stolen)
    outcome, works = await hold_link(ctx, message)
    return Outcome(f"stolen device-2 token, capacity 1,024, no Work answered, {ctx.duration_s:g} s",
                   f"{outcome}, {works} Work sent to it")  # fmt: skip


async def f3_drain_reload(ctx: Context) -> Outcome:
    """Drain, Reload and rollout changes in a loop, anonymously and with the agent and client
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
        wrong = ["", tokens.agent, tokens.client]
        sent = 0

        async def one() -> str:
            nonlocal sent
            sent += 1
            return await ctx.code_of(calls[sent % len(calls)](wrong[sent % len(wrong)]))

        tally = await repeat(ctx.mark(), 8, one)
    return Outcome(f"{sum(tally.values())} Drain/Reload/abort, no/agent/client token",
                   f"{codes(tally)}; {await ready_after(ctx)}")  # fmt: skip


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
    ctx.mark()
    tally = await hold_silent(
        ctx, lambda channel: aio(fpb_grpc.AgentLinkStub(channel)).Connect(),
        connections=4, per_connection=per_connection, hold_s=hold_s,
    )  # fmt: skip
    return Outcome(f"4 x {per_connection} silent AgentLinks x {hold_s:g} s", codes(tally))


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


async def n2_insider_router(ctx: Context) -> Outcome:
    """security2 N2 at full strength: a stolen agent key from the fleet's own CA (device-2's),
    serving as a router; a real device-1 with its own certificate and the fleet's CA is pointed at
    it for the window, as zeroconf or a poisoned --router would point it. Every agent certificate
    once named every host, so the handshake passed and the fake took device-1's Hello and token.
    Leaves now carry their own role's name, and an agent dials a router only by the router's: the
    handshake fails before a byte of Hello is sent."""
    fleet = ctx.fleet
    pki = fleet.log_dir / "n2-pki"
    made = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "stratus.cli", "certs", "--out", str(pki)], capture_output=True
    )
    if made.returncode != 0:
        return Outcome("insider router", f"stratus certs failed: {made.stderr.decode()[-200:]}")

    def tls(stem: str) -> list[str]:
        return ["--tls-cert", str(pki / f"{stem}.pem"), "--tls-key", str(pki / f"{stem}.key"), "--tls-ca", str(pki / "ca.pem")]

    insider = await asyncio.to_thread(
        launch, ["router", "--listen", "127.0.0.1:0", "--no-advertise", *tls("agent-device-2")],
        role="n2-insider-router", log_dir=fleet.log_dir,
    )  # fmt: skip
    fleet.extra.append(insider)
    victim = await asyncio.to_thread(
        launch, ["agent", "--tier", "device", "--models", str(MODELS), "--variants", "digits-small",
                 "--router", insider.address, "--name", "device-1", *tls("agent-device-1")],
        role="n2-victim-device-1", log_dir=fleet.log_dir,
    )  # fmt: skip
    fleet.extra.append(victim)
    await asyncio.sleep(ctx.mark() - time.monotonic())
    await asyncio.to_thread(victim.stop)
    await asyncio.to_thread(insider.stop)
    refused = victim.log().count(f"link to router {insider.address} lost")
    hellos = insider.log().count("device-1")  # a Hello taken: "agent device-1 ..." lines
    return Outcome(f"device-2's key as a router; device-1 pointed at it, {ctx.duration_s:g} s",
                   f"its log names device-1 {hellos} times; device-1's handshake refused it {refused} times")  # fmt: skip
