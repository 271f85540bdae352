"""Gray release under load: a full rollout of a good candidate, then a bad one rolled back.

Builds a models folder holding the shipped digits family plus three device candidates,
made the way a user would add them (an ONNX file and `stratus models import`):
`digits-small-v2` (digits-small's weights), `digits-small-shuffled` (the same weights
shuffled within each tensor: it answers, but unsure and mostly wrong) and
`digits-small-swapped` (classes 3 and 8 traded after import: as sure and as fast, wrong on
about a fifth). Starts a router, two device agents and an edge agent (the tier above, which
audits the device arms), and sends the digits held-out split at a steady open-loop rate. Then:

1. `stratus fleet rollout digits --tier device --candidate digits-small-v2` (steps 5, 25,
   50, 100) until it completes;
2. the same with `digits-small-shuffled`, then `digits-small-swapped`, until the router rolls
   each back (the first on its unsure share, the second only on its agreement).

Per step: the router's own evidence for each variant on the device tier (requests, errors,
p99, unsure share, audits and agreement, sampled every 50 ms until the step changed), what
was decided and why, and what clients saw meanwhile (sent, answered, failed, lost, p99).

    python benchmarks/rollout.py [--rate 150] [--min-requests 200] [--audit-max-per-s 50]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import QUIET, OpenLoop, Tally, make_requests  # noqa: E402

from stratus.cli.demo import launch_agent, wait_for_agents  # noqa: E402
from stratus.devtools.launcher import launch  # noqa: E402
from stratus.serving.channels import open_sync_channel  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import fleet_pb2 as fpb  # noqa: E402
from stratus.wire import fleet_pb2_grpc as fpb_grpc  # noqa: E402
from tests.integration.variants import shuffled_copy, swapped_copy  # noqa: E402


def build_models(root: Path) -> Path:
    models = root / "models"
    shutil.copytree(ROOT / "models" / "digits", models / "digits")
    good, bad = root / "digits-small-v2.onnx", root / "digits-small-shuffled.onnx"
    sure = root / "digits-small-swapped.onnx"
    shutil.copy(ROOT / "models" / "digits" / "digits-small.onnx", good)
    shutil.copy(good, sure)
    shuffled_copy(good, bad)
    for path in (good, bad, sure):
        subprocess.run(
            [sys.executable, "-m", "stratus.cli", "models", "import", str(path), "--family", "digits",
             "--tier", "device", "--variant", path.stem, "--dir", str(models),
             *(["--no-convert", "--no-children"] if path is sure else [])],  # its ONNX file alone, so the swap holds
            check=True,
            capture_output=True,
        )  # fmt: skip
    imported = models / "digits" / sure.name  # swapped after import: its temperature is digits-small's
    swapped_copy(imported, imported, (3, 8))
    return models


@dataclass
class StepRecord:
    candidate: str
    share: float
    status: fpb.RolloutStatus
    clients: Tally
    seconds: float
    decision: str = ""


class Steering:
    def __init__(self, router: str) -> None:
        self.channel = open_sync_channel(router)
        self.stub = fpb_grpc.FleetStub(self.channel)

    def call(self, action: int, **fields: object) -> fpb.RolloutReply:
        request = fpb.RolloutRequest(action=action, family="digits", tier=fpb.TIER_DEVICE, **fields)  # type: ignore[arg-type]
        return self.stub.Rollout(request, timeout=10)

    def status(self) -> fpb.RolloutStatus:
        return self.call(fpb.ROLLOUT_ACTION_STATUS).rollouts[0]


async def follow(
    steering: Steering, generator: OpenLoop, candidate: str, args: argparse.Namespace
) -> list[StepRecord]:
    """Start a rollout and record each step until it is complete or rolled back."""
    loop = asyncio.get_running_loop()
    steps = [float(s) for s in args.steps.split(",")]
    started = await loop.run_in_executor(
        None,
        lambda: steering.call(
            fpb.ROLLOUT_ACTION_START,
            candidate=candidate,
            steps=steps,
            min_requests=args.min_requests,
            max_p99_ratio=args.max_p99_ratio,
            max_disagreement_increase=args.max_disagreement_increase,
        ),
    )
    last = started.rollouts[0]
    generator.swap_tally()
    step_started = time.perf_counter()
    records = []
    deadline = time.perf_counter() + args.timeout
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
        status = await loop.run_in_executor(None, steering.status)
        if (status.step, status.state) == (last.step, last.state):
            last = status
            continue
        seconds = time.perf_counter() - step_started
        records.append(
            StepRecord(candidate, last.share_percent, last, generator.swap_tally(), seconds, status.reason)
        )
        step_started, last = time.perf_counter(), status
        if status.state in ("complete", "rolled_back"):
            break
    return records


def print_steps(records: list[StepRecord]) -> None:
    header = (
        f"{'candidate':<23}{'share':>6}{'variant':>24}{'requests':>9}{'errors':>7}{'p99 ms':>8}"
        f"{'unsure':>8}{'audits':>7}{'agree':>7}{'secs':>6}{'sent':>7}{'failed':>7}{'lost':>5}{'client p99':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in records:
        for index, arm in enumerate((r.status.current, r.status.candidate_stats)):
            client = r.clients
            tail = (
                f"{r.seconds:>6.1f}{client.sent:>7}{client.failed_total:>7}{client.lost:>5}{client.p99():>11.1f}"
                if index == 0
                else ""
            )
            name = r.candidate if index == 0 else ""
            share = f"{r.share:>5g}%" if index == 0 else " " * 6
            print(
                f"{name:<23}{share}{arm.variant or '-':>24}{arm.requests:>9}{arm.errors:>7}{arm.p99_ms:>8.1f}"
                f"{arm.unsure_share:>8.1%}{arm.audited:>7}{arm.agreement:>7.1%}{tail}"
            )
        print(f"  -> {r.decision}")


async def main_async(args: argparse.Namespace, router: str) -> list[StepRecord]:
    data = digits_splits().held_out
    generator = OpenLoop(router, make_requests(data.x, budget_ms=1000.0), rate=args.rate)
    stop = asyncio.Event()
    runner = asyncio.create_task(generator.run(stop))
    steering = Steering(router)
    await asyncio.sleep(2.0)  # warm up
    records = await follow(steering, generator, "digits-small-v2", args)
    await asyncio.get_running_loop().run_in_executor(None, lambda: steering.call(fpb.ROLLOUT_ACTION_PROMOTE))
    records += await follow(steering, generator, "digits-small-shuffled", args)
    records += await follow(steering, generator, "digits-small-swapped", args)
    stop.set()
    await runner
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=150.0, help="requests per second")
    parser.add_argument("--steps", default="5,25,50,100")
    parser.add_argument("--min-requests", type=int, default=200)
    parser.add_argument("--max-p99-ratio", type=float, default=1.5)
    parser.add_argument("--max-disagreement-increase", type=float, default=0.01)
    parser.add_argument("--audit-max-per-s", default="50", help="the router's audit budget per arm")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per rollout, at most")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        models = build_models(root)
        router = launch(
            [
                "router",
                "--listen",
                "127.0.0.1:0",
                "--no-advertise",
                "--audit-max-per-s",
                args.audit_max_per_s,
                *QUIET,
            ],
            role="router",
            log_dir=root,
        )
        agents = [
            launch_agent(models, router.address, name, root, tier=tier)
            for name, tier in (("device-1", "device"), ("device-2", "device"), ("edge-1", "edge"))
        ]
        try:
            wait_for_agents(router.address, len(agents))
            records = asyncio.run(main_async(args, router.address))
        finally:
            for launched in (*agents, router):
                launched.stop()
    print(
        f"rate {args.rate:g}/s, steps {args.steps}, at least {args.min_requests} requests per variant and step\n"
    )
    print_steps(records)


if __name__ == "__main__":
    main()
