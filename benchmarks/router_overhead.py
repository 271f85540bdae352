"""What the router costs: one agent and variant, called directly and through the router.

Starts a router and one device agent (with ``--serve``) on loopback, then from one client
process sends ``digits-small`` requests (batch 1) straight to the agent's endpoint and
through the router (pinned to the same variant, so no escalation), alternating rounds so
both see the same machine. Prints throughput with 1 and 64 requests in flight, their
ratio, and the latency the router adds at p50 and p99.

Targets, as ratios (absolute times move with this shared machine): at 1 in flight the
router path's p50 <= 1.4x the direct p50; at 64 in flight its throughput >= 0.8x direct.

    python benchmarks/router_overhead.py [--seconds 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import Run, drive, launch_agent  # noqa: E402

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.devtools.launcher import launch  # noqa: E402
from stratus.process import new_event_loop  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="alternating direct/router rounds")
    args = parser.parse_args()
    request = pb.ModelInferRequest(model_name="digits-small")
    codec.encode_request_inputs(
        request, {"input": np.random.default_rng(0).random((1, 64), dtype=np.float32)}
    )
    with tempfile.TemporaryDirectory(prefix="stratus-bench-") as logs:
        log_dir = Path(logs)
        router = launch(
            ["router", "--listen", "127.0.0.1:0", "--no-advertise", "--log-level", "WARNING"],
            role="router",
            log_dir=log_dir,
        )
        agent = launch_agent(
            router.address,
            "bench-agent",
            log_dir,
            "--serve",
            "127.0.0.1:0",
            "--concurrency",
            "2",
            "--queue-limit",
            "512",
        )
        try:
            wait_for_agents(router.address, 1)
            loop = new_event_loop()
            results: dict[tuple[str, int], list[Run]] = {}
            for _ in range(args.rounds):
                for in_flight in (1, 64):
                    for name, address in (("direct", agent.address), ("router", router.address)):
                        run = loop.run_until_complete(
                            drive(address, in_flight=in_flight, seconds=args.seconds, request=request)
                        )
                        results.setdefault((name, in_flight), []).append(run)
            loop.close()
        finally:
            agent.stop()
            router.stop()
    report(results)


def report(results: dict[tuple[str, int], list[Run]]) -> None:
    print(f"{'in flight':>9} {'path':<8}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}")
    summary = {}
    for (name, in_flight), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        throughput = statistics.median(r.throughput for r in runs)
        latencies = [ms for r in runs for ms in r.latencies_ms]
        summary[(name, in_flight)] = (throughput, percentile(latencies, 50), percentile(latencies, 99))
        print(
            f"{in_flight:>9} {name:<8}{throughput:>10.0f}{summary[(name, in_flight)][1]:>9.3f}"
            f"{summary[(name, in_flight)][2]:>9.3f}"
        )
    print()
    print(
        f"{'in flight':>9}{'router/direct req/s':>21}{'router/direct p50':>19}{'added p50 ms':>14}{'added p99 ms':>14}"
    )
    for in_flight in (1, 64):
        direct, routed = summary[("direct", in_flight)], summary[("router", in_flight)]
        print(
            f"{in_flight:>9}{routed[0] / direct[0]:>21.2f}{routed[1] / direct[1]:>19.2f}"
            f"{routed[1] - direct[1]:>14.3f}{routed[2] - direct[2]:>14.3f}"
        )
    print("\ntargets: at 1 in flight router/direct p50 <= 1.4; at 64 in flight router/direct req/s >= 0.8")


if __name__ == "__main__":
    main()
