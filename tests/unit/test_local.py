"""LocalModels: where a variant's calls run, and what a request gets back."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest

from stratus.convert import codec
from stratus.convert.inference import InferRequest
from stratus.errors import ConfigError
from stratus.execution.describe import variants_info
from stratus.execution.loading import LocalSettings
from stratus.execution.local_models import LocalModels
from stratus.execution.running import INLINE_REVIEW
from stratus.families.repository import ModelRepository
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb


def answered(tmp_path: Path, repository: ModelRepository, **settings: float) -> tuple[set[str], float]:
    models = LocalModels(
        repository,
        LocalSettings(variants=["digits-small"], runtimes=["onnxruntime"], cache_dir=tmp_path, **settings),  # type: ignore[arg-type]
    )
    message = pb.ModelInferRequest(model_name="digits-small")
    codec.encode_request_inputs(message, {"input": np.zeros((1, 64), np.float32)})
    request = InferRequest.from_wire(message)

    async def ask() -> float:
        answers = [await models.answer(request) for _ in range(2 * INLINE_REVIEW)]  # the first warm up
        return answers[-1].confidence

    try:
        confidence = asyncio.run(ask())
        return set(models.running.inline), confidence
    finally:
        models.close()


def test_a_variant_faster_than_the_switch_moves_onto_the_event_loop(tmp_path: Path, repository) -> None:  # type: ignore[no-untyped-def]
    # Any call is under 10 s, however loaded the machine: the switch is what is tested. What a
    # digits-small call costs (about 0.05 ms) is benchmarks/router_overhead.py's business.
    inline, confidence = answered(tmp_path, repository, inline_below_ms=10_000.0)
    assert inline == {"digits-small"} and 0.0 < confidence <= 1.0


@pytest.mark.parametrize(
    "settings", [{"inline_below_ms": 0.0}, {"emulated_extra_ms": 3.0, "inline_below_ms": 2.0}]
)
def test_a_slow_variant_or_a_disabled_switch_stays_on_threads(tmp_path: Path, repository, settings) -> None:  # type: ignore[no-untyped-def]
    inline, _ = answered(tmp_path, repository, **settings)
    assert inline == set()


def _digits_request(model: str) -> InferRequest:
    request = pb.ModelInferRequest(model_name=model)
    codec.encode_request_inputs(request, {"input": np.zeros((2, 64), np.float32)})
    return InferRequest.from_wire(request)


def test_reload_loads_what_changed_and_retires_what_was_replaced(
    tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import stratus.execution.lineup

    monkeypatch.setattr(stratus.execution.lineup, "RETIRE_GRACE_S", 0.2)
    root = tmp_path / "models"
    shutil.copytree(models_dir / "digits", root / "digits")
    settings = LocalSettings(tier=Tier.EDGE, runtimes=["onnxruntime"], cache_dir=tmp_path, precision="fp32")
    models = LocalModels(ModelRepository.load(root), settings)

    async def scenario() -> None:
        first = models.runners["digits-medium"]
        assert await models.reload() == ["digits-medium"]
        assert models.runners["digits-medium"] is first, "an unchanged variant is not loaded again"
        onnx_file = root / "digits" / "digits-medium.onnx"
        onnx_file.write_bytes(onnx_file.read_bytes())  # replaced on disk: same bytes, new file
        os.utime(onnx_file, ns=(1, 1))
        closed: list[float] = []
        close = first.close
        monkeypatch.setattr(first, "close", lambda: (closed.append(time.monotonic()), close()))
        reloaded = time.monotonic()
        await models.reload()
        second = models.runners["digits-medium"]
        assert second is not first
        answer = await models.answer(_digits_request("digits"))
        assert answer.variant.name == "digits-medium" and len(answer.confidences) == 2
        assert closed == [], "the replaced runner is closed only after its grace"
        for _ in range(100):  # retired once the grace is over
            if closed:
                break
            await asyncio.sleep(0.05)
        assert len(closed) == 1 and closed[0] - reloaded >= 0.2, closed
        assert models.runners["digits-medium"] is second

    try:
        asyncio.run(scenario())
    finally:
        models.close()


def test_a_failed_reload_changes_nothing(tmp_path: Path, models_dir: Path) -> None:
    import shutil

    root = tmp_path / "models"
    shutil.copytree(models_dir / "digits", root / "digits")
    models = LocalModels(
        ModelRepository.load(root),
        LocalSettings(tier=Tier.EDGE, runtimes=["onnxruntime"], cache_dir=tmp_path),
    )
    served = set(models.served)
    config = root / "digits" / "family.toml"
    config.write_text(config.read_text().replace('edge = "digits-medium"', 'edge = "digits-huge"'))

    async def scenario() -> None:
        with pytest.raises(ConfigError, match="'digits-huge' is not a variant"):
            await models.reload()
        assert models.served == served
        assert (await models.answer(_digits_request("digits"))).variant.name in served

    try:
        asyncio.run(scenario())
    finally:
        models.close()


def test_only_the_current_line_answers_for_its_family(tmp_path: Path, models_dir: Path) -> None:
    """A second FP32 variant of a tier is loaded and announced, but serves its family only
    when the config makes it current."""
    import shutil

    root = tmp_path / "models"
    shutil.copytree(models_dir / "digits", root / "digits")
    config = root / "digits" / "family.toml"
    shutil.copy(root / "digits" / "digits-medium.onnx", root / "digits" / "digits-medium-v2.onnx")
    config.write_text(
        config.read_text()
        + '\n[[variants]]\nname = "digits-medium-v2"\ntier = "edge"\nfiles = { onnx = "digits-medium-v2.onnx" }\n'
    )
    settings = LocalSettings(tier=Tier.EDGE, runtimes=["onnxruntime"], cache_dir=tmp_path, precision="fp32")
    models = LocalModels(ModelRepository.load(root), settings)
    try:
        assert models.served == {"digits-medium", "digits-medium-v2"}
        assert models.current == {"digits-medium"}
        assert models.variant_for("digits")[1].name == "digits-medium"
        lines = {info.name: (info.line, info.current) for info in variants_info(models)}
        assert lines == {
            "digits-medium": ("digits-medium", True),
            "digits-medium-v2": ("digits-medium-v2", False),
        }
    finally:
        models.close()
    config.write_text(config.read_text().replace('edge = "digits-medium"', 'edge = "digits-medium-v2"'))
    models = LocalModels(ModelRepository.load(root), settings)
    try:
        assert models.variant_for("digits")[1].name == "digits-medium-v2"
    finally:
        models.close()


def test_a_family_follows_a_line_it_has_and_keeps_its_own_otherwise(tmp_path: Path) -> None:
    """What the SDK does with a router's promoted rollout: the candidate answers the family
    from then on where this folder holds it; a line it lacks changes nothing."""
    import shutil

    root = tmp_path / "models"
    shutil.copytree(Path(__file__).resolve().parents[2] / "models" / "digits", root / "digits")
    shutil.copy(root / "digits" / "digits-small.onnx", root / "digits" / "digits-small-v2.onnx")
    with (root / "digits" / "family.toml").open("a") as config:
        config.write('\n[[variants]]\nname = "digits-small-v2"\ntier = "device"\nfiles = { onnx = "digits-small-v2.onnx" }\n')
    models = LocalModels(
        ModelRepository.load(root), LocalSettings(tier=Tier.DEVICE, precision="fp32", cache_dir=tmp_path)
    )
    try:
        assert models.variant_for("digits")[1].name == "digits-small"  # family.toml's current
        assert not models.follow("digits", Tier.DEVICE, "digits-small-v9")
        assert models.variant_for("digits")[1].name == "digits-small"
        assert not models.follow("digits", Tier.EDGE, "digits-small-v2")  # not a line of that tier here
        assert models.follow("digits", Tier.DEVICE, "digits-small-v2")
        assert models.variant_for("digits")[1].name == "digits-small-v2"
        assert models.variant_for("digits-small")[1].name == "digits-small"  # still pinnable by name
    finally:
        models.close()
