"""The attacks through the inference front doors: requests of thousands of inputs, INT64 contents,
a prompt the size of a message, huge empty shapes and budgets, unread streams, the OpenAI API and the cloud
gateway called directly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import grpc
import numpy as np
from abuse_fleet import aio
from abuse_kit import (
    Context,
    Outcome,
    codes,
    hold_silent,
    http,
    padded_to,
    prompt_request,
    raw_infer,
    repeat,
    serves,
)

from stratus.convert import codec
from stratus.convert.inference import MAX_PROMPT_BYTES
from stratus.convert.parameters import MAX_BUDGET_MS, set_parameter
from stratus.serving.channels import MAX_MESSAGE_BYTES, MAX_STREAMS_PER_CONNECTION
from stratus.serving.client_limits import SILENT_STREAM_S
from stratus.serving.stream import STREAM_WINDOW
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc


async def f5_many_inputs(ctx: Context) -> Outcome:
    """As many empty inputs as fit under the message limit (each [0], about 18 bytes), four
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
    """Typed INT64 zeros, one byte each on the wire and eight once parsed, as many as the
    message limit lets one request carry, four at once, again and again."""
    values = (MAX_MESSAGE_BYTES - 64 * 1024) // 64 * 64
    request = pb.ModelInferRequest(model_name="digits")
    tensor = request.inputs.add(name="input", datatype="INT64", shape=[values // 64, 64])
    tensor.contents.int64_contents.extend(np.zeros(values, np.int64).tolist())
    payload = request.SerializeToString()
    del request, tensor
    async with ctx.channel() as channel:
        infer = raw_infer(channel)
        tally = await repeat(ctx.mark(), 4, lambda: ctx.code_of(infer(payload, timeout=60)))
    return Outcome(f"{values / 1e6:.1f} M INT64 ({len(payload) / 2**20:.1f} MiB) x 4 at once", codes(tally))


async def f7_huge_prompt(ctx: Context) -> Outcome | None:
    """A prompt just under the message limit, and a tiny prompt padded with parameters to 8 bytes under
    it (its Work once went over the link limit and ended every agent's link in turn)."""
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
    return Outcome(f"{len(huge) / 2**20:.1f} MiB prompt / padded prompt, 2 at once", f"{codes(tally)}; {lost} links lost")


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
    # No send limit of its own: a client's gRPC refuses to send over 4 MiB, and the attack
    # would be a loop on the attacker's own core, not the 8 MiB messages the cloud must refuse.
    async with ctx.channel(ctx.cloud, options=[("grpc.max_send_message_length", -1)]) as channel:
        infer = raw_infer(channel)
        until = ctx.mark()
        anonymous, batches, prompts = await asyncio.gather(
            repeat(until, 2, lambda: ctx.code_of(infer(batch_bytes, timeout=60))),
            repeat(until, 2, lambda: ctx.code_of(infer(batch_bytes, timeout=60, metadata=insider))),
            repeat(until, 80, lambda: ctx.code_of(infer(prompt, timeout=60, metadata=insider))),
        )
    return Outcome("anonymous + insider 32,000-item batches x 2, 80 x 1 MiB prompts",
                   f"anonymous {codes(anonymous)}; batches {codes(batches)}; prompts {codes(prompts)}")  # fmt: skip


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


async def n1_silent_inference_streams(ctx: Context) -> Outcome:
    """security2 N1 at full strength: 20 connections x 1,000 ModelStreamInfer streams that never
    send a request (once enough to take all 16,384 of the router's RPC slots), held past the
    silent-stream deadline."""
    connections, per_connection = 20, 1000
    hold_s = max(ctx.duration_s, SILENT_STREAM_S + 6.0)  # the deadline runs from when the server takes each
    never = asyncio.Event()
    ctx.mark()

    async def nothing() -> AsyncIterator[pb.ModelInferRequest]:
        await never.wait()
        for request in ():  # ends without a request once the attack is over
            yield request

    tally = await hold_silent(
        ctx, lambda channel: aio(pb_grpc.GRPCInferenceServiceStub(channel)).ModelStreamInfer(nothing()),
        connections=connections, per_connection=per_connection, hold_s=hold_s,
    )  # fmt: skip
    never.set()
    return Outcome(f"{connections} x {per_connection} silent ModelStreamInfer x {hold_s:g} s", codes(tally))
