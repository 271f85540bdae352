"""Shared fixtures, and the teardown guard: no test may leave threads behind."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return MODELS


@pytest.fixture(scope="session")
def repository():  # type: ignore[no-untyped-def]
    from stratus.repository import ModelRepository

    return ModelRepository.load(MODELS)


@pytest.fixture(scope="session")
def digits():  # type: ignore[no-untyped-def]
    from stratus.datasets import digits_splits

    return digits_splits()


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Fail a test that starts a thread and does not stop it."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    for thread in leaked:
        thread.join(timeout=2.0)
    still = [t.name for t in leaked if t.is_alive()]
    assert not still, f"threads leaked: {still}"
