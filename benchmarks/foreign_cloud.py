"""The cascade with NVIDIA Triton as the cloud tier beside the cascade with Stratus's own
cloud gateway: same fleet below it, same requests, one run.

Each stack is a router, a device agent (digits-small) and an edge agent (digits-medium)
with its cloud: the Stratus gateway serving digits-large (FP32) through ONNX Runtime, or
Triton (PyTriton 0.7.0, from .venv-triton, see scripts/foreign_env.py) serving the same
digits-large.onnx through ONNX Runtime with its dynamic batcher, reached with
``--cloud-models digits-large``. Two workloads per stack, each the digits held-out split
(one item per request) sent with 16 requests in flight: the cascade as calibrated, and every
request made to climb to the cloud (``min_confidence`` 1.0). Per row: accuracy against the
labels, the share answered by the cloud, p50 and p99 latency, and requests per second.

    python benchmarks/foreign_cloud.py [--requests 1500] [--in-flight 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import QUIET, launch_agent  # noqa: E402

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.convert.parameters import Served, set_parameter  # noqa: E402
from stratus.devtools.launcher import Launched, launch  # noqa: E402
from stratus.serving.channels import grpc_options  # noqa: E402
from stratus.tiers import Tier  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402
from stratus.wire import inference_pb2_grpc as pb_grpc  # noqa: E402

MODELS = ROOT / "models"
AGENTS = (("device-1", "device", "digits-small"), ("edge-1", "edge", "digits-medium"))


def _foreign_env() -> ModuleType:
    """scripts/foreign_env.py, imported only when this run needs it."""
    import foreign_env  # scripts/ is on the path (above)

    return foreign_env


@dataclass
class Row:
    stack: str
    workload: str
    accuracy: float
    cloud_share: float
    p50_ms: float
    p99_ms: float
    per_s: float


@contextlib.contextmanager
def stratus_cloud(log_dir: Path) -> Iterator[tuple[str, tuple[str, ...]]]:
    cloud = launch(
        ["cloud", "--listen", "127.0.0.1:0", "--models", str(MODELS), "--variants", "digits-large", *QUIET],
        role="cloud",
        log_dir=log_dir,
    )
    try:
        yield cloud.address, ()
    finally:
        cloud.stop()


@contextlib.contextmanager
def triton_cloud(log_dir: Path) -> Iterator[tuple[str, tuple[str, ...]]]:
    env = _foreign_env()
    server = env.SERVERS["triton"]
    env.ensure(server)
    running = env.start(server, MODELS / "digits" / "digits-large.onnx", name="digits-large", log_dir=log_dir)
    try:
        yield running.address, ("--cloud-models", "digits-large")
    finally:
        running.stop()


@contextlib.contextmanager
def cascade(cloud: str, flags: tuple[str, ...], log_dir: Path) -> Iterator[str]:
    """A router and the two agents below the given cloud; the router's address."""
    router = launch(
        ["router", "--listen", "127.0.0.1:0", "--no-advertise", "--cloud", cloud, *flags, *QUIET],
        role="router",
        log_dir=log_dir,
    )
    agents: list[Launched] = []
    try:
        for name, tier, variant in AGENTS:
            agents.append(launch_agent(router.address, name, log_dir, "--variants", variant, tier=tier))
        wait_for_agents(router.address, len(AGENTS))
        yield router.address
    finally:
        for process in [*agents, router]:
            process.stop()


def requests(x: np.ndarray, *, min_confidence: float | None) -> list[pb.ModelInferRequest]:
    made = []
    for index in range(len(x)):
        request = pb.ModelInferRequest(model_name="digits", id=str(index))
        codec.encode_request_inputs(request, {"input": x[index : index + 1].astype(np.float32)})
        if min_confidence is not None:
            set_parameter(request.parameters, "stratus.min_confidence", min_confidence)
        made.append(request)
    return made


async def closed_loop(
    router: str, batch: list[pb.ModelInferRequest], *, in_flight: int
) -> tuple[list[pb.ModelInferResponse], list[float], float]:
    """Every request once, ``in_flight`` at a time: answers in order, latencies, seconds."""
    answers: list[pb.ModelInferResponse | None] = [None] * len(batch)
    latencies: list[float] = []
    cursor = iter(range(len(batch)))
    async with grpc.aio.insecure_channel(router, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def worker() -> None:
            for index in cursor:
                started = time.perf_counter()
                answers[index] = await stub.ModelInfer(batch[index], timeout=10)
                latencies.append((time.perf_counter() - started) * 1000.0)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        took = time.perf_counter() - began
    return [a for a in answers if a is not None], latencies, took


def measure(router: str, stack: str, x: np.ndarray, y: np.ndarray, in_flight: int) -> list[Row]:
    rows = []
    asyncio.run(closed_loop(router, requests(x[:100], min_confidence=1.0), in_flight=in_flight))  # warm up
    for workload, min_confidence in (("cascade", None), ("all to cloud", 1.0)):
        answers, latencies, took = asyncio.run(
            closed_loop(router, requests(x, min_confidence=min_confidence), in_flight=in_flight)
        )
        predicted = [int(codec.decode_response_outputs(a)["probabilities"].argmax()) for a in answers]
        cloud = sum(1 for a in answers if Served.read(a.parameters).tier is Tier.CLOUD)
        rows.append(
            Row(
                stack=stack,
                workload=workload,
                accuracy=float(np.mean(np.asarray(predicted) == y)),
                cloud_share=cloud / len(answers),
                p50_ms=float(np.percentile(latencies, 50)),
                p99_ms=float(np.percentile(latencies, 99)),
                per_s=len(answers) / took,
            )
        )
    return rows


def print_rows(rows: list[Row], *, in_flight: int, count: int) -> None:
    print(f"digits held-out, {count} requests of one item, {in_flight} in flight")
    print(
        f"{'cloud tier':<26}{'workload':<14}{'accuracy':>9}{'cloud':>8}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>8}"
    )
    for r in rows:
        print(
            f"{r.stack:<26}{r.workload:<14}{r.accuracy:>9.3f}{r.cloud_share:>8.1%}"
            f"{r.p50_ms:>9.2f}{r.p99_ms:>9.2f}{r.per_s:>8.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--in-flight", type=int, default=16)
    args = parser.parse_args()
    held_out = digits_splits().held_out
    x, y = np.tile(held_out.x, (8, 1))[: args.requests], np.tile(held_out.y, 8)[: args.requests]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="stratus-foreign-bench-") as tmp:
        for stack, cloud in (
            ("Stratus gateway (ORT)", stratus_cloud),
            ("Triton/PyTriton (ORT)", triton_cloud),
        ):
            log_dir = Path(tmp) / stack.split()[0].lower()
            with cloud(log_dir) as (address, flags), cascade(address, flags, log_dir) as router:
                rows += measure(router, stack, x, y, args.in_flight)
    print_rows(rows, in_flight=args.in_flight, count=len(x))


if __name__ == "__main__":
    main()
