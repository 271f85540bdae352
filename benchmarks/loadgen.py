"""Open-loop load for the benchmarks: a fixed request rate, whatever the fleet does.

Closed-loop clients slow down when the system does, which hides overload and outages;
an open-loop generator keeps sending at the set rate, so every request is counted as
answered, answered degraded, failed with a clear error, or lost (no answer by the
client's own deadline, well past the request's budget).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from stratus.cli import demo
from stratus.convert import codec
from stratus.convert.parameters import DEGRADED, parameter_value, set_parameter
from stratus.devtools.launcher import Launched
from stratus.serving.channels import grpc_options
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    degraded: int = 0
    lost: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)  # status and message, numbers masked
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())

    def p99(self) -> float:
        return float(np.percentile(self.latencies_ms, 99)) if self.latencies_ms else 0.0


def make_requests(x: np.ndarray, *, budget_ms: float) -> list[pb.ModelInferRequest]:
    requests = []
    for index in range(len(x)):
        request = pb.ModelInferRequest(model_name="digits", id=str(index))
        codec.encode_request_inputs(request, {"input": x[index : index + 1]})
        set_parameter(request.parameters, "stratus.budget_ms", budget_ms)
        requests.append(request)
    return requests


class OpenLoop:
    """Sends ``rate`` requests per second to ``address`` until stopped; counts outcomes."""

    def __init__(
        self,
        address: str,
        requests: list[pb.ModelInferRequest],
        *,
        rate: float,
        client_timeout_s: float = 5.0,
        max_in_flight: int = 4096,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.address = address
        self.channel_options = list(channel_options)
        self.requests = requests
        self.rate = rate
        self.client_timeout_s = client_timeout_s
        self.max_in_flight = max_in_flight
        self.tally = Tally()
        self._tasks: set[asyncio.Task[None]] = set()

    def swap_tally(self) -> Tally:
        """Start counting into a new tally (a new phase); return the old one."""
        old, self.tally = self.tally, Tally()
        return old

    async def run(self, stop: asyncio.Event) -> None:
        channel = grpc.aio.insecure_channel(self.address, options=[*grpc_options(), *self.channel_options])
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        interval = 1.0 / self.rate
        next_send = time.perf_counter()
        index = 0
        while not stop.is_set():
            now = time.perf_counter()
            if now < next_send:
                await asyncio.sleep(next_send - now)
                continue
            next_send += interval
            tally = self.tally
            tally.sent += 1
            if len(self._tasks) >= self.max_in_flight:
                tally.failed["client queue full"] += 1
                continue
            task = asyncio.create_task(self._one(stub, self.requests[index % len(self.requests)], tally))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            index += 1
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        await channel.close()

    async def _one(
        self, stub: pb_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest, tally: Tally
    ) -> None:
        started = time.perf_counter()
        try:
            response = await stub.ModelInfer(request, timeout=self.client_timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and error.details() == "Deadline Exceeded":
                tally.lost += 1  # the client's own timer fired: nobody answered
            else:
                tally.failed[error.code().name] += 1
                masked = re.sub(r"[0-9.]+", "#", error.details() or "")
                tally.reasons[f"{error.code().name}: {masked}"] += 1
            return
        tally.latencies_ms.append((time.perf_counter() - started) * 1000.0)
        tally.answered += 1
        if DEGRADED in response.parameters and parameter_value(response.parameters[DEGRADED]):
            tally.degraded += 1


@dataclass
class Run:
    requests: int
    seconds: float
    latencies_ms: list[float]

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds


async def drive(
    address: str,
    *,
    in_flight: int,
    seconds: float,
    request: pb.ModelInferRequest,
    on_response: Callable[[pb.ModelInferResponse], None] | None = None,
) -> Run:
    """Closed loop: ``in_flight`` workers, each sending its next request as soon as the last returns."""
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(address, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(20):  # warm the channel and both ends
            await stub.ModelInfer(request, timeout=10)
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                response = await stub.ModelInfer(request, timeout=10)
                latencies.append((time.perf_counter() - started) * 1000.0)
                if on_response is not None:
                    on_response(response)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        elapsed = time.perf_counter() - started
    return Run(requests=len(latencies), seconds=elapsed, latencies_ms=latencies)


QUIET = ["--log-level", "WARNING"]
MODELS = Path(__file__).resolve().parent.parent / "models"


async def run_phases(
    generator: OpenLoop, phases: list[tuple[str, Callable[[], None]]], seconds: float
) -> list[tuple[str, Tally]]:
    """Open-loop load through phases: each phase's action (run off the event loop), then
    ``seconds`` of load, counted on its own; every request's outcome is in before it returns."""
    stop = asyncio.Event()
    runner = asyncio.create_task(generator.run(stop))
    results = []
    for name, action in phases:
        generator.swap_tally()
        await asyncio.get_running_loop().run_in_executor(None, action)
        await asyncio.sleep(seconds)
        results.append((name, generator.tally))
    generator.swap_tally()
    stop.set()
    await runner
    return results


def print_phases(results: list[tuple[str, Tally]]) -> None:
    print(
        f"{'phase':<28}{'sent':>7}{'answered':>10}{'degraded':>10}{'failed':>8}{'lost':>6}{'p99 ms':>9}  failures"
    )
    for name, tally in results:
        failures = ", ".join(f"{code} {count}" for code, count in tally.failed.most_common()) or "-"
        print(
            f"{name:<28}{tally.sent:>7}{tally.answered:>10}{tally.degraded:>10}{tally.failed_total:>8}"
            f"{tally.lost:>6}{tally.p99():>9.1f}  {failures}"
        )
    reasons = sum((t.reasons for _, t in results), start=Counter())
    if reasons:
        print("\nfailures by reason:")
        for reason, count in reasons.most_common(8):
            print(f"  {count:>6}  {reason}")
    print(f"\nlost in total: {sum(t.lost for _, t in results)} (must be 0)")


def launch_agent(router: str, name: str, log_dir: Path, *flags: str, tier: str = "device") -> Launched:
    """One agent process with the shipped models, linked to ``router``, with its own flags."""
    return demo.launch_agent(MODELS, router, name, log_dir, *flags, tier=tier)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0
