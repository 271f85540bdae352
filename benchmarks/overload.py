"""Sustained overload: the router's memory stays flat and what it admits meets its budget.

Starts a router and two device agents (one inference slot, a queue of 8, and an emulated
5 ms inference each, so the fleet, not this 2-core machine's client, is the bottleneck), finds
the fleet's capacity with a closed-loop burst, then sends twice that rate, open loop,
for ``--minutes`` (5 by default). Every 10 s it samples the router's RSS. It prints the
RSS samples, their growth per minute after the first minute (least squares; target
under 1 MB/min), how many requests were refused with RESOURCE_EXHAUSTED, and the
latency of the admitted ones against their budget.

    python benchmarks/overload.py [--minutes 5] [--budget-ms 100]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import QUIET, OpenLoop, launch_agent, make_requests, rss_mb  # noqa: E402

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.convert.parameters import set_parameter  # noqa: E402
from stratus.devtools.launcher import launch  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402


async def capacity(address: str, requests: list, seconds: float = 5.0) -> float:  # type: ignore[type-arg]
    """Requests per second the fleet sustains with a generous closed loop."""
    probe = OpenLoop(address, requests, rate=10_000.0, max_in_flight=64)
    stop = asyncio.Event()
    runner = asyncio.create_task(probe.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await runner
    return probe.tally.answered / seconds


async def overload(address: str, requests: list, rate: float, minutes: float, router_pid: int):  # type: ignore[no-untyped-def,type-arg]
    generator = OpenLoop(address, requests, rate=rate, client_timeout_s=5.0)
    stop = asyncio.Event()
    runner = asyncio.create_task(generator.run(stop))
    samples = []
    started = time.monotonic()
    while time.monotonic() - started < minutes * 60:
        samples.append((time.monotonic() - started, rss_mb(router_pid)))
        print(
            f"  t={samples[-1][0]:6.0f} s  router RSS {samples[-1][1]:7.2f} MB  sent {generator.tally.sent}",
            flush=True,
        )
        await asyncio.sleep(10.0)
    samples.append((time.monotonic() - started, rss_mb(router_pid)))
    stop.set()
    await runner
    return generator.tally, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--budget-ms", type=float, default=100.0)
    parser.add_argument(
        "--service-ms",
        type=float,
        default=5.0,
        help="emulated inference time per request on each agent (one slot each)",
    )
    args = parser.parse_args()
    requests = make_requests(digits_splits().held_out.x, budget_ms=args.budget_ms)
    for request in requests:  # stay on the device tier: this measures the router's queues
        set_parameter(request.parameters, "stratus.max_tier", "device")
    with tempfile.TemporaryDirectory(prefix="stratus-overload-") as logs:
        log_dir = Path(logs)
        router = launch(
            ["router", "--listen", "127.0.0.1:0", "--no-advertise", *QUIET], role="router", log_dir=log_dir
        )
        agents = [
            launch_agent(
                router.address,
                f"device-{i}",
                log_dir,
                "--concurrency",
                "1",
                "--queue-limit",
                "8",
                "--emulate-slow-ms",
                str(args.service_ms),
            )
            for i in (1, 2)
        ]
        try:
            wait_for_agents(router.address, 2)
            fleet_capacity = asyncio.run(capacity(router.address, requests))
            rate = 2 * fleet_capacity
            print(
                f"fleet capacity {fleet_capacity:.0f} req/s; overloading at {rate:.0f} req/s for {args.minutes:g} min"
            )
            tally, samples = asyncio.run(
                overload(router.address, requests, rate, args.minutes, router.process.pid)
            )
        finally:
            for process in [*agents, router]:
                process.stop()
    steady = [(t, mb) for t, mb in samples if t >= 60.0] or samples
    times, sizes = np.array([t for t, _ in steady]), np.array([mb for _, mb in steady])
    slope = float(np.polyfit(times / 60.0, sizes, 1)[0]) if len(steady) > 1 else 0.0
    admitted = np.array(tally.latencies_ms)
    print()
    print(f"{'sent':>8}{'answered':>10}{'exhausted':>11}{'other errors':>14}{'lost':>6}")
    exhausted = tally.failed.get("RESOURCE_EXHAUSTED", 0)
    print(
        f"{tally.sent:>8}{tally.answered:>10}{exhausted:>11}{tally.failed_total - exhausted:>14}{tally.lost:>6}"
    )
    print(
        f"\nrouter RSS: first {samples[0][1]:.2f} MB, at 1 min {steady[0][1]:.2f} MB, last {samples[-1][1]:.2f} MB; "
        f"growth after the first minute {slope:+.3f} MB/min (target < 1 MB/min)"
    )
    if admitted.size:
        within = float((admitted <= args.budget_ms).mean())
        print(
            f"admitted latency: p50 {np.percentile(admitted, 50):.1f} ms, p99 {np.percentile(admitted, 99):.1f} ms, "
            f"{within:.2%} within the {args.budget_ms:g} ms budget"
        )
    print("refusals by reason:")
    for reason, count in tally.reasons.most_common(6):
        print(f"  {count:>7}  {reason}")


if __name__ == "__main__":
    main()
