"""A board without internet installs the agent from one bundle (issue 22 item 4): built here
for this machine's platform, installed offline into a fresh prefix, and serving the fleet."""

from __future__ import annotations

import platform
import subprocess
import sys
import tarfile
from pathlib import Path

from stratus.devtools.launcher import launch

from .cluster import Cluster, fleet_status, infer, ready_count, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _checkout_listing() -> set[str]:
    """The checkout's top level and build/ (where `make mutation` may have left its work)."""
    build = ROOT / "build"
    return {p.name for p in ROOT.iterdir()} | ({f"build/{p.name}" for p in build.iterdir()} if build.exists() else set())


def test_an_agent_installed_offline_from_its_bundle_serves(cluster: Cluster, tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    bundle = tmp_path / "agent.tar.gz"
    before = _checkout_listing()
    built = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "agent_bundle.py"), "--platform", platform.machine(),
         "--python", f"{sys.version_info.major}.{sys.version_info.minor}", "--out", str(bundle)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    assert _checkout_listing() == before  # the checkout is left as it was
    with tarfile.open(bundle) as archive:
        names = archive.getnames()
        archive.extractall(tmp_path, filter="data")
    assert "stratus-agent/install.sh" in names and "stratus-agent/stratus-agent.service" in names
    assert any(n.startswith("stratus-agent/wheels/stratus_router-") for n in names)
    assert "stratus-agent/models/digits/family.toml" in names
    assert not any(n.endswith(".py") for n in names if "/models/" in n)
    prefix = tmp_path / "opt-stratus"
    # Offline: no index, no proxy, nothing of this machine's environment.
    installed = subprocess.run(
        ["sh", str(tmp_path / "stratus-agent" / "install.sh"), str(prefix)],
        capture_output=True, text=True, timeout=600, check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_NO_INDEX": "1"},
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert f"installed: {prefix}/bin/stratus" in installed.stdout
    router = cluster.router().address
    agent = launch(
        ["agent", "--tier", "device", "--models", str(prefix / "models"), "--router", router, "--name", "board-1",
         "--cache-dir", str(tmp_path / "cache")],
        role="board-1", log_dir=cluster.log_dir, python=[str(prefix / "bin" / "python"), "-I"],
    )  # fmt: skip
    cluster.processes.append(agent)
    wait_until(lambda: ready_count(router) == 1, timeout_s=60)
    _, served = infer(router, digits.held_out.x[:4], max_tier="device")
    assert served.agent == "board-1"
    (board,) = fleet_status(router).agents
    assert list(board.runtimes) == ["litert"]  # the bundle's runtime: no ONNX Runtime, OpenVINO or llama.cpp
    assert any(u.startswith("arith") for u in board.unavailable)  # left out, saying why
