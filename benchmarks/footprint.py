"""What a device agent weighs: resident memory after warm-up, and time until registered.

Starts a router, then one device agent per runtime (``--runtimes litert``, then
``onnxruntime``, then ``openvino``), each as its own process. For each: seconds from
starting the process to the router listing it ready, resident memory (VmRSS) after 300
requests through the router, and which runtime libraries the process mapped (read from
``/proc/PID/maps``: a LiteRT agent must not map OpenVINO or ONNX Runtime).

Targets (LiteRT-only device agent): RSS after warm-up <= 80 MB, registered <= 1.5 s.

    python benchmarks/footprint.py [--runs 3]
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import launch_agent  # noqa: E402

from stratus import codec  # noqa: E402
from stratus.launcher import Launched, launch  # noqa: E402
from stratus.serving import grpc_options  # noqa: E402
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


def warm_up(router: str, requests: int = 300) -> None:
    request = pb.ModelInferRequest(model_name="digits-small")
    codec.encode_request_inputs(
        request, {"input": np.random.default_rng(0).random((1, 64), dtype=np.float32)}
    )
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(requests):
            stub.ModelInfer(request, timeout=10)


def measure(router: Launched, runtime: str, log_dir: Path, index: int) -> tuple[float, float, list[str]]:
    name = f"{runtime}-{index}"
    started = time.perf_counter()
    agent = launch_agent(router.address, name, log_dir, "--runtimes", runtime)
    try:
        registered = wait_registered(router.address, name, started)
        warm_up(router.address)
        return registered, rss_mb(agent.process.pid), mapped_runtimes(agent.process.pid)
    finally:
        agent.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="agents started per runtime")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="stratus-footprint-") as logs:
        log_dir = Path(logs)
        router = launch(
            ["router", "--listen", "127.0.0.1:0", "--no-advertise", "--log-level", "WARNING"],
            role="router",
            log_dir=log_dir,
        )
        try:
            for runtime in ("litert", "onnxruntime", "openvino"):
                runs = [measure(router, runtime, log_dir, i) for i in range(args.runs)]
                rows.append(
                    (
                        runtime,
                        statistics.median(r[0] for r in runs),
                        max(r[0] for r in runs),
                        statistics.median(r[1] for r in runs),
                        runs[-1][2],
                    )
                )
        finally:
            router.stop()
    print(
        f"{'--runtimes':<13}{'registered s (median)':>22}{'(worst)':>9}{'RSS MB':>9}  runtime libraries mapped"
    )
    for runtime, registered, worst, rss, mapped in rows:
        print(f"{runtime:<13}{registered:>22.2f}{worst:>9.2f}{rss:>9.1f}  {', '.join(mapped) or '-'}")
    print("\ntargets (litert): RSS <= 80 MB after warm-up; registered <= 1.5 s after the process starts")


if __name__ == "__main__":
    main()
