"""Many agents in one process: the fleet-scale harness for benchmarks and tests.

Each simulated agent is a real :class:`edge_agent.agent.Agent` with its own channel (its
own TCP connection) and its own AgentLink stream: it says Hello, heartbeats at the pace
the router asks for, answers Work with a real inference and reconnects with jittered
backoff, so the router sees exactly the traffic that N real agents make. Only the loaded
models are shared, since N copies of one small model would measure nothing but memory.

    python -m edge_agent.simulate --router HOST:PORT --agents 1000 [--tier device]

Prints ``STRATUS READY simfleet <first agent name>`` once every agent has started (not
once every agent is linked: the router decides that, and says so in ``fleet status``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edge_agent.agent import Agent, load_models
from edge_agent.settings import AgentSettings
from stratus.execution.local_models import LocalModels
from stratus.process import announce, configure_logging, raise_open_files_limit, run, stop_on_signals
from stratus.tiers import Tier


@dataclass(frozen=True, kw_only=True)
class SimulatedFleet:
    """How many agents to run, and what each one looks like to the router."""

    router: str
    agents: int
    tier: Tier = Tier.DEVICE
    prefix: str = "sim"
    capacity: int = 2
    queue_limit: int = 64
    # Agents start spread over this window, as real devices power up over seconds.
    ramp_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.agents < 1:
            raise ValueError("a simulated fleet needs at least one agent")

    def names(self) -> list[str]:
        width = len(str(self.agents))
        return [f"{self.prefix}-{i:0{width}d}" for i in range(1, self.agents + 1)]

    def agent_settings(self, name: str) -> AgentSettings:
        return AgentSettings(
            tier=self.tier,
            router=self.router,
            name=name,
            concurrency=self.capacity,
            queue_limit=self.queue_limit,
        )


async def run_fleet(fleet: SimulatedFleet, models: LocalModels, stop: asyncio.Event) -> None:
    """Run every agent until ``stop``; each drains and leaves as a real agent would."""
    rng = random.Random(fleet.seed)
    names = fleet.names()
    agents = [Agent(fleet.agent_settings(name), models, rng=random.Random(rng.random())) for name in names]
    delays = sorted(rng.uniform(0.0, fleet.ramp_s) for _ in agents)

    async def start(agent: Agent, delay: float) -> None:
        await asyncio.sleep(delay)
        await agent.run(stop)

    tasks = [
        asyncio.create_task(start(agent, delay), name=f"stratus-sim-{agent.settings.name}")
        for agent, delay in zip(agents, delays, strict=True)
    ]
    announce("simfleet", names[0])
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edge_agent.simulate", description=__doc__)
    parser.add_argument("--router", required=True, help="HOST:PORT of the router")
    parser.add_argument("--agents", type=int, required=True)
    parser.add_argument("--tier", choices=["device", "edge"], default="device")
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--prefix", default="sim")
    parser.add_argument("--ramp-s", type=float, default=1.0)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "stratus")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    raise_open_files_limit()
    fleet = SimulatedFleet(
        router=args.router,
        agents=args.agents,
        tier=Tier.parse(args.tier),
        prefix=args.prefix,
        ramp_s=args.ramp_s,
    )
    models = load_models(
        args.models,
        tier=fleet.tier,
        variants=None,
        concurrency=2,
        queue_limit=fleet.queue_limit,
        runtimes=None,
        cache_dir=args.cache_dir,
    )

    async def body() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop)
        try:
            await run_fleet(fleet, models, stop)
        finally:
            models.close()

    run(body())
    return 0


if __name__ == "__main__":
    sys.exit(main())
