"""How big to make a router and an agent: CPU and memory per 1,000 agents, per 1,000 req/s,
and an agent's memory per model, measured in one run on this machine.

- fleet: a router process with N device agents simulated in one other process
  (``edge_agent.simulate``: real links, heartbeats at the pace the router sets, keepalive pings)
  for each N of ``--agents``; once all are ready and settled, the router's resident memory and
  its CPU over ``--idle-s`` (no requests).
- rate: a router with two real device agents, under open-loop load at each rate of ``--rates``
  (``digits``, one item, answered on the device: the router's own work per request, without
  escalations) for ``--seconds`` each: the router's CPU over the window, its memory after it, and
  how many requests were answered.
- models: one agent per variant of ``--variants`` (``VARIANT@TIER``), loading only that variant,
  each warmed with ``--warm`` requests to its ``--serve`` endpoint: its resident memory; and an
  agent of each tier as it starts by default (``*@TIER``: every family), warmed on each family.

Per 1,000 agents and per 1,000 req/s: each row's CPU and memory over the first row's (the
smallest fleet; the router idle with its two agents), per 1,000 agents or answered req/s, as a
range over the rows, and the least-squares slope through them all. CPU is the share of one core, from
/proc/PID/stat; memory is VmRSS. The load generator, the agents and the router share this
machine's cores, so a busy machine shows in the answered column and in the spread of the rows.

    python benchmarks/sizing.py [--agents 10,500,1000] [--rates 100,300,600] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fleet_scale import cpu_seconds, idle_cpu, start_router  # noqa: E402
from loadgen import MODELS, OpenLoop, launch_agent, make_requests, rss_mb  # noqa: E402

from stratus import datatypes  # noqa: E402
from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.convert.parameters import set_parameter  # noqa: E402
from stratus.devtools.launcher import free_port, launch  # noqa: E402
from stratus.families.generation import TEXT_INPUT  # noqa: E402
from stratus.families.repository import ModelRepository  # noqa: E402
from stratus.process import new_event_loop  # noqa: E402
from stratus.serving.channels import grpc_options  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402
from stratus.wire import inference_pb2_grpc as pb_grpc  # noqa: E402

# "*@TIER": an agent of that tier as it starts by default, serving every family's variant.
DEFAULT_VARIANTS = (
    "digits-small@device,defects-small@device,arith-small@device,*@device,"
    "digits-medium@edge,defects-medium@edge,arith-medium@edge,*@edge"
)


@dataclass(frozen=True)
class Level:
    """The router at one fleet size or request rate: CPU (share of a core) and memory."""

    x: float  # agents, or requests per second sent
    cpu: float
    rss_mb: float
    answered_per_s: float = 0.0


def fleet_levels(sizes: Sequence[int], idle_s: float, log_dir: Path) -> list[Level]:
    levels = []
    for size in sizes:
        listen = f"127.0.0.1:{free_port()}"
        router = start_router(listen, log_dir)
        sim = launch(
            ["--router", listen, "--agents", str(size), "--models", str(MODELS), "--ramp-s", "1"],
            role=f"sim-{size}",
            log_dir=log_dir,
            module="edge_agent.simulate",
        )
        try:
            wait_for_agents(listen, size, timeout_s=180)
            time.sleep(3.0)  # the heartbeat pace settles once everyone is in
            cpu = idle_cpu(router.process.pid, idle_s)
            levels.append(Level(x=size, cpu=cpu, rss_mb=rss_mb(router.process.pid)))
        finally:
            sim.stop(timeout=60)
            router.stop(timeout=30)
        print(f"measured {size} agents", file=sys.stderr, flush=True)
    return levels


def rate_levels(rates: Sequence[float], seconds: float, log_dir: Path) -> list[Level]:
    router = start_router("127.0.0.1:0", log_dir)
    agents = [launch_agent(router.address, f"rate-dev-{i}", log_dir, "--queue-limit", "512") for i in (1, 2)]
    requests = make_requests(digits_splits().held_out.x, budget_ms=2000.0)
    for request in requests:  # settled on the device: the router's work, not the climb's
        set_parameter(request.parameters, "stratus.min_confidence", 0.0)
    loop = new_event_loop()
    levels = []
    try:
        wait_for_agents(router.address, 2)
        time.sleep(1.0)
        levels.append(
            Level(x=0.0, cpu=idle_cpu(router.process.pid, seconds), rss_mb=rss_mb(router.process.pid))
        )
        for rate in rates:
            generator = OpenLoop(router.address, requests, rate=rate)
            cpu, answered = loop.run_until_complete(_loaded(generator, router.process.pid, seconds))
            levels.append(Level(x=rate, cpu=cpu, rss_mb=rss_mb(router.process.pid), answered_per_s=answered))
            print(f"measured {rate:g} req/s", file=sys.stderr, flush=True)
    finally:
        loop.close()
        for agent in agents:
            agent.stop()
        router.stop()
    return levels


async def _loaded(generator: OpenLoop, pid: int, seconds: float) -> tuple[float, float]:
    """The router's CPU while ``generator`` sends for ``seconds`` (after a second to warm
    up), and the requests answered per second in that window."""
    stop = asyncio.Event()
    running = asyncio.create_task(generator.run(stop))
    await asyncio.sleep(1.0)
    generator.swap_tally()
    before, started = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    cpu = (cpu_seconds(pid) - before) / (time.monotonic() - started)
    counted = generator.swap_tally()
    stop.set()
    await running
    return cpu, counted.answered / seconds


def model_rows(variants: Sequence[str], warm: int, log_dir: Path) -> list[tuple[str, str, float]]:
    repository = ModelRepository.load(MODELS)
    router = start_router("127.0.0.1:0", log_dir)
    rows = []
    try:
        for entry in variants:
            name, _, tier = entry.partition("@")
            serve = f"127.0.0.1:{free_port()}"
            flags = ("--serve", serve) if name == "*" else ("--variants", name, "--serve", serve)
            agent = launch_agent(router.address, f"one-{name.strip('*') or tier}", log_dir, *flags, tier=tier)
            try:
                names = [name] if name != "*" else sorted(repository.families)
                runtimes = [_warm(serve, _request(repository, n), warm) for n in names]
                rows.append((entry, ", ".join(sorted(set(runtimes))), rss_mb(agent.process.pid)))
            finally:
                agent.stop()
            print(f"measured {entry}", file=sys.stderr, flush=True)
    finally:
        router.stop()
    return rows


def _request(repository: ModelRepository, model: str) -> pb.ModelInferRequest:
    """One item for the variant's (or the family's) family: a prompt, or zeros of its input's shape."""
    family, _ = repository.resolve(model)
    request = pb.ModelInferRequest(model_name=model)
    if family.generative:
        codec.encode_request_inputs(request, {TEXT_INPUT: np.array([b"37+48="], dtype=object)})
        return request
    spec = family.inputs[0]
    shape = [1 if d == -1 else d for d in spec.shape]
    codec.encode_request_inputs(request, {spec.name: np.zeros(shape, datatypes.numpy_dtype(spec.datatype))})
    return request


def _warm(address: str, request: pb.ModelInferRequest, count: int) -> str:
    """``count`` calls straight to the agent; the runtime that answered them."""
    with grpc.insecure_channel(address, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(count):
            stub.ModelInfer(request, timeout=30)
        metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name=request.model_name), timeout=10)
    return metadata.platform


def machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    memory = next(line.split()[1] for line in meminfo if line.startswith("MemTotal"))
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return f"{os.cpu_count()} CPUs ({model}), {int(memory) / 2**20:.1f} GiB; load average {load}"


def report(fleet: list[Level], rates: list[Level], models: list[tuple[str, str, float]]) -> None:
    print(f"{'agents':>8}{'router cpu':>12}{'router RSS MB':>15}")
    for level in fleet:
        print(f"{level.x:>8.0f}{level.cpu:>11.1%} {level.rss_mb:>15.1f}")
    print(f"\n{'req/s sent':>11}{'answered/s':>12}{'router cpu':>12}{'router RSS MB':>15}")
    for level in rates:
        print(f"{level.x:>11.0f}{level.answered_per_s:>12.0f}{level.cpu:>11.1%} {level.rss_mb:>15.1f}")
    print(f"\n{'agent serving':<24}{'runtimes':<36}{'RSS MB':>8}")
    for entry, runtime, rss in models:
        print(f"{entry:<24}{runtime:<36}{rss:>8.1f}")
    print()
    if len(fleet) > 1:
        print("per 1,000 agents (idle): " + _per_thousand(fleet, [level.x for level in fleet]))
    if len(rates) > 1:
        print("per 1,000 req/s answered: " + _per_thousand(rates, [level.answered_per_s for level in rates]))
    print(f"machine: {machine()}")


def _per_thousand(levels: Sequence[Level], xs: Sequence[float]) -> str:
    """Each row's cost over the first (smallest) one, per 1,000 of x: their range, and the
    least-squares slope through all rows."""
    first = levels[0]
    cpu = [(level.cpu - first.cpu) / (x - xs[0]) * 1000 for level, x in zip(levels[1:], xs[1:], strict=True)]
    rss = [
        (level.rss_mb - first.rss_mb) / (x - xs[0]) * 1000
        for level, x in zip(levels[1:], xs[1:], strict=True)
    ]
    fit_cpu = float(np.polyfit(xs, [level.cpu for level in levels], 1)[0]) * 1000
    fit_rss = float(np.polyfit(xs, [level.rss_mb for level in levels], 1)[0]) * 1000
    return (
        f"CPU {min(cpu):.3f}-{max(cpu):.3f} cores (fit {fit_cpu:.3f}), RSS {min(rss):+.0f} to {max(rss):+.0f} MB "
        f"(fit {fit_rss:+.0f}); base {first.cpu:.1%} of a core, {first.rss_mb:.0f} MB at {xs[0]:g}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="10,500,1000", help="fleet sizes, comma-separated")
    parser.add_argument("--idle-s", type=float, default=10.0, help="CPU window at each fleet size")
    parser.add_argument("--rates", default="100,300,600", help="requests per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=8.0, help="CPU window at each rate")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="VARIANT@TIER, comma-separated")
    parser.add_argument("--warm", type=int, default=100, help="requests to each one-variant agent")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stratus-sizing-") as logs:
        log_dir = Path(logs)
        fleet = fleet_levels([int(n) for n in args.agents.split(",") if n], args.idle_s, log_dir)
        rates = rate_levels([float(r) for r in args.rates.split(",") if r], args.seconds, log_dir)
        models = model_rows([v for v in args.variants.split(",") if v], args.warm, log_dir)
    report(fleet, rates, models)


if __name__ == "__main__":
    main()
