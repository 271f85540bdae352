"""Starting Stratus processes and learning their addresses: the demo, tests and benchmarks.

Each child is a real ``stratus`` process on loopback with port 0, which prints its bound
address once ready (see :mod:`stratus.process`). Its log goes to a file beside the others,
so a failing start can be explained.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stratus.errors import Unavailable
from stratus.process import PARENT_PID_ENV, READY_PREFIX


@dataclass
class Launched:
    role: str
    args: list[str]
    process: subprocess.Popen[str]
    log_path: Path
    address: str = ""

    def stop(self, *, timeout: float = 20.0) -> int:
        """SIGTERM, wait, then SIGKILL: the exit code it ended with. Whatever the process
        left running in its group (a server it started) is killed after it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._end_group()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._end_group()

    def _end_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its own group: launch() made one
        if self.process.stdout:
            self.process.stdout.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def free_port() -> int:
    """A loopback port free right now, for a process that must come back on the same one."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(
    args: Sequence[str],
    *,
    role: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    module: str = "stratus.cli",
    python: Sequence[str] | None = None,
    cwd: Path | None = None,
) -> Launched:
    """Start ``python -m MODULE ARGS`` (``stratus ARGS`` by default) and wait for its READY
    line, or its death, with its log.

    ``python`` is the command that runs Python: this interpreter by default, or one that runs
    it elsewhere (``scripts/arm64_env.py``: an emulated aarch64 chroot); it must exec Python in
    the end, so that the process started is the one that takes SIGTERM and gives the exit code.
    ``cwd``: where it runs; ``python -m`` imports from there before ``PYTHONPATH``, so another
    checkout's code runs only from its own folder.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{role}.log"
    # PARENT_PID_ENV: the child stops if this process dies without stopping it (a test run
    # killed), instead of serving on as an orphan; its own group lets stop() end what it started.
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid()), **(env or {})}
    with log_path.open("a") as log_file:
        process = subprocess.Popen(
            [*(python or [sys.executable]), "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            env=child_env,
            cwd=cwd,
            start_new_session=True,
        )
    launched = Launched(role=role, args=list(args), process=process, log_path=log_path)
    launched.address = _await_ready(launched, timeout)
    return launched


def _await_ready(launched: Launched, timeout: float) -> str:
    assert launched.process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(launched.process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.2):
                if launched.process.poll() is not None:
                    break
                continue
            line = launched.process.stdout.readline()
            if not line:
                break
            if line.startswith(READY_PREFIX):
                return line.split()[-1]
    finally:
        selector.close()
    launched.kill()
    raise Unavailable(f"{launched.role} did not become ready; its log:\n{launched.log()[-4000:]}")
