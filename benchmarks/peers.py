"""Stratus beside MLServer and NVIDIA Triton on the same model file, the same client, one run.

Every server answers ``models/digits/digits-large.onnx`` in FP32 through ONNX Runtime:

* **MLServer** 1.7.1 and **Triton** (PyTriton 0.7.0, dynamic batching), from the environments
  ``make foreign-env`` builds (scripts/foreign_env.py);
* **Stratus, in-process edge**: a router serving the edge tier in its own process
  (``--local-tier edge --local-variants digits-large --local-runtimes onnxruntime``): one hop;
* **Stratus, remote agent**: a router and an edge agent with the same flags in a process of
  its own: two hops, as every answer took before issue 37;
* **Stratus SDK, in-process**: ``Client.ainfer`` on the same file, no server at all (the floor).

The client is the same for every server: one gRPC channel, ``asyncio`` workers keeping 1 or
16 requests in flight, each request one held-out digit (the request messages built before the
clock starts). The servers run at once; the measurements are interleaved, a round of every
server, then the next round, so a noisy moment of this machine falls on all of them alike.
Per row: p50 and p99 of every round's latencies together, requests per second over every
round, and top-1 accuracy (the same file must give the same accuracy everywhere).

    python benchmarks/peers.py [--requests 1000] [--rounds 3] [--in-flight 1,16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import QUIET, launch_agent  # noqa: E402

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.devtools.launcher import Launched, launch  # noqa: E402
from stratus.serving.channels import grpc_options  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402
from stratus.wire import inference_pb2_grpc as pb_grpc  # noqa: E402

MODELS = ROOT / "models"
MODEL_FILE = MODELS / "digits" / "digits-large.onnx"
# The variant, runtime and precision every Stratus row serves: what the foreign servers run.
SAME_MODEL = ("--variants", "digits-large", "--runtimes", "onnxruntime", "--precision", "fp32")

# One request's answer: the predicted class. Called once per request, on the client's loop.
Ask = Callable[[int], Awaitable[int]]


@dataclass
class Tally:
    """Every round's latencies and seconds for one server at one concurrency."""

    latencies_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    answered: int = 0
    correct: int = 0


@dataclass(frozen=True)
class Stack:
    """One server as the client sees it: how to ask it one request."""

    name: str
    address: str  # gRPC; empty for the SDK (no server)
    model: str  # the model name it is asked for


def local_flags() -> list[str]:
    names = {"--variants": "--local-variants", "--runtimes": "--local-runtimes", "--precision": "--local-precision"}
    return [names.get(flag, flag) for flag in SAME_MODEL]


@contextlib.contextmanager
def stratus_in_process(log_dir: Path, tree: Path | None = None) -> Iterator[Stack]:
    """``tree``: another checkout's code (a commit before) instead of this one's, for A/B runs."""
    router = launch(
        ["router", "--listen", "127.0.0.1:0", "--no-advertise", "--models", str(MODELS),
         "--local-tier", "edge", *local_flags(), *QUIET],
        role=f"router-local{'-' + tree.name if tree else ''}", log_dir=log_dir,
        env={"PYTHONPATH": str(tree)} if tree else None, cwd=tree,
    )  # fmt: skip
    try:
        wait_for_agents(router.address, 1)
        yield Stack(f"Stratus, in-process edge{f' ({tree.name})' if tree else ''}", router.address, "digits")
    finally:
        router.stop()


@contextlib.contextmanager
def stratus_remote(log_dir: Path) -> Iterator[Stack]:
    router = launch(
        ["router", "--listen", "127.0.0.1:0", "--no-advertise", *QUIET], role="router-remote", log_dir=log_dir
    )
    agents: list[Launched] = []
    try:
        agents.append(launch_agent(router.address, "edge-1", log_dir, *SAME_MODEL, tier="edge"))
        wait_for_agents(router.address, 1)
        yield Stack("Stratus, remote agent", router.address, "digits")
    finally:
        for process in [*agents, router]:
            process.stop()


@contextlib.contextmanager
def foreign(kind: str, title: str, log_dir: Path) -> Iterator[Stack]:
    import foreign_env  # scripts/ is on the path (above)

    server = foreign_env.SERVERS[kind]
    foreign_env.ensure(server)
    running = foreign_env.start(server, MODEL_FILE, name="digits-large", log_dir=log_dir)
    try:
        yield Stack(title, running.address, "digits-large")
    finally:
        running.stop()


def requests(x: np.ndarray, model: str) -> list[pb.ModelInferRequest]:
    made = []
    for index in range(len(x)):
        request = pb.ModelInferRequest(model_name=model, id=str(index))
        codec.encode_request_inputs(request, {"input": x[index : index + 1].astype(np.float32)})
        made.append(request)
    return made


async def closed_loop(ask: Ask, count: int, y: np.ndarray, *, in_flight: int, tally: Tally) -> None:
    """Requests 0..count-1 once, ``in_flight`` at a time, into ``tally``."""
    cursor = iter(range(count))

    async def worker() -> None:
        for index in cursor:
            started = time.perf_counter()
            predicted = await ask(index)
            tally.latencies_ms.append((time.perf_counter() - started) * 1000.0)
            tally.answered += 1
            tally.correct += int(predicted == y[index])

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    tally.seconds += time.perf_counter() - began


async def measure_server(stack: Stack, x: np.ndarray, y: np.ndarray, in_flight: int, tally: Tally) -> None:
    made = requests(x, stack.model)
    async with grpc.aio.insecure_channel(stack.address, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def ask(index: int) -> int:
            answer = await stub.ModelInfer(made[index], timeout=30)
            return int(np.frombuffer(answer.raw_output_contents[0], np.float32).argmax())

        await closed_loop(ask, min(20, len(x)), y, in_flight=in_flight, tally=Tally())  # connect, warm
        await closed_loop(ask, len(x), y, in_flight=in_flight, tally=tally)


async def measure_sdk(client: object, x: np.ndarray, y: np.ndarray, in_flight: int, tally: Tally) -> None:
    from edge_agent.sdk import Client

    assert isinstance(client, Client)

    async def ask(index: int) -> int:
        result = await client.ainfer("digits", x[index : index + 1])
        return int(next(iter(result.outputs.values()))[0].argmax())

    await closed_loop(ask, len(x), y, in_flight=in_flight, tally=tally)


def print_table(tallies: dict[tuple[str, int], Tally], *, count: int, rounds: int) -> None:
    print(f"\ndigits-large.onnx (FP32, ONNX Runtime), {count} one-item requests a round, {rounds} rounds interleaved")
    print(f"{'server':<28}{'in flight':>10}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}{'accuracy':>10}")
    for (name, in_flight), t in tallies.items():
        p50, p99 = np.percentile(t.latencies_ms, [50, 99])
        print(
            f"{name:<28}{in_flight:>10}{p50:>9.2f}{p99:>9.2f}{t.answered / t.seconds:>9.0f}"
            f"{t.correct / t.answered:>10.4f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per server per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", default="1,16", help="comma-separated concurrencies")
    parser.add_argument("--skip", default="", help="comma-separated: mlserver,triton,remote,sdk")
    parser.add_argument("--baseline-tree", type=Path, action="append", default=[],
                        help="also a router with the in-process edge from this checkout's code (a worktree "
                             "of the commit before), for A/B runs; repeatable")  # fmt: skip
    args = parser.parse_args()
    concurrencies = [int(n) for n in args.in_flight.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    held_out = digits_splits().held_out
    reps = -(-args.requests // len(held_out.x))
    x, y = np.tile(held_out.x, (reps, 1))[: args.requests], np.tile(held_out.y, reps)[: args.requests]
    tallies: dict[tuple[str, int], Tally] = {}
    with tempfile.TemporaryDirectory(prefix="stratus-peers-") as tmp, contextlib.ExitStack() as stack:
        log_dir = Path(tmp)
        servers = [stack.enter_context(stratus_in_process(log_dir))]
        for tree in args.baseline_tree:
            servers.append(stack.enter_context(stratus_in_process(log_dir, tree.resolve())))
        if "remote" not in skip:
            servers.append(stack.enter_context(stratus_remote(log_dir)))
        if "mlserver" not in skip:
            servers.append(stack.enter_context(foreign("mlserver", "MLServer 1.7.1", log_dir)))
        if "triton" not in skip:
            servers.append(stack.enter_context(foreign("triton", "Triton (PyTriton 0.7.0)", log_dir)))
        client = None
        if "sdk" not in skip:
            from edge_agent.sdk import Client

            client = Client(MODELS, None, variants=["digits-large"], concurrency=max(concurrencies), precision="fp32")
        for round_ in range(args.rounds):
            for in_flight in concurrencies:
                for server in servers:
                    tally = tallies.setdefault((server.name, in_flight), Tally())
                    asyncio.run(measure_server(server, x, y, in_flight, tally))
                if client is not None:
                    tally = tallies.setdefault(("Stratus SDK, in-process", in_flight), Tally())
                    asyncio.run(measure_sdk(client, x, y, in_flight, tally))
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)
        if client is not None:
            client.close()
    ordered = dict(sorted(tallies.items(), key=lambda item: (item[0][1], item[0][0])))
    print_table(ordered, count=args.requests, rounds=args.rounds)


if __name__ == "__main__":
    main()
