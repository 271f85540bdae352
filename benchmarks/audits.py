"""What audits cost the clients: p50 and p99 with audits off and on, in one run.

Starts a cloud gateway, three routers in front of it (audits off; the defaults, 1% of the items
settled below the top tier and at most 10 a second; and every such item, with no rate limit)
and two device agents linked to all three, then drives ``digits`` requests that the device
settles (closed loop, ``--in-flight`` at once) through each router in turn, round after round.
Prints, per router, the median over rounds of req/s, p50 and p99, and what each did with its
audits.

An audit is queued after the client's answer is built and sent from a background task only
while the cloud has room, so it never waits in front of a client's request; but it costs the
router and the cloud CPU (a cloud call per audited item), which on a machine that runs the whole
fleet shows up as latency in proportion to the share audited.

    python benchmarks/audits.py [--seconds 5] [--rounds 3] [--in-flight 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import MODELS, QUIET, drive, launch_agent  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.devtools.launcher import Launched, free_port, launch  # noqa: E402
from stratus.process import new_event_loop  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402

ROUTERS = {
    "audits off": ["--audit-share", "0"],
    "default (1%, <= 10/s)": [],
    "every item (100%)": ["--audit-share", "1", "--audit-max-per-s", "10000"],
}


def settled_request() -> pb.ModelInferRequest:
    """One held-out digit the device answers sure of itself (so every answer may be audited)."""
    request = pb.ModelInferRequest(model_name="digits")
    codec.encode_request_inputs(request, {"input": digits_splits().held_out.x[:1].astype(np.float32)})
    return request


def audit_outcomes(metrics: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as response:
        text = response.read().decode()
    outcomes: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "stratus_router_audits_total":
                outcome = sample.labels["outcome"]
                outcomes[outcome] = outcomes.get(outcome, 0.0) + sample.value
    return outcomes


def start(log_dir: Path) -> tuple[list[Launched], dict[str, tuple[str, str]]]:
    """The cloud, the routers (address, metrics address) and two agents linked to all of them."""
    cloud = launch(
        ["cloud", "--listen", "127.0.0.1:0", "--models", str(MODELS), *QUIET], role="cloud", log_dir=log_dir
    )
    processes, routers = [cloud], {}
    for index, (name, flags) in enumerate(ROUTERS.items()):
        metrics = f"127.0.0.1:{free_port()}"
        command = ["router", "--listen", "127.0.0.1:0", "--no-advertise", "--cloud", cloud.address]
        router = launch(
            [*command, "--metrics", metrics, *flags, *QUIET], role=f"router-{index}", log_dir=log_dir
        )
        processes.append(router)
        routers[name] = (router.address, metrics)
    every = ",".join(address for address, _ in routers.values())
    processes += [launch_agent(every, f"device-{i}", log_dir) for i in (1, 2)]
    for address, _ in routers.values():
        wait_for_agents(address, 2)
    return processes, routers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=16)
    args = parser.parse_args()
    request = settled_request()
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ROUTERS}
    with tempfile.TemporaryDirectory(prefix="stratus-audits-") as logs:
        processes, routers = start(Path(logs))
        try:
            loop = new_event_loop()
            for _ in range(args.rounds):
                for name, (address, _) in routers.items():
                    run = loop.run_until_complete(
                        drive(address, in_flight=args.in_flight, seconds=args.seconds, request=request)
                    )
                    p50, p99 = np.percentile(run.latencies_ms, [50, 99])
                    runs[name].append((run.throughput, float(p50), float(p99)))
            loop.close()
            outcomes = {name: audit_outcomes(metrics) for name, (_, metrics) in routers.items()}
        finally:
            for process in reversed(processes):
                process.stop()
    print(
        f"{'router':<26}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}   (medians of {args.rounds} rounds of {args.seconds:g} s)"
    )
    for name, rows in runs.items():
        medians = [statistics.median(row[i] for row in rows) for i in range(3)]
        print(f"{name:<26}{medians[0]:>9.0f}{medians[1]:>9.2f}{medians[2]:>9.2f}")
    print()
    for name, counted in outcomes.items():
        audited = counted.get("agreed", 0.0) + counted.get("disagreed", 0.0)
        print(
            f"{name}: {audited:.0f} items audited ({counted.get('agreed', 0.0):.0f} agreed), "
            f"{counted.get('dropped', 0.0):.0f} dropped (no room at the cloud, or a full queue)"
        )


if __name__ == "__main__":
    main()
