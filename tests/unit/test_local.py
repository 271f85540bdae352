"""LocalModels: where a variant's calls run, and what a request gets back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from stratus import codec
from stratus.local import INLINE_REVIEW, LocalModels, LocalSettings
from stratus.repository import ModelRepository
from stratus.wire import inference_pb2 as pb


def answered(tmp_path: Path, repository: ModelRepository, **settings: float) -> tuple[set[str], float]:
    models = LocalModels(
        repository,
        LocalSettings(variants=["digits-small"], runtimes=["onnxruntime"], cache_dir=tmp_path, **settings),  # type: ignore[arg-type]
    )
    request = pb.ModelInferRequest(model_name="digits-small")
    codec.encode_request_inputs(request, {"input": np.zeros((1, 64), np.float32)})

    async def ask() -> float:
        answers = [await models.answer(request) for _ in range(2 * INLINE_REVIEW)]  # the first warm up
        return answers[-1].confidence

    try:
        confidence = asyncio.run(ask())
        return set(models._inline), confidence
    finally:
        models.close()


def test_a_variant_that_runs_in_microseconds_moves_onto_the_event_loop(tmp_path: Path, repository) -> None:  # type: ignore[no-untyped-def]
    inline, confidence = answered(tmp_path, repository, inline_below_ms=2.0)  # calls take ~0.05 ms
    assert inline == {"digits-small"} and 0.0 < confidence <= 1.0


@pytest.mark.parametrize(
    "settings", [{"inline_below_ms": 0.0}, {"emulated_extra_ms": 3.0, "inline_below_ms": 2.0}]
)
def test_a_slow_variant_or_a_disabled_switch_stays_on_threads(tmp_path: Path, repository, settings) -> None:  # type: ignore[no-untyped-def]
    inline, _ = answered(tmp_path, repository, **settings)
    assert inline == set()
