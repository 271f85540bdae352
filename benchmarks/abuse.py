"""The security review's attacks, each at its strongest within today's limits, against a live fleet.

A real fleet on loopback (a cloud gateway, a router with agent and operator tokens and the
OpenAI API, two device agents and an edge agent) serves legitimate digits traffic at 100 req/s
from a process of its own, which also pings ServerLive every 20 ms and samples the router's
RSS from /proc. Each attack runs for ``--duration-s`` while that goes on; then one row says what
the attack did, what it got, and whether the legitimate side stayed within the goals:

- no legitimate request failed in the window (an attack may cost the cloud, never a client);
- ServerLive never took 100 ms or more (nothing a stranger sends stalls the router's loop);
- the router's RSS grew by less than 50 MB (nothing a stranger sends is kept, or amplified).

It measures and does not assert: an attack outside the goals is a FAIL row, not an error; the
exit code is 0 unless the fleet does not start.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/abuse.py [--only F5,F6] [--duration-s 5]

The fleet's flags are built in one place (:func:`role_args`); the attacks are one function
each, listed in :data:`ATTACKS` in the order they run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from abuse_fleet import (  # noqa: E402
    AGENTS,
    LEGIT_RATE,
    MAX_FAILED,
    MAX_LIVE_MS,
    MAX_RSS_MB,
    PROBE_EVERY_S,
    TAIL_S,
    LegitSide,
    Tokens,
    WindowReport,
    start_fleet,
)
from abuse_kit import Context, Outcome  # noqa: E402
from abuse_membership import (  # noqa: E402
    baseline,
    f1_rogue_hello,
    f1_stolen_token_takeover,
    f2_conflicting_family,
    f3_drain_reload,
    f12_hello_flood,
    f13_silent_streams,
    f16_watchers,
    n2_insider_router,
    n3_black_hole,
)
from abuse_requests import (  # noqa: E402
    f5_many_inputs,
    f6_int64_contents,
    f7_huge_prompt,
    f11_unread_streams,
    f14_openai,
    f15_cloud_direct,
    f18_huge_shape,
    f21_huge_budget,
    n1_silent_inference_streams,
)

from stratus.cli.demo import wait_for_agents  # noqa: E402

# ---------------------------------------------------------------------------------------------
# The fleet


# ---------------------------------------------------------------------------------------------
# The legitimate side: its own process, so that an attacker's CPU (building a 4 MiB message)
# never delays a probe or a request here. Every event is stamped with time.monotonic, which is
# one clock for every process on Linux, so the attacker asks for a window by its own times.


# ---------------------------------------------------------------------------------------------
# Attack helpers


# ---------------------------------------------------------------------------------------------
# The attacks, one function each: what it sends, as hard as today's limits allow.


@dataclass(frozen=True)
class Attack:
    key: str
    name: str
    run: Callable[[Context], Awaitable[Outcome | None]]


# The order they run in: F12 leaves its agents listed as lost (kept for status, by design), so
# it runs late; F16 runs on the plain fleet and again over what F12 left, as an attacker would.
ATTACKS: tuple[Attack, ...] = (
    Attack("base", "baseline", baseline),
    Attack("F1", "rogue Hello", f1_rogue_hello),
    Attack("F1b", "stolen-token takeover", f1_stolen_token_takeover),
    Attack("F2", "conflicting family", f2_conflicting_family),
    Attack("F3", "Drain/Reload loop", f3_drain_reload),
    Attack("F5", "thousands of inputs", f5_many_inputs),
    Attack("F6", "INT64 contents", f6_int64_contents),
    Attack("F7", "message-size prompt", f7_huge_prompt),
    Attack("F11", "unread stream", f11_unread_streams),
    Attack("F13", "silent AgentLinks", f13_silent_streams),
    Attack("F14", "OpenAI API", f14_openai),
    Attack("F15", "cloud direct", f15_cloud_direct),
    Attack("F18", "huge empty shape", f18_huge_shape),
    Attack("F21", "huge budget", f21_huge_budget),
    Attack("N1", "silent inference streams", n1_silent_inference_streams),
    Attack("N2", "agent key serving as a router", n2_insider_router),
    Attack("N3", "black hole declaring 1,024", n3_black_hole),
    Attack("F16", "Watch flood", f16_watchers),
    Attack("F12", "Hello flood", f12_hello_flood),
    Attack("F16", "Watch flood after F12", f16_watchers),
)


# ---------------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True)
class Row:
    attack: Attack
    outcome: Outcome
    report: WindowReport
    seconds: float
    seen: dict[str, str]

    @property
    def passed(self) -> bool:
        return (
            self.report.failed <= MAX_FAILED
            and self.report.worst_live_ms < MAX_LIVE_MS
            and self.report.growth("router") < MAX_RSS_MB
        )


WIDTHS = (28, 48, 70, 12, 7, 14, 5)
HEADERS = (
    "attack",
    "what it did",
    "the attack's own outcome",
    "legit s/fail",
    "live ms",
    "RSS pk/end",
    "goals",
)


def print_header(duration_s: float) -> None:
    print(f"goals per window: legit failed <= {MAX_FAILED}, worst ServerLive < {MAX_LIVE_MS:g} ms, "
          f"router RSS growth < {MAX_RSS_MB:g} MB (peak in window minus start)")  # fmt: skip
    print(f"legit load {LEGIT_RATE:g} req/s digits through the router; ServerLive probed every "
          f"{PROBE_EVERY_S * 1000:g} ms; attack windows {duration_s:g} s + {TAIL_S:g} s tail")  # fmt: skip
    print(" ".join(h.ljust(w) for h, w in zip(HEADERS, WIDTHS, strict=True)))
    print(" ".join("-" * w for w in WIDTHS))


def print_row(row: Row) -> None:
    report = row.report
    cells = (
        f"{row.attack.name} ({row.attack.key})",
        row.outcome.did,
        row.outcome.result,
        f"{report.sent}/{report.failed}",
        f"{report.worst_live_ms:.0f}",
        f"{report.growth('router'):+.0f}/{report.rss_end_mb.get('router', 0) - report.rss_start_mb.get('router', 0):+.0f} MB",
        "PASS" if row.passed else "FAIL",
    )
    print(" ".join(c.ljust(w) for c, w in zip(cells, WIDTHS, strict=True)), flush=True)
    if report.failures:
        print(f"{'':>29}legit failures: {', '.join(f'{k} {v}' for k, v in report.failures.items())}")
        for code, details in report.failure_details.items():
            print(f"{'':>31}{code}: {details[:108]}")
    for code, details in row.seen.items():
        print(f"{'':>29}{code}: {details[:110]}")
    cloud = report.growth("cloud")
    if cloud >= MAX_RSS_MB:
        print(f"{'':>29}cloud RSS +{cloud:.0f} MB (peak)")


async def run_one(attack: Attack, ctx: Context, legit: LegitSide) -> Row | None:
    ctx.window_start = 0.0
    ctx.seen.clear()
    started = time.monotonic()
    try:
        outcome = await asyncio.wait_for(attack.run(ctx), timeout=ctx.duration_s + 120)
    except Exception as exc:  # a benchmark reports what an attack could not do, and goes on
        outcome = Outcome("(the attack itself failed)", f"{type(exc).__name__}: {str(exc)[:60]}")
    if outcome is None:
        print(f"{attack.name} ({attack.key}): skipped, the fleet serves no generative family (arith)")
        return None
    ended = time.monotonic()
    await asyncio.sleep(TAIL_S)
    report = await asyncio.to_thread(legit.report, ctx.window_start or started, ended + TAIL_S)
    return Row(attack=attack, outcome=outcome, report=report, seconds=ended - started, seen=dict(ctx.seen))


async def settle(ctx: Context) -> None:
    """Wait until the fleet is whole again, so that the next attack starts from the same place."""
    with contextlib.suppress(Exception):
        await asyncio.to_thread(wait_for_agents, ctx.router, len(AGENTS), 30.0)
    await asyncio.sleep(0.5)


async def run_all(attacks: Iterable[Attack], ctx: Context, legit: LegitSide) -> list[Row]:
    rows = []
    for attack in attacks:
        row = await run_one(attack, ctx, legit)
        if row is not None:
            print_row(row)
            rows.append(row)
        await settle(ctx)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated attack keys, e.g. F5,F6 (default: all)")
    parser.add_argument("--duration-s", type=float, default=5.0, help="each attack's window (default 5)")
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="keep the fleet's logs here (default: dropped)"
    )
    args = parser.parse_args()
    wanted = {k.strip().upper() for k in args.only.split(",") if k.strip()}
    attacks = [a for a in ATTACKS if not wanted or a.key.upper() in wanted or a.key == "base"]
    with tempfile.TemporaryDirectory(prefix="stratus-abuse-") as folder:
        tokens = Tokens.write(Path(folder))
        try:
            fleet = start_fleet(args.log_dir or Path(folder) / "logs", tokens)
        except Exception as exc:
            print(f"abuse: the fleet did not start: {exc}", file=sys.stderr)
            return 1
        legit = LegitSide(
            fleet.legit_address, {"router": fleet.router.process.pid, "cloud": fleet.cloud.process.pid}
        )
        try:
            time.sleep(2.0)  # the legitimate side warms its channel and the fleet's curves
            print_header(args.duration_s)
            rows = asyncio.run(run_all(attacks, Context(fleet=fleet, duration_s=args.duration_s), legit))
        finally:
            legit.stop()
            fleet.stop()
    attacked = [r for r in rows if r.attack.key != "base"]
    print(f"\n{sum(r.passed for r in attacked)} of {len(attacked)} attacks within goals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
