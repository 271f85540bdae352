"""What every Stratus process shares: logging, signals, and saying where it listens.

A process started by a launcher (the demo, tests, benchmarks) prints exactly one line
``STRATUS READY <role> <host:port>`` on stdout once it serves, so the parent learns the
port that was chosen at run time without racing for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

READY_PREFIX = "STRATUS READY"
# Set by stratus.devtools.launcher: the pid of the process that started this one, which
# this one outlives only by stopping (stop_with_parent).
PARENT_PID_ENV = "STRATUS_PARENT_PID"
PARENT_CHECK_S = 1.0

log = logging.getLogger("stratus.process")


def quiet_grpc_core(environ: MutableMapping[str, str]) -> None:
    """Keep gRPC's C core to its errors, unless the user set GRPC_VERBOSITY or GRPC_TRACE.

    At its default it writes INFO lines of its own to stderr, in its own format and beside
    Stratus's log: a failed TLS handshake (which the peer's log already says in words), or
    "skipping fork() handlers" when a runtime forks during a reload. The C core reads these
    variables once, when grpc is first imported: call this before that.
    """
    if "GRPC_VERBOSITY" not in environ and "GRPC_TRACE" not in environ:
        environ["GRPC_VERBOSITY"] = "ERROR"


class JsonLines(logging.Formatter):
    """One JSON object per record (``--log-format json``), for log pipelines: time, level,
    logger, message, and the exception's traceback as one field where there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str = "INFO", log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonLines())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def announce(role: str, address: str) -> None:
    """Say the process serves, once it is started (and settle what starting made, first)."""
    settle_heap()
    print(f"{READY_PREFIX} {role} {address}", flush=True)


def settle_heap() -> None:
    """Move every object made while starting (modules, models, tables: they live as long as
    the process) out of the cyclic collector's reach. A full collection scanned them all: on a
    router about 147,000 objects, one pause of 60-100 ms every few thousand requests and ~13 us
    a request on average (issue 37). Refcounting still frees them; only a reference cycle among
    them would stay, which is what the permanent tables are."""
    gc.collect()  # what starting left as garbage goes now, not into the frozen generation
    gc.freeze()


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop``; the component then shuts down in its own order.

    SIGHUP (a closed terminal, or an operator used to agents reloading on it) is logged and
    ignored rather than killing the process; agents and cloud gateways set their own handler
    (a reload of their models folder)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    stop_with_parent(stop, os.environ)
    with contextlib.suppress(NotImplementedError, AttributeError):  # no SIGHUP off POSIX
        loop.add_signal_handler(signal.SIGHUP, _ignored_hangup)


def stop_with_parent(stop: asyncio.Event, environ: MutableMapping[str, str], every_s: float = PARENT_CHECK_S) -> bool:
    """Where a launcher started this process (``PARENT_PID_ENV``), set ``stop`` once that
    launcher is gone (this process is handed to another parent), as SIGTERM would: a killed
    test run or demo leaves no fleet serving behind it. Polled, not ``PR_SET_PDEATHSIG``,
    which fires when the launching *thread* ends. Whether it watches: not when the variable
    names another process than this one's parent (it was inherited from further up)."""
    expected = environ.get(PARENT_PID_ENV, "")
    if not expected.isdigit() or os.getppid() != int(expected):
        return False
    loop = asyncio.get_running_loop()

    def check() -> None:
        if os.getppid() != int(expected):
            log.warning("the process that started this one (pid %s) is gone: stopping", expected)
            stop.set()
        elif not stop.is_set():
            loop.call_later(every_s, check)

    loop.call_later(every_s, check)
    return True


def _ignored_hangup() -> None:
    logging.getLogger("stratus.process").warning(
        "SIGHUP ignored: this process has nothing to reload (agents and cloud gateways reload their "
        "models on it); stop it with SIGTERM"
    )


def start_collapsed(
    pending: set[asyncio.Task[Any]], make: Callable[[], Coroutine[Any, Any, Any]], *, name: str
) -> bool:
    """Start ``make()`` as a task unless two are pending (one running, one waiting behind it):
    the waiting one reads the models folder after the running one ends, so a third would add
    nothing, and a burst of SIGHUPs or Reloads costs two. False when this one joined those."""
    if len(pending) >= 2:
        return False
    task = asyncio.create_task(make(), name=name)
    pending.add(task)
    task.add_done_callback(pending.discard)
    return True


def process_uptime_s() -> float | None:
    """How long this process has run, from the kernel's record of its start (Linux); None
    where that cannot be read. An agent reports it, so an operator sees restarts."""
    try:
        stat = Path("/proc/self/stat").read_text(encoding="ascii")
        # Fields after the command name (which may hold spaces) start at field 3; starttime is 22.
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def raise_open_files_limit() -> int:
    """Lift this process's open-file limit to its hard limit: one socket per linked agent.

    A router holding thousands of AgentLink streams (or a process simulating thousands of
    agents) needs a descriptor for each; distributions often default the soft limit to 1024.
    """
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return int(soft)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (10-20% less per-hop overhead), else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run(main: Awaitable[T]) -> T:
    """Run a component's main coroutine on a fresh loop that this process owns; its result."""
    loop = new_event_loop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
