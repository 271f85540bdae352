"""Launched processes never outlive what launched them (tests2 1.7e): each runs in a
process group of its own that stopping it ends, and stops when its launcher dies."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from stratus.devtools.launcher import launch
from stratus.process import PARENT_PID_ENV, stop_with_parent

from .cluster import wait_until


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has ended: only its parent has not read its status yet
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def test_stopping_a_launched_process_ends_what_it_left_in_its_group(tmp_path: Path) -> None:
    spawner = launch([], role="spawner", log_dir=tmp_path, module="tests.integration.spawner")
    child = int(re.findall(r"child (\d+)", spawner.log())[0])
    assert alive(child) and os.getpgid(child) == spawner.process.pid != os.getpgid(0)
    assert spawner.stop() == 0  # it exited on SIGTERM by itself, leaving its child running
    wait_until(lambda: not alive(child), timeout_s=10)


def test_a_launched_router_stops_when_its_launcher_dies(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from stratus.devtools.launcher import launch\n"
        f"r = launch(['router', '--listen', '127.0.0.1:0', '--no-advertise'], role='router', log_dir=Path({str(tmp_path)!r}))\n"
        "print(r.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        router = int(launcher.stdout.readline())
        assert alive(router)
        launcher.send_signal(signal.SIGKILL)  # a test run killed: nobody calls stop()
        launcher.wait()
        wait_until(lambda: not alive(router), timeout_s=20)
        assert "the process that started this one" in (tmp_path / "router.log").read_text()
    finally:
        launcher.kill()
        launcher.wait()
        if launcher.stdout:
            launcher.stdout.close()


def test_only_the_parent_named_is_watched() -> None:
    async def watches(environ: dict[str, str]) -> bool:
        return stop_with_parent(asyncio.Event(), environ)

    assert asyncio.run(watches({PARENT_PID_ENV: str(os.getppid())}))
    assert not asyncio.run(watches({PARENT_PID_ENV: str(os.getpid())}))  # inherited from further up
    assert not asyncio.run(watches({}))


def test_another_checkouts_code_runs_from_its_own_folder(tmp_path: Path) -> None:
    """``python -m`` imports from its working folder before PYTHONPATH: benchmarks/peers.py's
    --baseline-tree ran this checkout's router under another's name until it was given ``cwd``."""
    tree = tmp_path / "tree"
    (tree / "stratus").mkdir(parents=True)
    (tree / "stratus" / "__init__.py").write_text("")
    (tree / "stratus" / "cli.py").write_text(
        "import time\nprint('STRATUS READY the-other-tree', flush=True)\ntime.sleep(600)\n"
    )
    other = launch([], role="other", log_dir=tmp_path, env={"PYTHONPATH": str(tree)}, cwd=tree, timeout=30)
    try:
        assert other.address == "the-other-tree"
    finally:
        other.kill()
