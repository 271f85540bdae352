"""A real fleet on loopback: cloud gateway, router, two device agents, one edge agent.

Every process is a real ``stratus`` command on a port chosen at run time; the fleet is
shared by the module's tests and must shut down cleanly (exit code 0) at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stratus.cli.demo import Fleet, start_fleet

from .cluster import Cluster
from .natsd import nats  # noqa: F401 (a fixture: a NATS server with JetStream)
from .pki import pki  # noqa: F401 (a fixture: the test fleet's certificates)

MODELS = Path(__file__).resolve().parents[2] / "models"


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # Audits off: tests on this fleet count exactly what reaches the cloud (ModelStatistics,
    # metrics); audits are tested on fleets of their own (test_audits.py).
    fleet = start_fleet(MODELS, tmp_path_factory.mktemp("fleet-logs"), router_args=("--audit-share", "0"))
    yield fleet
    codes = fleet.stop()
    assert all(code == 0 for code in codes.values()), f"unclean shutdown: {codes}"


@pytest.fixture(scope="session")
def router(fleet: Fleet) -> str:
    return fleet.router.address


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Processes a test starts itself; all stopped when it ends, whatever happened."""
    built = Cluster(tmp_path / "logs")
    try:
        yield built
    finally:
        built.stop_all()
