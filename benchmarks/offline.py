"""Offline-first under load (issue 36): a cloud outage, provisional answers, then judging.

Starts a cloud gateway, a router (``--state-dir``) and a device and an edge agent on loopback,
the shipped ``digits`` family copied with ``[offline] defer = true``, and sends held-out digits
rows (one item a request, a unique request id each, a 1 s budget) at ``--rate`` requests/s,
open loop, through four phases:

1. **before**: the cloud up, ``--before-s`` seconds;
2. **outage**: the cloud gateway SIGKILLed, ``--outage-s`` seconds (the issue's 5 minutes by
   default): unsure items come back provisional and are kept under the state folder;
3. **judging**: the cloud started again on the same port; from then until the state folder
   holds no deferred request (every one judged), live load goes on;
4. **after**: ``--after-s`` more seconds with the cloud up and nothing left to judge.

Printed: per phase, requests, answered, failed, lost, p50 and p99 latency and the provisional
share; the time from the cloud's return to the backlog's end; the number of corrections; and
accuracy against the held-out labels: the cascade with the cloud up (phases before and after),
the outage's answers as given, and the outage's answers with the corrections applied (each
corrected request's answer replaced by the cloud's, by request id).

    python benchmarks/offline.py [--rate 100] [--outage-s 300] [--before-s 30] [--after-s 30] [--adjudicate-share 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import QUIET  # noqa: E402

from stratus.cli.demo import launch_agent, wait_for_agents  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.convert.parameters import DEGRADED, PROVISIONAL, parameter_value, set_parameter  # noqa: E402
from stratus.devtools.launcher import Launched, free_port, launch  # noqa: E402
from stratus.serving.channels import grpc_options, open_sync_channel  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import fleet_pb2 as fpb  # noqa: E402
from stratus.wire import fleet_pb2_grpc as fpb_grpc  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402
from stratus.wire import inference_pb2_grpc as pb_grpc  # noqa: E402

MODELS = ROOT / "models"


@dataclass
class Outcome:
    request_id: str
    row: int
    sent_at: float
    ms: float = 0.0
    label: int | None = None  # the answer's top-1 class; None: no answer
    provisional: bool = False
    degraded: bool = False
    failed: str = ""


@dataclass
class Load:
    """Open-loop requests (one held-out row each), every outcome kept."""

    address: str
    x: np.ndarray
    rate: float
    outcomes: list[Outcome] = field(default_factory=list)
    _sent: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        async with grpc.aio.insecure_channel(self.address, options=grpc_options()) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            tasks: set[asyncio.Task[None]] = set()
            next_send = time.perf_counter()
            while not stop.is_set():
                now = time.perf_counter()
                if now < next_send:
                    await asyncio.sleep(next_send - now)
                    continue
                next_send += 1.0 / self.rate
                task = asyncio.create_task(self._one(stub))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(list(tasks))

    async def _one(self, stub: pb_grpc.GRPCInferenceServiceStub) -> None:
        row = self._sent % len(self.x)
        outcome = Outcome(request_id=f"q{self._sent}", row=row, sent_at=time.monotonic())
        self._sent += 1
        self.outcomes.append(outcome)
        request = pb.ModelInferRequest(model_name="digits", id=outcome.request_id)
        codec.encode_request_inputs(request, {"input": self.x[row : row + 1]})
        set_parameter(request.parameters, "stratus.budget_ms", 1000.0)
        started = time.perf_counter()
        try:
            response = await stub.ModelInfer(request, timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            outcome.failed = "lost" if exc.details() == "Deadline Exceeded" else exc.code().name
            return
        outcome.ms = (time.perf_counter() - started) * 1000.0
        outcome.label = int(codec.decode_response_outputs(response)["probabilities"].argmax(axis=1)[0])
        params = response.parameters
        outcome.provisional = PROVISIONAL in params and bool(parameter_value(params[PROVISIONAL]))
        outcome.degraded = DEGRADED in params and bool(parameter_value(params[DEGRADED]))


class Fleet:
    def __init__(self, work: Path, share: float) -> None:
        self.work = work
        self.models = work / "models"
        shutil.copytree(MODELS / "digits", self.models / "digits")
        toml = self.models / "digits" / "family.toml"
        toml.write_text(toml.read_text() + "\n[offline]\ndefer = true\nmax_items = 100000\n")
        self.state = work / "state"
        self.cloud_address = f"127.0.0.1:{free_port()}"
        self.cloud = self._cloud()
        self.router = launch(
            ["router", "--listen", "127.0.0.1:0", "--cloud", self.cloud_address, "--no-advertise",
             "--state-dir", str(self.state), "--adjudicate-share", str(share), *QUIET],
            role="router", log_dir=work,
        )  # fmt: skip
        self.agents = [
            launch_agent(self.models, self.router.address, "device-1", work, tier="device"),
            launch_agent(self.models, self.router.address, "edge-1", work, tier="edge"),
        ]
        wait_for_agents(self.router.address, 2)

    def _cloud(self) -> Launched:
        args = ["cloud", "--listen", self.cloud_address, "--models", str(self.models), *QUIET]
        return launch(args, role="cloud", log_dir=self.work)

    def cloud_away(self) -> None:
        self.cloud.kill()

    def cloud_back(self) -> None:
        self.cloud = self._cloud()

    def backlog(self) -> int:
        return len(list((self.state / "deferred").glob("*.deferred")))

    def corrections(self) -> dict[str, int]:
        with open_sync_channel(self.router.address) as channel:
            stream = fpb_grpc.FleetStub(channel).Corrections(fpb.CorrectionsRequest(), timeout=30)
            return {c.request_id: int(c.cloud.label) for c in stream}

    def stop(self) -> None:
        for process in [*self.agents, self.router, self.cloud]:
            process.stop()


async def drive(fleet: Fleet, load: Load, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """The phases; returns each phase's (start, end) on the monotonic clock."""
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(stop))
    loop = asyncio.get_running_loop()
    marks: dict[str, tuple[float, float]] = {}
    start = time.monotonic()
    await asyncio.sleep(args.before_s)
    marks["before"] = (start, time.monotonic())
    await loop.run_in_executor(None, fleet.cloud_away)
    start = time.monotonic()
    await asyncio.sleep(args.outage_s)
    marks["outage"] = (start, time.monotonic())
    await loop.run_in_executor(None, fleet.cloud_back)
    start = time.monotonic()
    while fleet.backlog() and time.monotonic() - start < args.judge_limit_s:
        await asyncio.sleep(0.2)
    marks["judging"] = (start, time.monotonic())
    start = time.monotonic()
    await asyncio.sleep(args.after_s)
    marks["after"] = (start, time.monotonic())
    stop.set()
    await runner
    return marks


def report(
    load: Load, marks: dict[str, tuple[float, float]], y: np.ndarray, corrections: dict[str, int], left: int
) -> None:
    print(
        f"{'phase':<10}{'seconds':>8}{'sent':>8}{'failed':>8}{'lost':>6}{'p50 ms':>8}{'p99 ms':>8}{'provisional':>13}"
    )
    phases: dict[str, list[Outcome]] = {}
    for name, (start, end) in marks.items():
        phase = [o for o in load.outcomes if start <= o.sent_at < end]
        phases[name] = phase
        answered = [o for o in phase if o.label is not None]
        ms = [o.ms for o in answered] or [0.0]
        failed = sum(1 for o in phase if o.failed and o.failed != "lost")
        lost = sum(1 for o in phase if o.failed == "lost")
        share = sum(o.provisional for o in answered) / max(1, len(answered))
        print(f"{name:<10}{end - start:>8.1f}{len(phase):>8}{failed:>8}{lost:>6}{np.percentile(ms, 50):>8.2f}"
              f"{np.percentile(ms, 99):>8.2f}{share:>12.2%}")  # fmt: skip
    outage = [o for o in phases["outage"] if o.label is not None]
    provisional = sum(o.provisional for o in outage)
    print(f"\nbacklog judged in {marks['judging'][1] - marks['judging'][0]:.1f} s after the cloud came back "
          f"({provisional} provisional answers; {left} left unjudged); corrections: {len(corrections)}")  # fmt: skip

    def accuracy(outcomes: list[Outcome], corrected: bool) -> float:
        right = 0
        for o in outcomes:
            label = corrections.get(o.request_id, o.label) if corrected else o.label
            right += int(label == y[o.row])
        return right / max(1, len(outcomes))

    up = [o for name in ("before", "after") for o in phases[name] if o.label is not None]
    print(f"\naccuracy on the held-out labels:\n  cascade with the cloud up (before, after): {accuracy(up, False):.4f}"
          f" ({len(up)} requests)\n  outage, as answered:                       {accuracy(outage, False):.4f}"
          f" ({len(outage)} requests)\n  outage, with the corrections applied:      {accuracy(outage, True):.4f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second")
    parser.add_argument("--before-s", type=float, default=30.0)
    parser.add_argument("--outage-s", type=float, default=300.0)
    parser.add_argument("--after-s", type=float, default=30.0)
    parser.add_argument("--adjudicate-share", type=float, default=0.01, help="the router's --adjudicate-share")
    parser.add_argument(
        "--judge-limit-s", type=float, default=600.0, help="stop waiting for the backlog after this"
    )
    args = parser.parse_args()
    splits = digits_splits()
    x, y = splits.held_out.x.astype(np.float32), splits.held_out.y
    with tempfile.TemporaryDirectory(prefix="stratus-offline-") as work:
        fleet = Fleet(Path(work), args.adjudicate_share)
        try:
            load = Load(fleet.router.address, x, args.rate)
            marks = asyncio.run(drive(fleet, load, args))
            corrections, left = fleet.corrections(), fleet.backlog()
        finally:
            fleet.stop()
    print(
        f"rate {args.rate:g}/s, one held-out row a request, 1 s budget; device + edge agents, cloud digits-large\n"
    )
    report(load, marks, y, corrections, left)


if __name__ == "__main__":
    main()
