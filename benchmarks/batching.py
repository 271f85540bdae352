"""What dynamic batching buys: the same load with batching on and with ``--max-batch 1``.

Two setups, each built twice side by side on loopback (batching on, batching off):

(a) through a router to two device agents (``digits-small``, pinned, so nothing escalates);
(b) straight to a cloud gateway (``digits-large``).

From one client process, single-item requests with 1 and then 64 in flight (closed
loop), alternating batching on and off round by round so both see the same machine.
Prints throughput, p50, p99 and the mean batch size (from fleet status for the agents,
from each answer's ``stratus.batch_size`` for the cloud gateway), then the ratios.

Targets: (a) >= 1.5x the throughput at 64 in flight with an equal or lower p99;
(b) >= 2x; at 1 in flight, batching adds <= 0.05 ms to the p50.

The shipped digits models run in microseconds, so with them the processes' per-request
Python and gRPC work is the bottleneck and a busy target (where batches form) is rare;
``--emulate-slow-ms`` adds a fixed cost to every runtime call, as an accelerator's launch
and transfer cost does, which is the case batching is for.

    python benchmarks/batching.py [--seconds 4] [--rounds 3] [--emulate-slow-ms 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import QUIET, Run, drive, launch_agent  # noqa: E402

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.convert.parameters import BATCH_SIZE, parameter_value  # noqa: E402
from stratus.devtools.launcher import Launched, launch  # noqa: E402
from stratus.process import new_event_loop  # noqa: E402
from stratus.serving.channels import grpc_options  # noqa: E402
from stratus.wire import fleet_pb2 as fpb  # noqa: E402
from stratus.wire import fleet_pb2_grpc as fpb_grpc  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402

MODES = ("batching", "max-batch 1")


@dataclass
class Target:
    """One server to drive, and how to read the batch sizes it ran."""

    setup: str
    mode: str
    address: str
    model: str
    router: bool
    sizes: list[float] = field(default_factory=list)

    def record(self, response: pb.ModelInferResponse) -> None:
        if BATCH_SIZE in response.parameters:
            self.sizes.append(float(parameter_value(response.parameters[BATCH_SIZE]) or 0))

    def mean_batch(self) -> float:
        if not self.router:
            return statistics.fmean(self.sizes) if self.sizes else 0.0
        with grpc.insecure_channel(self.address, options=grpc_options()) as channel:
            status = fpb_grpc.FleetStub(channel).Status(
                fpb.FleetStatusRequest(include_agents=True), timeout=5
            )
        return statistics.fmean(a.mean_batch_size for a in status.agents)


def start_router_fleet(mode: str, args: argparse.Namespace, log_dir: Path, processes: list[Launched]) -> str:
    tag = mode.replace(" ", "")
    router = launch(
        ["router", "--listen", "127.0.0.1:0", "--no-advertise", *QUIET], role=f"router-{tag}", log_dir=log_dir
    )
    processes.append(router)
    for index in (1, 2):
        processes.append(launch_agent(router.address, f"{tag}-{index}", log_dir, *agent_flags(mode, args)))
    wait_for_agents(router.address, 2)
    return router.address


def agent_flags(mode: str, args: argparse.Namespace) -> list[str]:
    return ["--concurrency", str(args.concurrency), "--queue-limit", "256", *runtime_flags(mode, args)]


def runtime_flags(mode: str, args: argparse.Namespace) -> list[str]:
    """What agents and the cloud share: the emulated call cost, and batching on or off."""
    flags = ["--emulate-slow-ms", str(args.emulate_slow_ms)] if args.emulate_slow_ms else []
    return flags + (["--max-batch", "1"] if mode != "batching" else [])


def start_cloud(mode: str, args: argparse.Namespace, log_dir: Path, processes: list[Launched]) -> str:
    flags = ["--concurrency", str(args.concurrency), *runtime_flags(mode, args)]
    tag = mode.replace(" ", "")
    cloud = launch(
        [
            "cloud",
            "--listen",
            "127.0.0.1:0",
            "--models",
            str(ROOT / "models"),
            *flags,
            *QUIET,
        ],
        role=f"cloud-{tag}",
        log_dir=log_dir,
    )
    processes.append(cloud)
    return cloud.address


def request_for(model: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    x = np.random.default_rng(0).random((1, 64), dtype=np.float32)
    codec.encode_request_inputs(request, {"input": x})
    return request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating on/off rounds")
    parser.add_argument("--concurrency", type=int, default=2, help="runtime slots per agent and cloud")
    parser.add_argument(
        "--emulate-slow-ms",
        type=float,
        default=0.0,
        help="add this much to every runtime call (a fixed per-call cost, as an accelerator's launch "
        "and transfer have); 0: the shipped models as they run here",
    )
    args = parser.parse_args()
    processes: list[Launched] = []
    results: dict[tuple[str, str, int], list[Run]] = {}
    batches: dict[tuple[str, str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="stratus-batching-") as logs:
        log_dir = Path(logs)
        try:
            targets = []
            for mode in MODES:
                targets.append(
                    Target(
                        "(a) router",
                        mode,
                        start_router_fleet(mode, args, log_dir, processes),
                        "digits-small",
                        True,
                    )
                )
                targets.append(
                    Target(
                        "(b) cloud", mode, start_cloud(mode, args, log_dir, processes), "digits-large", False
                    )
                )
            loop = new_event_loop()
            for _ in range(args.rounds):
                for in_flight in (1, 64):
                    for target in targets:
                        target.sizes.clear()
                        run = loop.run_until_complete(
                            drive(
                                target.address,
                                in_flight=in_flight,
                                seconds=args.seconds,
                                request=request_for(target.model),
                                on_response=target.record,
                            )
                        )
                        key = (target.setup, target.mode, in_flight)
                        results.setdefault(key, []).append(run)
                        # one request at a time cannot merge, and the agents' recent-batch
                        # window still holds the previous round's: not measured there
                        measured = target.mean_batch() if in_flight > 1 or not target.router else float("nan")
                        batches.setdefault(key, []).append(measured)
            loop.close()
        finally:
            for process in reversed(processes):
                process.stop()
    print(
        f"each runtime call: the shipped model{f' + {args.emulate_slow_ms:g} ms' if args.emulate_slow_ms else ''}; "
        f"{args.concurrency} slots per agent and cloud\n"
    )
    report(results, batches)


def _batch(values: list[float]) -> str:
    known = [v for v in values if not math.isnan(v)]
    return f"{statistics.median(known):.1f}" if known else "-"


def report(
    results: dict[tuple[str, str, int], list[Run]], batches: dict[tuple[str, str, int], list[float]]
) -> None:
    summary: dict[tuple[str, str, int], tuple[float, float, float]] = {}
    print(f"{'setup':<12}{'mode':<13}{'in flight':>9}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'batch':>7}")
    for key in sorted(results):
        runs = results[key]
        latencies = [ms for r in runs for ms in r.latencies_ms]
        summary[key] = (
            statistics.median(r.throughput for r in runs),
            float(np.percentile(latencies, 50)),
            float(np.percentile(latencies, 99)),
        )
        setup, mode, in_flight = key
        req_s, p50, p99 = summary[key]
        print(
            f"{setup:<12}{mode:<13}{in_flight:>9}{req_s:>9.0f}{p50:>9.3f}{p99:>9.3f}{_batch(batches[key]):>7}"
        )
    print()
    print(f"{'setup':<12}{'req/s on/off @64':>17}{'p99 on/off @64':>16}{'p50 added @1 (ms)':>19}")
    for setup in sorted({k[0] for k in results}):
        on64, off64 = summary[(setup, MODES[0], 64)], summary[(setup, MODES[1], 64)]
        on1, off1 = summary[(setup, MODES[0], 1)], summary[(setup, MODES[1], 1)]
        print(f"{setup:<12}{on64[0] / off64[0]:>17.2f}{on64[2] / off64[2]:>16.2f}{on1[1] - off1[1]:>19.3f}")
    print(
        "\ntargets: (a) req/s >= 1.5x with p99 ratio <= 1.0; (b) req/s >= 2x; p50 added at 1 in flight <= 0.05 ms"
    )


if __name__ == "__main__":
    main()
