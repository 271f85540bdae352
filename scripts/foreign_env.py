"""Other people's inference servers as the cloud tier: NVIDIA Triton (PyTriton), MLServer and
KServe's model server, each in a virtual environment of its own, and each started here on
loopback serving one ONNX file through ONNX Runtime.

Each pins grpcio and protobuf differently from Stratus (and from each other), so each lives
in ``.venv-<server>`` beside the project's ``.venv``; Stratus reaches them over gRPC only.
``ensure()`` creates an environment once, with pinned versions from the package registry,
and writes a marker; later calls see the marker and reuse it. One that cannot be installed
leaves ``.stratus-failed`` saying why, for the tests to skip with. ``start()`` runs a server
(scripts/foreign/) on free loopback ports and waits for its READY line.

    python scripts/foreign_env.py                       # set up (or reuse) all three
    python scripts/foreign_env.py serve triton FILE.onnx --name digits-large [--access-token T]

Nothing here imports Stratus, so any Python 3.11 runs it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # for vllm_env's process helpers, when imported by path
from vllm_env import _locked, _signal_group, free_port  # noqa: E402

SERVERS_DIR: Final = ROOT / "scripts" / "foreign"
MARKER_NAME: Final = ".stratus-foreign"
FAILED_NAME: Final = ".stratus-failed"
ONNXRUNTIME: Final = "onnxruntime==1.32.0"  # the project's own: answers compare bit for bit
Say = Callable[[str], None]


@dataclass(frozen=True)
class Server:
    """One kind of server: its packages, the script that runs it, and the Prometheus
    counter (on which of its ports) that counts the requests a model answered."""

    name: str
    packages: tuple[str, ...]
    script: str
    counter: str  # a sample name; its labels must name the model
    counter_port: str  # "http" or "metrics"

    @property
    def venv(self) -> Path:
        return ROOT / f".venv-{self.name}"


SERVERS: Final = {
    "triton": Server(
        "triton", ("nvidia-pytriton==0.7.0", ONNXRUNTIME), "triton_server.py", "nv_inference_request_success", "metrics"
    ),
    "mlserver": Server(
        "mlserver", ("mlserver==1.7.1", ONNXRUNTIME), "mlserver_server.py", "model_infer_request_success_total", "metrics"
    ),
    "kserve": Server(
        "kserve", ("kserve==0.21.0", ONNXRUNTIME), "kserve_server.py", "request_predict_seconds_count", "http"
    ),
}  # fmt: skip


def _say(message: str) -> None:
    print(f"foreign_env: {message}", flush=True)


def python_of(server: Server) -> Path:
    return server.venv / "bin" / "python"


def wanted_marker(server: Server) -> str:
    return "".join(f"{package}\n" for package in server.packages)


def is_ready(server: Server) -> bool:
    """True when the server's environment holds its pinned packages, set up by :func:`ensure`."""
    marker = server.venv / MARKER_NAME
    return python_of(server).exists() and marker.exists() and marker.read_text() == wanted_marker(server)


def why_not_ready(server: Server) -> str:
    """What a test that needs the server says when it skips."""
    failed = server.venv / FAILED_NAME
    if failed.exists():
        return f"{server.name} could not be installed into {server.venv}: {failed.read_text().strip()}"
    return f"{server.venv} is not set up: run `python scripts/foreign_env.py` (make test does)"


def ensure(server: Server, *, say: Say = _say) -> Path:
    """Create or reuse the server's environment; return its Python. Safe from several
    processes at once: the second waits for the first and then reuses what it made.
    CalledProcessError when pip fails (the reason is kept for :func:`why_not_ready`)."""
    server.venv.mkdir(parents=True, exist_ok=True)
    with _locked(server.venv / ".stratus-lock"):
        if is_ready(server):
            say(f"reusing {server.venv} ({', '.join(server.packages)})")
            return python_of(server)
        (server.venv / MARKER_NAME).unlink(missing_ok=True)
        python = python_of(server)
        try:
            if not python.exists():
                say(f"creating the virtual environment {server.venv}")
                _run([sys.executable, "-m", "venv", str(server.venv)])
            say(f"installing {', '.join(server.packages)} into {server.venv}")
            _run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
            _run([str(python), "-m", "pip", "install", "--quiet", *server.packages])
        except subprocess.CalledProcessError as exc:
            (server.venv / FAILED_NAME).write_text(
                f"{' '.join(exc.cmd)} exited {exc.returncode}: {exc.stderr}"
            )
            raise
        (server.venv / FAILED_NAME).unlink(missing_ok=True)
        (server.venv / MARKER_NAME).write_text(wanted_marker(server))
        say(f"ready: {server.venv}")
        return python


def _run(command: Sequence[str]) -> None:
    """Run pip; its error output (the last of it) travels with a failure."""
    result = subprocess.run(
        command, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if result.returncode != 0:
        sys.stderr.write(result.stderr)
        raise subprocess.CalledProcessError(result.returncode, command, stderr=result.stderr[-2000:])


# --- a running server ----------------------------------------------------------------------------


@dataclass
class Running:
    """A foreign server on loopback: its gRPC address, and the port its counter is on."""

    server: Server
    process: subprocess.Popen[str]
    ports: dict[str, int]
    model: str
    log_path: Path
    started_s: float = field(default_factory=time.monotonic)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self, tail: int = 6000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-tail:]

    def served(self) -> float:
        """Requests the server itself counts for the model (its own Prometheus counter)."""
        url = f"http://127.0.0.1:{self.ports[self.server.counter_port]}/metrics"
        with urllib.request.urlopen(url, timeout=5.0) as response:
            text = response.read().decode()
        pattern = re.compile(
            rf'^{self.server.counter}\{{[^}}]*"{re.escape(self.model)}"[^}}]*\}}\s+(\S+)', re.M
        )
        return sum(float(value) for value in pattern.findall(text))

    def stop(self, *, timeout_s: float = 20.0) -> int:
        """SIGTERM to the server's process group (tritonserver and its Python stubs are
        children), SIGKILL what is left after ``timeout_s``; the exit code."""
        if self.alive():
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        _signal_group(self.process.pid, signal.SIGKILL)  # children left behind, if any
        return self.process.returncode


def _command(server: Server, model: Path, name: str, ports: dict[str, int], workdir: Path) -> list[str]:
    command = [
        str(python_of(server)),
        str(SERVERS_DIR / server.script),
        "--model",
        str(model),
        "--name",
        name,
    ]
    command += ["--grpc-port", str(ports["grpc"]), "--http-port", str(ports["http"])]
    if "metrics" in ports:
        command += ["--metrics-port", str(ports["metrics"])]
    if server.name == "mlserver":
        command += ["--workdir", str(workdir)]
    return command


def _environment(server: Server) -> dict[str, str]:
    """PyTriton's Python backend stub links the interpreter's own libpython: it must be on
    the library path (the interpreter's LIBDIR, as its venv's Python reports it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if server.name == "triton":
        code = "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"
        libdir = subprocess.run(
            [str(python_of(server)), "-c", code], capture_output=True, text=True, check=True
        )
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libdir.stdout.strip(), env.get("LD_LIBRARY_PATH")) if p
        )
    return env


def start(
    server: Server,
    model: Path,
    *,
    name: str,
    log_dir: Path,
    access_token: str | None = None,
    restrict_inference: bool = False,
    grpc_port: int | None = None,
    timeout_s: float = 180.0,
) -> Running:
    """Start the server on ``model`` as ``name`` and wait until it says READY (its model
    loaded). ``grpc_port`` brings it back where it was. Triton only: ``access_token``
    restricts its admin protocols to callers that send it, ``restrict_inference`` its inference protocol too."""
    ports = {"grpc": grpc_port or free_port(), "http": free_port()}
    if server.counter_port == "metrics":
        ports["metrics"] = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = _new_log(log_dir, server.name)
    command = _command(server, model, name, ports, log_dir / f"{server.name}-work")
    if access_token is not None:
        command += ["--access-token", access_token, *(["--restrict-inference"] if restrict_inference else [])]
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
            env=_environment(server),
            start_new_session=True,  # its own process group, so stop() reaches its children
        )
    running = Running(server=server, process=process, ports=ports, model=name, log_path=log_path)
    try:
        _await_ready(running, timeout_s)
    except BaseException:
        running.stop(timeout_s=5.0)
        raise
    return running


def _new_log(log_dir: Path, name: str) -> Path:
    """A log of its own for each start (a restart's READY must not be read from the last)."""
    path, count = log_dir / f"{name}.log", 1
    while path.exists():
        count += 1
        path = log_dir / f"{name}-{count}.log"
    return path


def _await_ready(running: Running, timeout_s: float) -> None:
    """Wait for the READY line, which the scripts print once the model is ready. The server
    writes everything to its log (servers that log to stdout never fill a pipe no one
    reads), and the log is where the line is looked for."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and running.alive():
        if any(line.startswith("READY ") for line in running.log(tail=1 << 20).splitlines()):
            return
        time.sleep(0.1)
    state = f"exited with {running.process.returncode}" if not running.alive() else "did not say READY"
    raise RuntimeError(f"{running.server.name} {state} within {timeout_s:.0f} s; its log:\n{running.log()}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Set up the foreign servers' environments, or run one.")
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve", help="run one server on an ONNX file until interrupted")
    serve.add_argument("server", choices=sorted(SERVERS))
    serve.add_argument("model", type=Path)
    serve.add_argument("--name", required=True, help="the model's name on the server, e.g. digits-large")
    serve.add_argument("--grpc-port", type=int, default=None)
    serve.add_argument(
        "--access-token", default=None, help="Triton: restrict its admin protocols to this token"
    )
    serve.add_argument(
        "--restrict-inference", action="store_true", help="Triton: restrict inference to the token too"
    )
    args = parser.parse_args(argv)
    if args.command != "serve":
        return _ensure_all()
    server = SERVERS[args.server]
    ensure(server)
    running = start(
        server,
        args.model,
        name=args.name,
        log_dir=Path.cwd(),
        access_token=args.access_token,
        restrict_inference=args.restrict_inference,
        grpc_port=args.grpc_port,
    )
    print(
        f"{server.name} serving '{args.name}' at {running.address} (Ctrl-C or SIGTERM stops it)", flush=True
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_on_signal)
    try:
        running.process.wait()
    finally:
        running.stop()
    return 0


def _ensure_all() -> int:
    """Set up every server; one that cannot be installed is reported here, and its tests then
    fail saying why (tests/skips.py allows no skip for it), while `make test` runs the rest."""
    for server in SERVERS.values():
        try:
            ensure(server)
        except (subprocess.CalledProcessError, OSError) as exc:
            _say(f"{server.name} could not be installed ({exc}); its tests will fail, saying why")
    return 0


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
