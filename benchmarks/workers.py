"""A router on every core (issue 37 §2): req/s of ``stratus router --workers N`` for each N.

Each router serves ``digits-large.onnx`` (FP32, ONNX Runtime) in its own process
(``--local-tier edge``, as benchmarks/peers.py's one-hop row): one hop per answer. The routers
for every N run at once; the measurements are interleaved (a round of each N, then the next
round), so a noisy moment of this machine falls on all of them alike.

The client must not be what is measured: a Python gRPC client spends about what a worker
spends per call, and on a 2-core machine it takes the core a second worker would use. So the
load comes from ``h2load`` (nghttp2's HTTP/2 load generator, C: ``apt-get install
nghttp2-client``) posting one held-out digit's gRPC frame over ``--connections`` connections
(a connection is served by one worker: the kernel spreads connections, not calls), ``--in-flight``
requests in flight in all; without h2load, ``--client python`` (processes of ``grpc.aio``).
h2load reads HTTP statuses only, so every worker's ModelStatistics (at its own address) is read
after the run: a failed gRPC call is counted, and the row says so. The routers' connection age
is raised for the run (h2load does not reconnect after the GOAWAY a router sends at that age).

    python benchmarks/workers.py [--workers 1,2] [--seconds 5] [--rounds 3] [--in-flight 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from peers import MODELS, local_flags, requests  # noqa: E402

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.devtools.launcher import launch  # noqa: E402
from stratus.process import new_event_loop  # noqa: E402
from stratus.serving.channels import grpc_options  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402
from stratus.wire import inference_pb2_grpc as pb_grpc  # noqa: E402

METHOD = "/inference.GRPCInferenceService/ModelInfer"


@dataclass
class Router:
    address: str  # the shared port
    workers: list[str]  # each worker's own address


@dataclass
class Tally:
    answered: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)  # the python client's
    mean_ms: list[float] = field(default_factory=list)  # h2load's, per run


@contextlib.contextmanager
def router(workers: int, log_dir: Path) -> Iterator[Router]:
    launched = launch(
        ["router", "--listen", "127.0.0.1:0", "--no-advertise", "--models", str(MODELS), "--local-tier", "edge",
         *local_flags(), "--workers", str(workers), "--log-level", "INFO"],
        role=f"router-{workers}-workers", log_dir=log_dir, env={"STRATUS_ROUTER_CONNECTION_AGE_S": "3600"},
    )  # fmt: skip
    try:
        wait_for_agents(launched.address, 1)
        found = re.search(r"with \d+ workers: (.*)", launched.log_path.read_text())
        yield Router(launched.address, found.group(1).split(", ") if found else [launched.address])
    finally:
        launched.stop()


def counts(target: Router) -> tuple[int, int]:
    """Requests every worker answered and failed, from its ModelStatistics."""
    succeeded = failed = 0
    for address in target.workers:
        with grpc.insecure_channel(address) as channel:
            stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                pb.ModelStatisticsRequest(name="digits")
            )
        for model in stats.model_stats:
            succeeded += model.inference_stats.success.count
            failed += model.inference_stats.fail.count
    return succeeded, failed


def h2load(
    target: Router, body: Path, *, connections: int, in_flight: int, seconds: float, tally: Tally
) -> None:
    streams = max(1, in_flight // connections)
    run = subprocess.run(
        ["h2load", "-D", f"{seconds:g}", "--warm-up-time", "1", "-c", str(connections), "-m", str(streams),
         "-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers",
         f"http://{target.address}{METHOD}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    succeeded = int(re.search(r"(\d+) succeeded", run.stdout).group(1))  # type: ignore[union-attr]
    tally.answered += succeeded
    tally.seconds += seconds
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", run.stdout).group(1)  # type: ignore[union-attr]
    tally.mean_ms.append(
        float(mean.removesuffix("ms")) if mean.endswith("ms") else float(mean.removesuffix("us")) / 1000
    )


async def _drive(address: str, channels: int, in_flight: int, seconds: float) -> list[float]:
    """``in_flight`` callers over ``channels`` connections for ``seconds``: their latencies."""
    made = requests(digits_splits().held_out.x, "digits")
    options = [*grpc_options(), ("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
    opened = [grpc.aio.insecure_channel(address, options=options) for _ in range(channels)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(channel) for channel in opened]
    latencies: list[float] = []
    for stub in stubs:  # connect and warm each
        for request in made[:20]:
            await stub.ModelInfer(request, timeout=30)
    end = time.perf_counter() + seconds

    async def caller(index: int) -> None:
        stub, item = stubs[index % channels], index
        while time.perf_counter() < end:
            started = time.perf_counter()
            await stub.ModelInfer(made[item % len(made)], timeout=30)
            latencies.append((time.perf_counter() - started) * 1000.0)
            item += in_flight

    await asyncio.gather(*(caller(i) for i in range(in_flight)))
    for channel in opened:
        await channel.close()
    return latencies


def _client(address: str, channels: int, in_flight: int, seconds: float, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    loop = new_event_loop()
    try:
        out.put(loop.run_until_complete(_drive(address, channels, in_flight, seconds)))
    finally:
        loop.close()


def python_clients(
    target: Router, *, clients: int, connections: int, in_flight: int, seconds: float, tally: Tally
) -> None:
    out: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    share = [in_flight // clients + (1 if i < in_flight % clients else 0) for i in range(clients)]
    channels = max(1, connections // clients)
    processes = [
        multiprocessing.Process(target=_client, args=(target.address, channels, n, seconds, out))
        for n in share
        if n
    ]
    for process in processes:
        process.start()
    for _ in processes:
        seen = out.get(timeout=seconds + 120)
        tally.answered += len(seen)
        tally.latencies_ms += seen
    for process in processes:
        process.join()
    tally.seconds += seconds


def grpc_frame(folder: Path) -> Path:
    """One held-out digit's request as h2load posts it: gRPC's 5-byte prefix, then the message."""
    message = requests(digits_splits().held_out.x[:1], "digits")[0].SerializeToString()
    body = folder / "request.grpc"
    body.write_bytes(b"\0" + struct.pack(">I", len(message)) + message)
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument(
        "--client", choices=["h2load", "python"], default="h2load" if shutil.which("h2load") else "python"
    )
    parser.add_argument("--clients", type=int, default=2, help="--client python: its processes")
    args = parser.parse_args()
    worker_counts = [int(n) for n in args.workers.split(",")]
    tallies = {n: Tally() for n in worker_counts}
    with tempfile.TemporaryDirectory(prefix="stratus-workers-") as tmp, contextlib.ExitStack() as stack:
        body = grpc_frame(Path(tmp))
        routers = {n: stack.enter_context(router(n, Path(tmp))) for n in worker_counts}
        for round_ in range(args.rounds):
            for n in worker_counts:
                load = dict(
                    connections=args.connections,
                    in_flight=args.in_flight,
                    seconds=args.seconds,
                    tally=tallies[n],
                )
                if args.client == "h2load":
                    h2load(routers[n], body, **load)  # type: ignore[arg-type]
                else:
                    python_clients(routers[n], clients=args.clients, **load)  # type: ignore[arg-type]
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)
        failed = {n: counts(routers[n])[1] for n in worker_counts}
    print_table(tallies, failed, args)


def print_table(tallies: dict[int, Tally], failed: dict[int, int], args: argparse.Namespace) -> None:
    print(
        f"\ndigits-large.onnx (FP32, ONNX Runtime) in the router's process; {args.client} client, {args.in_flight} "
        f"in flight over {args.connections} connections; {args.rounds} rounds of {args.seconds:g} s, interleaved"
    )
    print(f"{'workers':>8}{'req/s':>9}{'x first':>9}{'latency ms':>22}{'failed':>8}")
    base = tallies[min(tallies)].answered / tallies[min(tallies)].seconds
    for n, tally in tallies.items():
        rate = tally.answered / tally.seconds
        if tally.latencies_ms:
            p50, p99 = np.percentile(tally.latencies_ms, [50, 99])
            latency = f"p50 {p50:.2f}, p99 {p99:.2f}"
        else:
            latency = f"mean {np.mean(tally.mean_ms):.2f}"
        print(f"{n:>8}{rate:>9.0f}{rate / base:>9.2f}{latency:>22}{failed[n]:>8}")


if __name__ == "__main__":
    main()
