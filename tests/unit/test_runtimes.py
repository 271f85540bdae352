"""Every CPU runtime serves the shipped variants, agrees with the others, and keeps its contract."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from stratus.errors import NotFound, Overloaded, RuntimeUnavailable
from stratus.families.repository import ModelRepository
from stratus.runtimes import (
    RUNNERS,
    Availability,
    LoadOptions,
    candidates,
    load_runner,
    open_runner,
    preference,
)
from stratus.runtimes.ort import file_digest, machine_digest
from stratus.sched.executor import BoundedExecutor
from stratus.tiers import Tier

CPU_CHOICES = [("litert", "tflite"), ("openvino", "openvino"), ("openvino", "onnx"), ("onnxruntime", "onnx")]


@pytest.fixture(scope="module")
def small_outputs(repository: ModelRepository, digits, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    family = repository.family("digits")
    variant = family.variant("digits-small")
    cache = tmp_path_factory.mktemp("cache")
    results = {}
    for choice in candidates(variant, tier=Tier.DEVICE, gpu=False):
        runner = open_runner(
            family, variant, choice, LoadOptions(tier=Tier.DEVICE, cache_dir=cache, concurrency=2)
        )
        results[(choice.runtime, choice.format)] = runner.infer({"input": digits.held_out.x})["probabilities"]
    return results


def test_all_cpu_runtimes_serve_digits_small(small_outputs, digits) -> None:  # type: ignore[no-untyped-def]
    assert sorted(small_outputs) == sorted(CPU_CHOICES)
    for output in small_outputs.values():
        assert output.shape == (len(digits.held_out), 10) and output.dtype == np.float32
        np.testing.assert_allclose(output.sum(axis=1), 1.0, atol=1e-5)
        assert (output.argmax(axis=1) == digits.held_out.y).mean() > 0.9


def test_runtimes_agree_within_tolerance(small_outputs) -> None:  # type: ignore[no-untyped-def]
    reference = small_outputs[("onnxruntime", "onnx")]
    for output in small_outputs.values():
        assert np.abs(output - reference).max() < 1e-4


@pytest.mark.parametrize(("runtime", "fmt"), CPU_CHOICES)
def test_dynamic_batch_and_caller_arrays_untouched(
    repository: ModelRepository, tmp_path: Path, runtime: str, fmt: str
) -> None:
    family = repository.family("digits")
    variant = family.variant("digits-small")
    choice = next(
        c for c in candidates(variant, tier=Tier.DEVICE, gpu=False) if (c.runtime, c.format) == (runtime, fmt)
    )
    runner = open_runner(family, variant, choice, LoadOptions(tier=Tier.DEVICE, cache_dir=tmp_path))
    rows = np.random.default_rng(1).random((17, 64), dtype=np.float32)
    pristine = rows.copy()
    previous = None
    for size in (1, 3, 17, 2):
        out = runner.infer({"input": rows[:size]})["probabilities"]
        assert out.shape == (size, 10)
        if previous is not None:  # the same rows give the same answers whatever the batch
            common = min(size, len(previous))
            np.testing.assert_allclose(out[:common], previous[:common], atol=1e-5)
        previous = out
    np.testing.assert_array_equal(rows, pristine)
    first = runner.infer({"input": rows[:1]})["probabilities"]
    runner.infer({"input": rows[1:2]})
    np.testing.assert_array_equal(first, runner.infer({"input": rows[:1]})["probabilities"])


def test_concurrent_inference_from_threads_is_safe(
    repository: ModelRepository, tmp_path: Path, digits
) -> None:  # type: ignore[no-untyped-def]
    family = repository.family("digits")
    variant = family.variant("digits-small")
    for choice in candidates(variant, tier=Tier.DEVICE, gpu=False):
        runner = open_runner(
            family, variant, choice, LoadOptions(tier=Tier.DEVICE, cache_dir=tmp_path, concurrency=4)
        )
        expected = runner.infer({"input": digits.held_out.x[:40]})["probabilities"]
        results: dict[int, np.ndarray] = {}

        def work(index: int, runner=runner, results=results) -> None:  # type: ignore[no-untyped-def]
            results[index] = runner.infer({"input": digits.held_out.x[index * 10 : index * 10 + 10]})[
                "probabilities"
            ]

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        np.testing.assert_allclose(np.concatenate([results[i] for i in range(4)]), expected, atol=1e-6)


def test_preference_order_and_override(repository: ModelRepository) -> None:
    small = repository.family("digits").variant("digits-small")
    assert [c.runtime for c in candidates(small, tier=Tier.DEVICE, gpu=False)][:2] == ["litert", "openvino"]
    assert candidates(small, tier=Tier.EDGE, gpu=False)[0].runtime == "openvino"
    assert candidates(small, tier=Tier.EDGE, gpu=True)[0].runtime == "tensorrt"
    assert [
        (c.runtime, c.format)
        for c in candidates(small, tier=Tier.DEVICE, gpu=False, runtimes=["onnxruntime"])
    ] == [("onnxruntime", "onnx")]
    with pytest.raises(NotFound, match=r"unknown runtime.*llama_cpp"):
        candidates(small, tier=Tier.DEVICE, gpu=False, runtimes=["tvm"])
    assert candidates(small, tier=Tier.DEVICE, gpu=False, runtimes=["llama_cpp"]) == []  # only those named
    mixed = candidates(small, tier=Tier.DEVICE, gpu=False, runtimes=["llama_cpp", "openvino"])
    assert {c.runtime for c in mixed} == {"openvino"}
    assert preference(tier=Tier.CLOUD, gpu=False)[0] == ("openvino", "openvino")


def test_load_runner_skips_unavailable_runtimes_and_says_why(
    repository: ModelRepository, tmp_path: Path
) -> None:
    family = repository.family("digits")
    small = family.variant("digits-small")
    availability = {name: Availability(available=True) for name in RUNNERS}
    availability["litert"] = Availability(available=False, reason="no interpreter here")
    availability["tensorrt"] = Availability(available=False, reason="no GPU")
    runner = load_runner(
        family, small, LoadOptions(tier=Tier.DEVICE, cache_dir=tmp_path), availability=availability
    )
    assert runner.describe().runtime == "openvino"
    nothing = {name: Availability(available=False, reason=f"{name} missing") for name in RUNNERS}
    with pytest.raises(RuntimeUnavailable, match="litert: litert missing"):
        load_runner(family, small, LoadOptions(tier=Tier.DEVICE, cache_dir=tmp_path), availability=nothing)


def test_tensorrt_reports_itself_unavailable_with_a_reason() -> None:
    status = RUNNERS["tensorrt"].availability()
    if status.available:
        pytest.skip("TensorRT is present on this machine")
    assert "tensorrt" in status.reason


def test_onnxruntime_caches_the_optimized_graph(repository: ModelRepository, tmp_path: Path) -> None:
    family = repository.family("digits")
    variant = family.variant("digits-medium")
    choice = candidates(variant, tier=Tier.EDGE, gpu=False, runtimes=["onnxruntime"])[0]
    first = open_runner(family, variant, choice, LoadOptions(tier=Tier.EDGE, cache_dir=tmp_path))
    cached = list((tmp_path / "onnxruntime").glob("digits-medium-*.onnx"))
    assert len(cached) == 1
    second = open_runner(family, variant, choice, LoadOptions(tier=Tier.EDGE, cache_dir=tmp_path))
    x = np.random.default_rng(0).random((4, 64), dtype=np.float32)
    np.testing.assert_allclose(
        first.infer({"input": x})["probabilities"], second.infer({"input": x})["probabilities"], atol=1e-6
    )


def test_a_cached_graph_that_is_not_the_one_written_is_not_loaded(repository: ModelRepository, tmp_path: Path) -> None:
    """A graph torn or changed after it was written (here: swapped for another model's): the
    digest beside it no longer matches, so the graph is optimized again from the model."""
    family = repository.family("digits")
    variant = family.variant("digits-medium")
    choice = candidates(variant, tier=Tier.EDGE, gpu=False, runtimes=["onnxruntime"])[0]
    options = LoadOptions(tier=Tier.EDGE, cache_dir=tmp_path)
    honest = open_runner(family, variant, choice, options)
    (cached,) = (tmp_path / "onnxruntime").glob("digits-medium-*.onnx")
    assert sorted(p.name for p in cached.parent.iterdir()) == [cached.name, cached.name + ".sha256"]  # no scratch left
    cached.write_bytes(family.variant("digits-large").files["onnx"].read_bytes())  # same tensors, other answers
    again = open_runner(family, variant, choice, options)
    x = np.random.default_rng(1).random((4, 64), dtype=np.float32)
    np.testing.assert_allclose(
        again.infer({"input": x})["probabilities"], honest.infer({"input": x})["probabilities"], atol=1e-6
    )


def test_a_cache_folder_others_may_write_caches_nothing_and_still_serves(
    repository: ModelRepository, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """security2 N17: whoever may write the folder could write a graph and its digest both, so
    a folder that is not this user's alone is not read or written; the model is optimized anew."""
    family = repository.family("digits")
    variant = family.variant("digits-medium")
    choice = candidates(variant, tier=Tier.EDGE, gpu=False, runtimes=["onnxruntime"])[0]
    shared = tmp_path / "onnxruntime"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)
    planted = shared / f"{variant.files['onnx'].stem}-planted.onnx"
    planted.write_bytes(b"not read")
    runner = open_runner(family, variant, choice, LoadOptions(tier=Tier.EDGE, cache_dir=tmp_path))
    assert sorted(p.name for p in shared.iterdir()) == [planted.name]  # nothing written either
    assert "is not this user's alone" in caplog.text
    x = np.random.default_rng(2).random((4, 64), dtype=np.float32)
    assert runner.infer({"input": x})["probabilities"].shape == (4, 10)


def test_the_optimized_graph_is_written_in_a_private_folder_not_through_a_planted_link(
    repository: ModelRepository, tmp_path: Path
) -> None:
    """The scratch name was predictable (``.NAME.PID.TID``) and ORT follows a symlink there; now
    it is written in a fresh 0700 folder, and no name anyone planted in the cache is opened."""
    family = repository.family("digits")
    variant = family.variant("digits-medium")
    choice = candidates(variant, tier=Tier.EDGE, gpu=False, runtimes=["onnxruntime"])[0]
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    cache = tmp_path / "onnxruntime"
    cache.mkdir(mode=0o700)
    onnx = variant.files["onnx"]
    name = f"{onnx.stem}-{file_digest(onnx)}-ort{onnxruntime.__version__}-{machine_digest()}.onnx"
    old_scratch = cache / f".{name}.{os.getpid()}.{threading.get_ident()}"  # the name it used to write
    old_scratch.symlink_to(victim)
    open_runner(family, variant, choice, LoadOptions(tier=Tier.EDGE, cache_dir=tmp_path))
    assert victim.read_text() == "untouched"
    assert sorted(p.name for p in cache.iterdir()) == sorted([old_scratch.name, name, name + ".sha256"])
    assert not (cache / name).is_symlink()


def test_bounded_executor_refuses_past_its_queue() -> None:
    gate = threading.Event()
    executor = BoundedExecutor(name="test-infer", workers=1, queue_limit=1)

    async def scenario() -> None:
        running = asyncio.ensure_future(executor.run(gate.wait, 5))
        waiting = asyncio.ensure_future(executor.run(lambda: "second"))
        for _ in range(200):  # until both reached the executor, however slow the machine
            if executor.in_flight == 2:
                break
            await asyncio.sleep(0.01)
        assert executor.in_flight == 2 and executor.queued == 1
        with pytest.raises(Overloaded, match="test-infer queue is full"):
            await executor.run(lambda: "third")
        gate.set()
        assert await running is True
        assert await waiting == "second"
        assert executor.in_flight == 0

    asyncio.run(scenario())
    executor.shutdown()
    assert all(not t.name.startswith("test-infer") for t in threading.enumerate())


def test_an_agent_that_runs_litert_never_imports_the_other_runtimes(tmp_path: Path) -> None:
    """Each runtime weighs tens of MB once imported; only the one reached may load, for every
    family of the tier (a generative one included: --runtimes litert names no runtime for it)."""
    import subprocess
    import sys

    script = f"""
import sys
from pathlib import Path
from stratus.execution.local_models import LocalModels
from stratus.execution.loading import LocalSettings
from stratus.families.repository import ModelRepository
from stratus.tiers import Tier
models = LocalModels(ModelRepository.load({str(Path(__file__).parents[2] / "models")!r}),
    LocalSettings(tier=Tier.DEVICE, runtimes=["litert"], cache_dir=Path({str(tmp_path)!r})))
assert models.generators is not None and not models.generators.variants, models.generators.variants
print(sorted(m for m in ("openvino", "onnxruntime", "tensorrt", "ai_edge_litert", "llama_cpp", "openvino_genai")
             if m in sys.modules))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip().splitlines()[-1] == "['ai_edge_litert']"
