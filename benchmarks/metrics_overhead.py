"""What Prometheus scraping costs the router: throughput with and without a scraper.

Starts a router (with ``--metrics``) and two device agents, then drives ``digits-small``
requests with 64 in flight (closed loop) in alternating rounds: with a scraper reading
``/metrics`` every second, and without. Prints req/s and p99 per round and the ratio.

Target: scraping every second slows the router by no more than 3%.

    python benchmarks/metrics_overhead.py [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import QUIET, drive, launch_agent  # noqa: E402

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.convert import codec  # noqa: E402
from stratus.devtools.launcher import free_port, launch  # noqa: E402
from stratus.process import new_event_loop  # noqa: E402
from stratus.wire import inference_pb2 as pb  # noqa: E402

_SCRAPE_LOOP = """
import sys, time, urllib.request
while True:
    time.sleep(float(sys.argv[2]))
    with urllib.request.urlopen("http://" + sys.argv[1] + "/metrics", timeout=5) as response:
        response.read()
"""


class Scraper:
    """Reads /metrics every ``interval_s`` from its own process, as Prometheus would (a
    thread in this process would slow the load generator, not the router)."""

    def __init__(self, address: str, interval_s: float = 1.0) -> None:
        self._args = [sys.executable, "-c", _SCRAPE_LOOP, address, str(interval_s)]
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Scraper:
        self._process = subprocess.Popen(self._args)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    request = pb.ModelInferRequest(model_name="digits-small")
    codec.encode_request_inputs(
        request, {"input": np.random.default_rng(0).random((1, 64), dtype=np.float32)}
    )
    metrics = f"127.0.0.1:{free_port()}"
    rows: dict[str, list[tuple[float, float]]] = {"scraped every 1 s": [], "not scraped": []}
    with tempfile.TemporaryDirectory(prefix="stratus-metrics-") as logs:
        log_dir = Path(logs)
        router = launch(
            ["router", "--listen", "127.0.0.1:0", "--no-advertise", "--metrics", metrics, *QUIET],
            role="router",
            log_dir=log_dir,
        )
        agents = [launch_agent(router.address, f"device-{i}", log_dir) for i in (1, 2)]
        try:
            wait_for_agents(router.address, 2)
            loop = new_event_loop()
            for _ in range(args.rounds):
                for name, runs in rows.items():
                    scraper = Scraper(metrics) if name.startswith("scraped") else None
                    if scraper is not None:
                        scraper.__enter__()
                    run = loop.run_until_complete(
                        drive(router.address, in_flight=64, seconds=args.seconds, request=request)
                    )
                    if scraper is not None:
                        scraper.__exit__()
                    runs.append((run.throughput, float(np.percentile(run.latencies_ms, 99))))
            loop.close()
        finally:
            for process in [*agents, router]:
                process.stop()
    print(f"{'router':<20}{'req/s (median)':>16}{'p99 ms (median)':>17}")
    medians = {}
    for name, runs in rows.items():
        medians[name] = statistics.median(r[0] for r in runs)
        print(f"{name:<20}{medians[name]:>16.0f}{statistics.median(r[1] for r in runs):>17.1f}")
    ratio = medians["scraped every 1 s"] / medians["not scraped"]
    print(f"\nscraped / not scraped throughput: {ratio:.3f} (target >= 0.97)")


if __name__ == "__main__":
    main()
