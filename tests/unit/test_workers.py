"""``--workers``' pure parts: the ports the parent holds and each worker's command line
(tests/integration/test_workers.py runs the processes)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from edge_agent.link import Backoff, worker_addresses
from router.audit.capture import CaptureOptions
from router.settings import RouterSettings
from router.workers import Workers, hold_port, split_address
from stratus.cli.main import build_parser
from stratus.errors import ConfigError


def test_a_held_port_is_taken_by_reuse_port_sockets_only() -> None:
    held = hold_port("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        with socket.socket() as sharing:
            sharing.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sharing.bind(("127.0.0.1", port))
            sharing.listen()
    finally:
        held.close()


def test_each_worker_gets_the_shared_port_its_own_address_and_every_workers() -> None:
    capture = CaptureOptions(folder=Path("/var/lib/stratus/capture"), families="digits", max_bytes=3 << 30)
    settings = RouterSettings(
        listen="127.0.0.1:0", workers=3, metrics="127.0.0.1:9100", state_dir=Path("/var/lib/stratus"), capture=capture
    )
    workers = Workers(settings, ["router", "--listen", "127.0.0.1:0", "--workers", "3"])
    try:
        shared_port = split_address(workers.shared)[1]
        assert shared_port != 0
        own = [w.listen for w in workers.workers]
        assert len(set(own)) == 3 and workers.shared not in own
        command = workers.command(workers.workers[2])
        parsed = build_parser().parse_args(command[3:])  # past "python -m stratus.cli"
        assert parsed.listen == workers.shared  # the last --listen wins
        assert parsed.workers == 1  # a worker does not start workers
        assert parsed.worker_address == own[2]
        assert parsed.router_workers == own  # loopback: reached where it listens
        assert parsed.metrics == "127.0.0.1:9102"  # a /metrics port of its own
        assert parsed.state_dir == Path("/var/lib/stratus/worker-2")  # a lone router's folder each
        assert parsed.capture_folder == Path("/var/lib/stratus/capture/worker-2")
        assert parsed.capture_max_bytes == 1 << 30  # the folder's size, shared out
    finally:
        for held in workers._held:
            held.close()


def test_a_listen_address_without_a_port_is_refused() -> None:
    with pytest.raises(ConfigError, match="numeric port"):
        split_address("localhost")


def test_backoff_counts_failures_since_the_last_healthy_session() -> None:
    import random

    backoff = Backoff(initial_s=0.1, max_s=1.0, rng=random.Random(0))
    for _ in range(3):
        backoff.next_delay()
    assert backoff.failures == 3
    backoff.reset()
    assert backoff.failures == 0


def test_workers_on_every_interface_are_named_by_port_on_the_host_the_agent_dialled() -> None:
    """This host's own name may resolve to an address only it can use (127.0.1.1 on Debian):
    a wildcard --listen names each worker ``:PORT``, and the agent puts the host it reached the
    shared port at in front."""
    settings = RouterSettings(listen="0.0.0.0:0", workers=2, insecure=True)
    workers = Workers(settings, ["router"])
    try:
        parsed = build_parser().parse_args(workers.command(workers.workers[0])[3:])
        ports = [w.listen.rpartition(":")[2] for w in workers.workers]
        assert parsed.router_workers == [f":{port}" for port in ports]
    finally:
        for held in workers._held:
            held.close()
    dialled = worker_addresses("10.0.0.7:8001", [":9001", "edge.example:9002"])
    assert dialled == ["10.0.0.7:9001", "edge.example:9002"]
    assert worker_addresses("[fd00::7]:8001", [":9001"]) == ["[fd00::7]:9001"]
