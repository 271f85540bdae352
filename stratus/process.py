"""What every Stratus process shares: logging, signals, and saying where it listens.

A process started by a launcher (the demo, tests, benchmarks) prints exactly one line
``STRATUS READY <role> <host:port>`` on stdout once it serves, so the parent learns the
port that was chosen at run time without racing for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys

READY_PREFIX = "STRATUS READY"


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
    print(f"{READY_PREFIX} {role} {address}", flush=True)


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop``; the component then shuts down in its own order.

    SIGHUP (a closed terminal, or an operator used to agents reloading on it) is logged and
    ignored rather than killing the process; an agent sets its own handler (a reload)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(NotImplementedError, AttributeError):  # no SIGHUP off POSIX
        loop.add_signal_handler(signal.SIGHUP, _ignored_hangup)


def _ignored_hangup() -> None:
    logging.getLogger("stratus.process").warning(
        "SIGHUP ignored: this process has nothing to reload (agents reload their models on it); "
        "restart it to load new variants, or stop it with SIGTERM"
    )


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


def run(main: asyncio.Future[None] | object) -> None:
    """Run a component's main coroutine on a fresh loop that this process owns."""
    loop = new_event_loop()
    try:
        loop.run_until_complete(main)  # type: ignore[arg-type]
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
