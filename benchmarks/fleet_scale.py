"""What a router costs as its fleet grows: 10, 1,000 and 2,000 agents, in one run.

For each fleet size N: a real router process, one process simulating N device agents
(``edge_agent.simulate``: each a real Agent with its own connection, answering Work with a
real inference), and one real edge agent process. Once all are ready it measures:

- the router's CPU at idle (share of one core, from /proc, over ``--idle-s``);
- p50 and p99 of requests through the router at 1 in flight (``digits-small``, batch 1,
  so on the simulated agents);
- ``stratus fleet status`` wall time (the whole command, a fresh process), and the Status RPC alone;
- after the router restarts on the same port: seconds until all are ready again, and
  the p50/p99 of the requests a client kept sending meanwhile to the edge agent (answered
  ones), how many were refused while it was not back yet, and ServerReady's p99.

Targets at 1,000 agents: idle CPU <= 5% of a core; p50 <= 1.2x the p50 at 10 agents;
status <= 0.5 s; all ready <= 10 s after a restart.

    python benchmarks/fleet_scale.py [--sizes 10,1000,2000] [--requests 400] [--idle-s 10]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.devtools.launcher import Launched, free_port, launch  # noqa: E402
from stratus.serving.channels import grpc_options  # noqa: E402
from stratus.wire import fleet_pb2 as fpb  # noqa: E402
from stratus.wire import fleet_pb2_grpc as fpb_grpc  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402
from stratus.wire import inference_pb2_grpc as pb_grpc  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Row:
    agents: int
    ready_s: float = 0.0
    idle_cpu: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    status_cli_s: float = 0.0
    status_rpc_s: float = 0.0
    restart_ready_s: float = 0.0
    storm_p50_ms: float = 0.0
    storm_p99_ms: float = 0.0
    storm_refused: int = 0
    storm_ready_p99_ms: float = 0.0
    heartbeat_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def idle_cpu(pid: int, seconds: float) -> float:
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - started)


def request(model: str = "digits") -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model)
    codec.encode_request_inputs(
        message, {"input": np.random.default_rng(0).random((1, 64), dtype=np.float32)}
    )
    return message


def latencies(address: str, count: int) -> list[float]:
    message = request("digits-small")  # the simulated device agents' variant, never escalated
    out = []
    with grpc.insecure_channel(address, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(20):
            stub.ModelInfer(message, timeout=10)
        for _ in range(count):
            started = time.perf_counter()
            stub.ModelInfer(message, timeout=10)
            out.append((time.perf_counter() - started) * 1000.0)
    return out


def status_times(address: str) -> tuple[float, float]:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", "status", "--router", address],
        check=True,
        capture_output=True,
    )
    cli = time.perf_counter() - started
    with grpc.insecure_channel(address, options=grpc_options()) as channel:
        stub = fpb_grpc.FleetStub(channel)
        stub.Status(fpb.FleetStatusRequest(), timeout=5.0)
        rpcs = []
        for _ in range(5):
            started = time.perf_counter()
            stub.Status(fpb.FleetStatusRequest(include_agents=True), timeout=5.0)
            rpcs.append(time.perf_counter() - started)
    return cli, float(np.median(rpcs))


class Storm:
    """A client that keeps asking while the fleet comes back: answered latencies, refusals,
    and the latency of ServerReady, which the router answers itself.

    It asks for ``digits-medium``, which only a real edge agent in its own process serves:
    the simulating process is itself saturated by a thousand agents reconnecting at once,
    which says nothing about the router (real agents each have their own CPU)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.answered: list[float] = []
        self.health: list[float] = []
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-storm-client")

    def __enter__(self) -> Storm:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        message = request("digits-medium")
        with grpc.insecure_channel(self.address, options=grpc_options()) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    stub.ModelInfer(message, timeout=5)
                    self.answered.append((time.perf_counter() - started) * 1000.0)
                except grpc.RpcError:
                    self.refused += 1
                    time.sleep(0.005)
                started = time.perf_counter()
                with contextlib.suppress(grpc.RpcError):
                    stub.ServerReady(pb.ServerReadyRequest(), timeout=5)
                    self.health.append((time.perf_counter() - started) * 1000.0)


def start_router(listen: str, log_dir: Path) -> Launched:
    return launch(
        ["router", "--listen", listen, "--no-advertise", "--log-level", "WARNING"],
        role="router",
        log_dir=log_dir,
    )


def measure(agents: int, args: argparse.Namespace, log_dir: Path) -> Row:
    row = Row(agents=agents)
    listen = f"127.0.0.1:{free_port()}"
    router = start_router(listen, log_dir)
    sim = launch(
        ["--router", listen, "--agents", str(agents), "--models", str(ROOT / "models"), "--ramp-s", "1"],
        role=f"sim-{agents}",
        log_dir=log_dir,
        module="edge_agent.simulate",
    )
    edge = launch(
        [
            "agent",
            "--tier",
            "edge",
            "--models",
            str(ROOT / "models"),
            "--router",
            listen,
            "--name",
            "bench-edge",
        ],
        role=f"edge-{agents}",
        log_dir=log_dir,
    )
    try:
        started = time.monotonic()
        row.heartbeat_s = wait_for_agents(listen, agents + 1, timeout_s=120).heartbeat_interval_s
        row.ready_s = time.monotonic() - started
        time.sleep(args.settle_s)
        row.idle_cpu = idle_cpu(router.process.pid, args.idle_s)
        samples = latencies(listen, args.requests)
        row.p50_ms, row.p99_ms = float(np.percentile(samples, 50)), float(np.percentile(samples, 99))
        row.status_cli_s, row.status_rpc_s = status_times(listen)
        router.stop()
        with Storm(listen) as storm:
            started = time.monotonic()
            router = start_router(listen, log_dir)
            wait_for_agents(listen, agents + 1, timeout_s=60)
            row.restart_ready_s = time.monotonic() - started
        if storm.answered:
            row.storm_p50_ms = float(np.percentile(storm.answered, 50))
            row.storm_p99_ms = float(np.percentile(storm.answered, 99))
        row.storm_refused = storm.refused
        if storm.health:
            row.storm_ready_p99_ms = float(np.percentile(storm.health, 99))
    finally:
        sim.stop(timeout=60)
        edge.stop(timeout=30)
        router.stop(timeout=30)
    return row


def report(rows: list[Row]) -> None:
    print(
        f"{'agents':>7}{'join s':>8}{'hb s':>6}{'idle cpu':>10}{'p50 ms':>9}{'p99 ms':>9}{'p50 x':>7}"
        f"{'status s':>10}{'rpc s':>8}{'restart s':>11}{'storm p50':>11}{'storm p99':>11}{'refused':>9}"
        f"{'ready p99':>11}"
    )
    base = rows[0].p50_ms
    for r in rows:
        print(
            f"{r.agents:>7}{r.ready_s:>8.2f}{r.heartbeat_s:>6.1f}{r.idle_cpu:>9.1%} {r.p50_ms:>9.2f}{r.p99_ms:>9.2f}"
            f"{r.p50_ms / base:>7.2f}{r.status_cli_s:>10.2f}{r.status_rpc_s:>8.3f}{r.restart_ready_s:>11.2f}"
            f"{r.storm_p50_ms:>11.2f}{r.storm_p99_ms:>11.2f}{r.storm_refused:>9}{r.storm_ready_p99_ms:>11.2f}"
        )
    print(
        "\nidle cpu: router process, share of one core; p50 x: against the smallest fleet; status s: the whole"
        "\n`stratus fleet status` command; rpc s: Status with every agent listed; restart s: from starting"
        "\nthe new router until all agents are ready; storm: requests answered meanwhile (ms), those refused,"
        "\nand the p99 of ServerReady (ms), which the router answers without an agent."
        "\ntargets at 1,000 agents: idle cpu <= 5%, p50 x <= 1.2, status <= 0.5 s, restart <= 10 s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1000,2000")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=3.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="stratus-fleet-scale-") as logs:
        for size in (int(s) for s in args.sizes.split(",")):
            rows.append(measure(size, args, Path(logs)))
            print(f"measured {size} agents", file=sys.stderr, flush=True)
    report(rows)


if __name__ == "__main__":
    main()
