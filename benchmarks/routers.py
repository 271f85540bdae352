"""Two routers under open-loop load through a rolling restart and a crash.

Starts a cloud gateway, two routers and three agents linked to both, then sends the digits
held-out split at a steady rate from clients using gRPC's round_robin over both routers
with health checking (each request with a 1 s budget and a 5 s client deadline). Phases:
steady; router A stopped with SIGTERM (a rolling update); router A back; router B killed
with SIGKILL; after the crash. Per phase: sent, answered, degraded, failed, lost (no answer
at all; must be 0), p99.

    python benchmarks/routers.py [--rate 150] [--phase-seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import QUIET, OpenLoop, launch_agent, make_requests, print_phases, run_phases  # noqa: E402

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.devtools.launcher import Launched, free_port, launch  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402

# round_robin over the routers, watching each one's health: a stopping router turns
# NOT_SERVING before it refuses calls, and new calls go to the other.
SERVICE_CONFIG = {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}


class TwoRouters:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.cloud = launch(
            ["cloud", "--listen", f"127.0.0.1:{free_port()}", "--models", str(ROOT / "models"), *QUIET],
            role="cloud",
            log_dir=log_dir,
        )
        self.addresses = {name: f"127.0.0.1:{free_port()}" for name in ("a", "b")}
        self.routers = {name: self._router(name) for name in self.addresses}
        both = ",".join(self.addresses.values())
        self.agents = [
            launch_agent(both, name, log_dir, tier=tier)
            for name, tier in (("device-1", "device"), ("device-2", "device"), ("edge-1", "edge"))
        ]
        for address in self.addresses.values():
            wait_for_agents(address, 3)

    def _router(self, name: str) -> Launched:
        return launch(
            [
                "router",
                "--listen",
                self.addresses[name],
                "--cloud",
                self.cloud.address,
                "--no-advertise",
                *QUIET,
            ],
            role=f"router-{name}",
            log_dir=self.log_dir,
        )

    def sigterm_a(self) -> None:
        code = self.routers["a"].stop()
        print(f"router a exited with {code}")

    def restart_a(self) -> None:
        self.routers["a"] = self._router("a")
        wait_for_agents(self.addresses["a"], 3)

    def sigkill_b(self) -> None:
        self.routers["b"].kill()

    def stop(self) -> None:
        for process in [*self.agents, *self.routers.values(), self.cloud]:
            process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=150.0, help="requests per second")
    parser.add_argument("--phase-seconds", type=float, default=5.0)
    args = parser.parse_args()
    requests = make_requests(digits_splits().held_out.x, budget_ms=1000.0)
    with tempfile.TemporaryDirectory(prefix="stratus-routers-") as logs:
        fleet = TwoRouters(Path(logs))
        try:
            generator = OpenLoop(
                "ipv4:" + ",".join(fleet.addresses.values()),
                requests,
                rate=args.rate,
                channel_options=[("grpc.service_config", json.dumps(SERVICE_CONFIG))],
            )
            phases = [
                ("steady", lambda: None),
                ("router a SIGTERMed", fleet.sigterm_a),
                ("router a back", fleet.restart_a),
                ("router b SIGKILLed", fleet.sigkill_b),
                ("after the crash", lambda: None),
            ]
            results = asyncio.run(run_phases(generator, phases, args.phase_seconds))
        finally:
            fleet.stop()
    print_phases(results)


if __name__ == "__main__":
    main()
