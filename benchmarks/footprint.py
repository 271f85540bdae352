"""What a device agent weighs: resident memory after warm-up, and time until registered.

Starts a router, then one device agent per runtime (``--runtimes litert``, then
``onnxruntime``, then ``openvino``), each as its own process. For each: seconds from
starting the process to the router listing it ready, resident memory (VmRSS) after 300
requests through the router, and which runtime libraries the process mapped (read from
``/proc/PID/maps``: a LiteRT agent must not map OpenVINO or ONNX Runtime).

Targets (LiteRT-only device agent): RSS after warm-up <= 80 MB, registered <= 1.5 s.

``--arch aarch64`` adds the same LiteRT agent as an ARM64 board runs it, emulated: in the
Debian arm64 chroot of ``scripts/arm64_env.py`` (``make test-arm64`` builds it) under QEMU, as a
Cortex-A72 (Raspberry Pi 4 class, FP32) and a Cortex-A76 (Pi 5 class, INT8). Its rows are
labelled *emulated*: QEMU's own memory is in the RSS and every instruction is translated, so
they bound what a board needs (correctness, an upper bound on memory), not how fast it is.
p50 is the median round trip of the warm-up's requests through the router, one item each.

    python benchmarks/footprint.py [--runs 3] [--arch aarch64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from types import ModuleType  # noqa: E402

from loadgen import launch_agent  # noqa: E402

from stratus.convert import codec  # noqa: E402
from stratus.devtools.launcher import Launched, launch  # noqa: E402
from stratus.serving.channels import grpc_options  # noqa: E402
from stratus.wire import fleet_pb2 as fpb  # noqa: E402
from stratus.wire import fleet_pb2_grpc as fpb_grpc  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402
from stratus.wire import inference_pb2_grpc as pb_grpc  # noqa: E402

LIBRARIES = {
    "litert": "tensorflow_lite|_pywrap_tensorflow|litert",
    "onnxruntime": "onnxruntime",
    "openvino": "openvino",
}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def mapped_runtimes(pid: int) -> list[str]:
    import re

    maps = Path(f"/proc/{pid}/maps").read_text()
    return [name for name, pattern in LIBRARIES.items() if re.search(pattern, maps)]


def wait_registered(router: str, name: str, started: float, timeout_s: float = 30.0) -> float:
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        stub = fpb_grpc.FleetStub(channel)
        while time.perf_counter() - started < timeout_s:
            status = stub.Status(fpb.FleetStatusRequest(include_agents=True), timeout=2)
            if any(a.id == name and a.state == fpb.AGENT_STATE_READY for a in status.agents):
                return time.perf_counter() - started
            time.sleep(0.01)
    raise TimeoutError(f"{name} did not register within {timeout_s} s")


def warm_up(router: str, requests: int = 300) -> float:
    """Send ``requests`` one-item requests for the family (so an INT8 child answers where it was
    chosen); the median round trip, ms."""
    request = pb.ModelInferRequest(model_name="digits")
    codec.encode_request_inputs(
        request, {"input": np.random.default_rng(0).random((1, 64), dtype=np.float32)}
    )
    times = []
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(requests):
            started = time.perf_counter()
            stub.ModelInfer(request, timeout=10)
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


Measured = tuple[float, float, list[str], float]  # registered s, RSS MB, libraries mapped, p50 ms


def measure(router: Launched, runtime: str, log_dir: Path, index: int) -> Measured:
    name = f"{runtime}-{index}"
    started = time.perf_counter()
    agent = launch_agent(router.address, name, log_dir, "--runtimes", runtime)
    return _measured(router, agent, name, started)


def _measured(router: Launched, agent: Launched, name: str, started: float) -> Measured:
    try:
        registered = wait_registered(router.address, name, started, timeout_s=90.0)
        p50 = warm_up(router.address)
        return registered, rss_mb(agent.process.pid), mapped_runtimes(agent.process.pid), p50
    finally:
        agent.stop()


def arm64_env() -> ModuleType:
    """scripts/arm64_env.py, imported only when this run needs it."""
    import arm64_env  # scripts/ is on the path (above)

    return arm64_env


def measure_arm(router: Launched, env: ModuleType, cpu: str, log_dir: Path, index: int) -> Measured:
    """A LiteRT device agent in the emulated chroot, as ``cpu``."""
    name = f"aarch64-{cpu}-{index}"
    args = ["agent", "--tier", "device", "--models", f"{env.TREE}/models", "--router", router.address,
            "--name", name, "--runtimes", "litert", "--log-level", "WARNING"]  # fmt: skip
    started = time.perf_counter()
    agent = launch(args, role=name, log_dir=log_dir, python=env.command(["python"], cpu=cpu))
    return _measured(router, agent, name, started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="agents started per runtime")
    parser.add_argument(
        "--arch", choices=["x86_64", "aarch64"], default="x86_64",
        help="aarch64: add LiteRT agents in the emulated arm64 chroot (set up first if it is not)",
    )  # fmt: skip
    args = parser.parse_args()
    env = arm64_env() if args.arch == "aarch64" else None
    if env is not None:
        env.ensure()
    rows: list[tuple[str, float, float, float, list[str], float]] = []
    with tempfile.TemporaryDirectory(prefix="stratus-footprint-") as logs:
        log_dir = Path(logs)
        router = launch(
            ["router", "--listen", "127.0.0.1:0", "--no-advertise", "--log-level", "WARNING"],
            role="router",
            log_dir=log_dir,
        )
        try:
            for runtime in ("litert", "onnxruntime", "openvino"):
                rows.append(_row(runtime, [measure(router, runtime, log_dir, i) for i in range(args.runs)]))
            for cpu in ("cortex-a72", "cortex-a76") if env is not None else ():
                runs = [measure_arm(router, env, cpu, log_dir, i) for i in range(args.runs)]
                rows.append(_row(f"litert, aarch64 {cpu} (emulated)", runs))
        finally:
            router.stop()
    print(
        f"{'agent':<40}{'registered s (median)':>22}{'(worst)':>9}{'RSS MB':>9}{'p50 ms':>8}"
        "  runtime libraries mapped"
    )
    for label, registered, worst, rss, mapped, p50 in rows:
        print(
            f"{label:<40}{registered:>22.2f}{worst:>9.2f}{rss:>9.1f}{p50:>8.2f}  {', '.join(mapped) or '-'}"
        )
    print("\ntargets (litert, x86): RSS <= 80 MB after warm-up; registered <= 1.5 s after the process starts")
    if env is not None:
        print(
            "emulated rows: QEMU user-mode on this CPU; they bound correctness and memory, not a board's speed"
        )


def _row(label: str, runs: list[Measured]) -> tuple[str, float, float, float, list[str], float]:
    return (
        label,
        statistics.median(r[0] for r in runs),
        max(r[0] for r in runs),
        statistics.median(r[1] for r in runs),
        runs[-1][2],
        statistics.median(r[3] for r in runs),
    )


if __name__ == "__main__":
    main()
