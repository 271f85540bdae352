"""``python -m stratus.probe``, run as Kubernetes runs it (a process, judged by its exit code),
against a real grpc.aio server carrying Stratus' Health service over mutual TLS on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from stratus.cli.pki import Identity, issue
from stratus.serving.health import Health

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Probed:
    code: int
    stderr: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("probe") / "fleet"
    issue(out, [Identity("router", "router"), Identity("agent", "edge-pool")])
    return out


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("probe") / "stranger"
    issue(out, [Identity("router", "router")])
    return out


@contextlib.asynccontextmanager
async def health_server(certs: Path, *, ready: bool) -> AsyncIterator[int]:
    """A server with Stratus' Health (readiness fixed at ``ready``), requiring client
    certificates from the fleet CA, as every Stratus server with --tls-ca does."""
    server = grpc.aio.server()
    health = Health(server, lambda: ready, interval_s=0.05)
    credentials = grpc.ssl_server_credentials(
        [((certs / "router-router.key").read_bytes(), (certs / "router-router.pem").read_bytes())],
        root_certificates=(certs / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    await health.start()
    try:
        yield port
    finally:
        await health.stop()
        await server.stop(None)


async def probe(port: int, cert_dir: Path, *extra: str, ca_dir: Path | None = None) -> Probed:
    """The probe as its own process, with an agent's certificate."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "stratus.probe",
        f"127.0.0.1:{port}",
        "--tls-cert",
        str(cert_dir / "agent-edge-pool.pem"),
        "--tls-key",
        str(cert_dir / "agent-edge-pool.key"),
        "--tls-ca",
        str((ca_dir or cert_dir) / "ca.pem"),
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode is not None
    return Probed(process.returncode, stderr.decode())


def reason(probed: Probed) -> str:
    """The probe's own line (gRPC's C core may log a handshake failure on stderr too)."""
    lines = [line for line in probed.stderr.splitlines() if line.startswith("stratus.probe:")]
    assert len(lines) == 1, probed.stderr
    return lines[0]


def test_serving_is_exit_0_and_not_serving_is_exit_1(fleet: Path) -> None:
    async def main() -> list[Probed]:
        async with health_server(fleet, ready=True) as port:
            up = [await probe(port, fleet), await probe(port, fleet, "--service", Health.LIVENESS)]
        async with health_server(fleet, ready=False) as port:
            down = [await probe(port, fleet), await probe(port, fleet, "--service", Health.LIVENESS)]
        return up + down

    ready, live, not_ready, still_live = asyncio.run(main())
    assert (ready.code, ready.stderr) == (0, "")
    assert (live.code, live.stderr) == (0, "")
    assert not_ready.code == 1 and "service '': NOT_SERVING" in reason(not_ready)
    assert still_live.code == 0, "liveness stays SERVING while readiness is not"


def test_an_unknown_service_is_exit_1(fleet: Path) -> None:
    async def main() -> Probed:
        async with health_server(fleet, ready=True) as port:
            return await probe(port, fleet, "--service", "no-such-service")

    probed = asyncio.run(main())
    # The health servicer answers NOT_FOUND by raising inside the server (context.abort); the
    # traceback's cycle holds the server, and with it grpc.aio's poller thread, until collected.
    gc.collect()
    assert probed.code == 1 and "NOT_FOUND" in reason(probed)


def test_a_certificate_of_another_ca_is_exit_1(fleet: Path, stranger: Path) -> None:
    """The server refuses the probe's certificate; and a probe that trusts another CA refuses
    the server's."""

    async def main() -> tuple[Probed, Probed]:
        async with health_server(fleet, ready=True) as port:
            foreign_client = await probe(port, fleet, ca_dir=stranger)
        async with health_server(stranger, ready=True) as port:
            foreign_server = await probe(port, fleet)
        return foreign_client, foreign_server

    foreign_client, foreign_server = asyncio.run(main())
    assert foreign_client.code == 1 and "UNAVAILABLE" in reason(foreign_client)
    assert foreign_server.code == 1 and "UNAVAILABLE" in reason(foreign_server)


def test_nothing_listening_and_a_missing_file_are_exit_1(fleet: Path, tmp_path: Path) -> None:
    async def main() -> tuple[Probed, Probed]:
        async with health_server(fleet, ready=True) as port:
            pass  # stopped: nothing listens on the port now
        gone = await probe(port, fleet, "--timeout-s", "1")
        missing = await probe(port, tmp_path)
        return gone, missing

    gone, missing = asyncio.run(main())
    assert gone.code == 1 and "UNAVAILABLE" in reason(gone)
    assert missing.code == 1 and f"cannot read {tmp_path}" in reason(missing)
