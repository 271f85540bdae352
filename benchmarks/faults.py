"""The demo fleet under steady load while things break: nothing may be lost.

Starts a cloud gateway, a router, two device agents and an edge agent on loopback and
sends the digits held-out split through the router at a steady rate (open loop, each
request with a 1 s budget and a 5 s client deadline). Phase by phase it SIGKILLs a
device agent, restarts it, restarts the router once, takes the cloud gateway away and
brings it back, and prints per phase: requests sent, answered, answered degraded, failed
with a clear error, lost (no answer at all; must be 0), and p99 latency of the answers.

    python benchmarks/faults.py [--rate 150] [--phase-seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import OpenLoop, launch_agent, make_requests, print_phases, run_phases  # noqa: E402

from stratus.cli.demo import wait_for_agents  # noqa: E402
from stratus.devtools.launcher import Launched, free_port, launch  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402

MODELS = ROOT / "models"
QUIET = ["--log-level", "WARNING"]


class Fleet:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.cloud_address = f"127.0.0.1:{free_port()}"
        self.router_address = f"127.0.0.1:{free_port()}"
        self.cloud = self._cloud()
        self.router = self._router()
        self.agents = {
            name: self._agent(name, tier)
            for name, tier in (("device-1", "device"), ("device-2", "device"), ("edge-1", "edge"))
        }
        wait_for_agents(self.router_address, 3)

    def _cloud(self) -> Launched:
        return launch(
            ["cloud", "--listen", self.cloud_address, "--models", str(MODELS), *QUIET],
            role="cloud",
            log_dir=self.log_dir,
        )

    def _router(self) -> Launched:
        return launch(
            [
                "router",
                "--listen",
                self.router_address,
                "--cloud",
                self.cloud_address,
                "--no-advertise",
                *QUIET,
            ],
            role="router",
            log_dir=self.log_dir,
        )

    def _agent(self, name: str, tier: str) -> Launched:
        return launch_agent(self.router_address, name, self.log_dir, tier=tier)

    def kill_agent(self) -> None:
        self.agents["device-1"].process.send_signal(signal.SIGKILL)
        self.agents["device-1"].process.wait()

    def restart_agent(self) -> None:
        self.agents["device-1"] = self._agent("device-1", "device")

    def restart_router(self) -> None:
        self.router.stop()
        self.router = self._router()

    def cloud_away(self) -> None:
        self.cloud.process.send_signal(signal.SIGKILL)
        self.cloud.process.wait()

    def cloud_back(self) -> None:
        self.cloud = self._cloud()

    def stop(self) -> None:
        for process in [*self.agents.values(), self.router, self.cloud]:
            process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=150.0, help="requests per second")
    parser.add_argument("--phase-seconds", type=float, default=6.0)
    args = parser.parse_args()
    requests = make_requests(digits_splits().held_out.x, budget_ms=1000.0)
    with tempfile.TemporaryDirectory(prefix="stratus-faults-") as logs:
        fleet = Fleet(Path(logs))
        try:
            phases = [
                ("steady", lambda: None),
                ("device agent SIGKILLed", fleet.kill_agent),
                ("device agent restarted", fleet.restart_agent),
                ("router restarted", fleet.restart_router),
                ("cloud gateway away", fleet.cloud_away),
                ("cloud gateway back", fleet.cloud_back),
            ]
            generator = OpenLoop(fleet.router_address, requests, rate=args.rate)
            results = asyncio.run(run_phases(generator, phases, args.phase_seconds))
        finally:
            fleet.stop()
    print_phases(results)


if __name__ == "__main__":
    main()
