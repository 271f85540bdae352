"""Device agents on ARM64 boards, emulated: an aarch64 agent in a Debian arm64 chroot under
QEMU (scripts/arm64_env.py) linked to an x86 router on loopback, against x86 agents.

On a Cortex-A72 (Raspberry Pi 4 class: no dot product, no FP16 arithmetic) it serves FP32 and
must agree with an x86 agent item by item; on a Cortex-A76 (Pi 5 class, ARMv8.2) and a
Neoverse-N1 (server class: Graviton2, Altra) it must choose the INT8 child from what the
emulated CPU itself reports, and answer as the x86 INT8 agent does. All run LiteRT, the device
tier's runtime on a board. The aarch64 bundle (scripts/agent_bundle.py) is installed offline
inside the chroot, as on a board, and its agent serves. The emulator bounds correctness, not
speed: the figures printed (time to registered, RSS, p50) are emulated ones.

``make test`` (and ``make test-arm64``) build the chroot when it is not cached (about 4 min)
and run this; only a kernel where binfmt_misc cannot be mounted skips it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from stratus.convert import codec
from stratus.devtools.launcher import Launched
from tests.scripts import load

from .cluster import Cluster, fleet_status, infer, ready_count, wait_until

ITEMS = 200
FP32_TOLERANCE = 1e-5
# An INT8 softmax is quantised in steps of 1/256; the aarch64 kernels (dot product) and the x86
# ones (whatever this host's CPU runs: AVX2, VNNI, AMX) may round an item one step apart.
INT8_TOLERANCE = 1 / 256 + 1e-7
# The x86 agents stand in for the two kinds of CPU (the choice on this host's own CPU aside).
AVX2_ONLY = {"STRATUS_CPU_FLAGS": "avx2,fma,f16c"}
VNNI = {"STRATUS_CPU_FLAGS": "avx2,fma,f16c,avx512f,avx512_vnni"}
LITERT = ("--runtimes", "litert")


arm64_env = load("arm64_env")


@dataclass(frozen=True)
class Answers:
    """One agent's answers to the held-out digits, one request per item, through the router."""

    agent: str
    variants: frozenset[str]
    probabilities: np.ndarray  # (ITEMS, 10)
    latency_ms: np.ndarray  # (ITEMS,), client-side round trips

    @property
    def p50_ms(self) -> float:
        return float(np.percentile(self.latency_ms, 50))


@pytest.fixture(scope="module")
def chroot() -> Path:
    """The chroot, built when missing (binfmt mounted, its venv current); a skip only where this
    kernel cannot run aarch64 programs, and any other failure fails, saying why."""
    try:
        return Path(arm64_env.ensure(say=lambda message: None))
    except arm64_env.Unsupported as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def site(chroot: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    """A cloud gateway and a router on the host, shared by the module's agents."""
    cluster = Cluster(tmp_path_factory.mktemp("arm64-logs"))
    try:
        cloud = cluster.cloud()
        router = cluster.router("--cloud", cloud.address)
        yield cluster, router.address
    finally:
        cluster.stop_all()


def _answers(router: str, name: str, x: np.ndarray) -> Answers:
    rows, latency, variants = [], [], set()
    for item in x:
        started = time.perf_counter()
        response, served = infer(router, item[None, :], max_tier="device", timeout=30.0)
        latency.append((time.perf_counter() - started) * 1e3)
        assert served.agent == name, f"item answered by {served.agent}, not {name}"
        variants.add(served.variant)
        rows.append(codec.decode_response_outputs(response)["probabilities"][0])
    return Answers(name, frozenset(variants), np.asarray(rows), np.asarray(latency))


def _serve_alone(cluster: Cluster, router: str, name: str, x: np.ndarray, env: dict[str, str]) -> Answers:
    """Start one agent, take its answers, stop it (it must leave cleanly): one at a time, so the
    router has no other device agent to send the items to."""
    launched = cluster.agent(name, router, *LITERT, env=env)
    wait_until(lambda: ready_count(router) == 1, timeout_s=60)
    answers = _answers(router, name, x)
    assert launched.stop(timeout=30) == 0, launched.log()[-3000:]
    wait_until(lambda: ready_count(router) == 0)
    return answers


@pytest.fixture(scope="module")
def x86(site: tuple[Cluster, str], digits) -> dict[str, Answers]:  # type: ignore[no-untyped-def]
    """The x86 answers to compare with, FP32 and INT8."""
    cluster, router = site
    x = digits.held_out.x[:ITEMS].astype(np.float32)
    return {
        "FP32": _serve_alone(cluster, router, "x86-fp32", x, env=AVX2_ONLY),
        "INT8": _serve_alone(cluster, router, "x86-int8", x, env=VNNI),
    }


def _rss_mb(launched: Launched) -> float:
    """Resident memory of the agent: under emulation, QEMU's and the guest's together."""
    for line in Path(f"/proc/{launched.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _stratus(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "stratus.cli", *args], capture_output=True, text=True, timeout=30, check=True
    )
    return result.stdout


def _start_arm(cluster: Cluster, router: str, name: str, cpu: str) -> tuple[Launched, float]:
    started = time.monotonic()
    launched = cluster.agent(
        name,
        router,
        *LITERT,
        python=arm64_env.command(["python"], cpu=cpu),
        models=f"{arm64_env.TREE}/models",
    )
    wait_until(lambda: ready_count(router) == 1, timeout_s=60)
    return launched, time.monotonic() - started


def _agree(arm: Answers, x86: Answers, tolerance: float) -> str:
    """Top-1 on every item, and every probability within ``tolerance``: how close, in words."""
    top1 = arm.probabilities.argmax(axis=1) == x86.probabilities.argmax(axis=1)
    assert top1.all(), f"top-1 differs on items {np.flatnonzero(~top1).tolist()}"
    gaps = np.abs(arm.probabilities - x86.probabilities).max(axis=1)
    assert gaps.max() <= tolerance, f"max |Δp| {gaps.max():.2e} > {tolerance:.1e}"
    same = int((gaps == 0).sum())
    return f"{ITEMS}/{ITEMS} top-1, max |Δp| {gaps.max():.1e}, {same}/{ITEMS} items bit-identical"


def test_a_cortex_a72_agent_shows_as_aarch64_serves_fp32_and_agrees_with_x86(  # type: ignore[no-untyped-def]
    site: tuple[Cluster, str], x86: dict[str, Answers], digits
) -> None:
    cluster, router = site
    launched, registered_s = _start_arm(cluster, router, "arm-a72", "cortex-a72")
    rss = _rss_mb(launched)
    (agent,) = [a for a in fleet_status(router).agents if a.id == "arm-a72"]
    assert (agent.hardware.machine, agent.hardware.cpu_model) == ("aarch64", "Cortex-A72")
    assert agent.hardware.flags_from == "hwcap" and list(agent.hardware.precisions) == ["FP32"]
    assert [v for v in agent.variants if v.startswith("digits-")] == ["digits-small"]
    table = _stratus("fleet", "status", "--router", router, "--agents")
    row = next(line for line in table.splitlines() if line.startswith("arm-a72 "))
    assert " aarch64 " in row and "ready" in row
    assert "arm-a72: runs on aarch64 Cortex-A72, fp32 only (hwcap: asimd)" in table
    listed = json.loads(_stratus("fleet", "status", "--router", router, "--json"))["agents"]
    shown = next(a for a in listed if a["id"] == "arm-a72")
    assert shown["state"] == "ready" and shown["hardware"]["machine"] == "aarch64"
    arm = _answers(router, "arm-a72", digits.held_out.x[:ITEMS].astype(np.float32))
    assert arm.variants == x86["FP32"].variants == {"digits-small"}
    agreement = _agree(arm, x86["FP32"], FP32_TOLERANCE)
    assert launched.stop(timeout=30) == 0, launched.log()[-3000:]
    print(
        f"\naarch64 (emulated Cortex-A72) FP32: registered {registered_s:.2f} s, RSS {rss:.0f} MB, "
        f"p50 {arm.p50_ms:.2f} ms (x86 {x86['FP32'].p50_ms:.2f} ms), {agreement}"
    )


@pytest.mark.parametrize(("cpu", "model"), [("cortex-a76", "Cortex-A76"), ("neoverse-n1", "Neoverse-N1")])
def test_an_armv8_2_agent_chooses_int8_from_its_dot_product_and_matches_x86_int8(  # type: ignore[no-untyped-def]
    site: tuple[Cluster, str], x86: dict[str, Answers], digits, cpu: str, model: str
) -> None:
    cluster, router = site
    name = f"arm-{cpu}"
    launched, registered_s = _start_arm(cluster, router, name, cpu)
    (agent,) = [a for a in fleet_status(router).agents if a.id == name]
    assert agent.hardware.cpu_model == model and agent.hardware.flags_from == "hwcap"
    assert {"asimddp", "asimdhp", "fphp"} <= set(agent.hardware.flags)
    assert list(agent.hardware.precisions) == ["INT8", "FP16", "FP32"]  # dot product and FP16 both
    assert [v for v in agent.variants if v.startswith("digits-")] == ["digits-small-int8"]
    choice = next(c for c in agent.variant_choices if c.startswith("digits-small-int8 "))
    assert "int8: native (cpu flags: asimddp, asimdhp, fphp)" in choice and ", computes int8 " in choice
    arm = _answers(router, name, digits.held_out.x[:ITEMS].astype(np.float32))
    assert arm.variants == x86["INT8"].variants == {"digits-small-int8"}
    agreement = _agree(arm, x86["INT8"], INT8_TOLERANCE)
    rss = _rss_mb(launched)
    assert launched.stop(timeout=30) == 0, launched.log()[-3000:]
    print(
        f"\naarch64 (emulated {model}) INT8: registered {registered_s:.2f} s, RSS {rss:.0f} MB, "
        f"p50 {arm.p50_ms:.2f} ms (x86 {x86['INT8'].p50_ms:.2f} ms), {agreement}"
    )


BUNDLE_ITEMS = 40


def test_the_aarch64_bundle_installs_offline_in_the_chroot_and_its_agent_serves(  # type: ignore[no-untyped-def]
    chroot: Path, site: tuple[Cluster, str], x86: dict[str, Answers], tmp_path: Path, digits
) -> None:
    """As on a board: scripts/agent_bundle.py --platform aarch64, copied in, install.sh with no
    index (the chroot has no network to one), and the installed agent, not the work tree, serves."""
    cluster, router = site
    bundle = tmp_path / "agent.tar.gz"
    subprocess.run(
        [sys.executable, "scripts/agent_bundle.py", "--platform", "aarch64", "--out", str(bundle)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    board = chroot / "tmp" / f"board-{os.getpid()}"
    shutil.rmtree(board, ignore_errors=True)
    board.mkdir(parents=True)
    try:
        with tarfile.open(bundle) as archive:
            archive.extractall(board, filter="data")
        inside = f"/tmp/{board.name}"
        alone = {"PYTHONPATH": ""}  # the work tree stays mounted, but off the path, as on a board
        install = ["/bin/sh", f"{inside}/stratus-agent/install.sh", f"{inside}/opt"]
        printed = arm64_env.run_in_chroot(install, env=alone)
        assert f"installed: {inside}/opt/bin/stratus (stratus " in printed, printed
        where = arm64_env.run_in_chroot(
            [f"{inside}/opt/bin/python", "-c", "import stratus; print(stratus.__file__)"], env=alone
        )
        assert where.strip().startswith(f"{inside}/opt/lib/"), where
        launched = cluster.agent(
            "arm-bundle",
            router,
            *LITERT,
            python=arm64_env.command([f"{inside}/opt/bin/python"], cpu="cortex-a72", env=alone),
            models=f"{inside}/opt/models",
        )
        wait_until(lambda: ready_count(router) == 1, timeout_s=60)
        x = x86["FP32"]
        arm = _answers(router, "arm-bundle", digits.held_out.x[:BUNDLE_ITEMS].astype(np.float32))
        assert arm.variants == {"digits-small"}
        top1 = arm.probabilities.argmax(axis=1) == x.probabilities[:BUNDLE_ITEMS].argmax(axis=1)
        assert (
            top1.all() and np.abs(arm.probabilities - x.probabilities[:BUNDLE_ITEMS]).max() <= FP32_TOLERANCE
        )
        assert launched.stop(timeout=30) == 0, launched.log()[-3000:]
        wait_until(lambda: ready_count(router) == 0)
    finally:
        shutil.rmtree(board, ignore_errors=True)

