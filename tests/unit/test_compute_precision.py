"""The arithmetic a runtime really computes a variant in, read from the runtime, and judged so.

On a CPU without FP16 arithmetic (AMD Zen 4: AVX-512 BF16, no AVX512-FP16) OpenVINO's CPU
plugin, asked for f16, compiles in bf16 without a word, and an FP16 child then answers up
to 4e-2 away from ONNX Runtime's on the same file. The plugin is made to behave so here on
any CPU (its capabilities read as Zen 4's, an f16 hint compiled as bf16), and the runner
must still compute the child's file faithfully and say what it computes in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from stratus.families.repository import ModelRepository
from stratus.runtimes import Choice, LoadOptions, open_runner, openvino_rt
from stratus.tiers import Tier
from stratus.tools.verify.report import BF16_TOLERANCE, FP16_TOLERANCE, TOLERANCE, VerifyRow

openvino = pytest.importorskip("openvino")

# OPTIMIZATION_CAPABILITIES of OpenVINO 2026.4's CPU plugin on an AMD EPYC (Zen 4), as read.
ZEN4_CAPABILITIES = ("BF16", "WINOGRAD", "FP32", "INT8", "BIN", "EXPORT_IMPORT")
SAPPHIRE_RAPIDS_CAPABILITIES = ("FP32", "BF16", "FP16", "INT8", "BIN", "EXPORT_IMPORT")


@pytest.mark.parametrize(
    ("precision", "capabilities", "hint"),
    [
        ("FP16", ZEN4_CAPABILITIES, "f32"),
        ("INT8", ZEN4_CAPABILITIES, "f32"),
        ("FP16", SAPPHIRE_RAPIDS_CAPABILITIES, "f16"),
        ("INT8", SAPPHIRE_RAPIDS_CAPABILITIES, "f16"),
        ("FP32", SAPPHIRE_RAPIDS_CAPABILITIES, "f32"),
        ("FP16", ("FP32", "INT8"), "f32"),  # an AVX2-only CPU
    ],
)
def test_f16_is_asked_only_where_the_plugin_computes_it(
    precision: str, capabilities: tuple[str, ...], hint: str
) -> None:
    assert openvino_rt.precision_hint(precision, capabilities) == hint


class _Zen4Core:
    """OpenVINO's Core as it behaves on Zen 4: no FP16 among its capabilities, and an f16
    hint compiled as bf16 (as far as this CPU computes bf16 at all: where it has no BF16,
    the plugin computes f32 and says so)."""

    asked: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self._core = openvino.Core()

    def set_property(self, *args: Any) -> None:
        self._core.set_property(*args)

    def get_property(self, device: str, name: str) -> Any:
        if name == "OPTIMIZATION_CAPABILITIES":
            return list(ZEN4_CAPABILITIES)
        return self._core.get_property(device, name)

    def compile_model(self, model: Any, device: str, config: dict[str, Any]) -> Any:
        _Zen4Core.asked.append(str(config["INFERENCE_PRECISION_HINT"]))
        if config["INFERENCE_PRECISION_HINT"] == "f16":
            config = {**config, "INFERENCE_PRECISION_HINT": "bf16"}
        return self._core.compile_model(model, device, config)


class _Bf16Core(_Zen4Core):
    """A plugin that computes in bf16 whatever it is asked (where the CPU has bf16)."""

    def compile_model(self, model: Any, device: str, config: dict[str, Any]) -> Any:
        return self._core.compile_model(model, device, {**config, "INFERENCE_PRECISION_HINT": "bf16"})


def _fake_openvino(monkeypatch: pytest.MonkeyPatch, core: type[_Zen4Core]) -> None:
    fake = type("FakeOpenVino", (), {"Core": core})
    monkeypatch.setattr(openvino_rt, "_openvino", lambda: fake)


def _runner(
    repository: ModelRepository, tmp_path: Path, runtime: str, variant_name: str = "digits-medium-fp16"
) -> Any:
    family = repository.family("digits")
    variant = family.variant(variant_name)
    choice = Choice(runtime=runtime, format="onnx", path=variant.files["onnx"])
    return open_runner(family, variant, choice, LoadOptions(tier=Tier.EDGE, cache_dir=tmp_path))


def test_an_fp16_child_on_a_zen4_plugin_computes_its_file_in_f32(
    repository: ModelRepository,
    digits,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    x = digits.held_out.x
    reference = _runner(repository, tmp_path, "onnxruntime").infer({"input": x})["probabilities"]
    _fake_openvino(monkeypatch, _Zen4Core)
    _Zen4Core.asked.clear()
    runner = _runner(repository, tmp_path / "zen4", "openvino")
    got = runner.infer({"input": x})["probabilities"]
    assert _Zen4Core.asked == ["f32"]
    assert runner.describe().compute == "f32"
    # ONNX Runtime keeps the FP16 graph's f16 tensors; computed in bf16 the same file lies
    # up to 4e-2 away (Zen 4, measured), in f32 within FP16's tolerance.
    assert np.abs(got - reference).max() <= FP16_TOLERANCE


def test_the_compute_precision_is_what_the_plugin_compiled_not_what_was_asked(
    repository: ModelRepository, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_openvino(monkeypatch, _Bf16Core)
    runner = _runner(repository, tmp_path, "openvino", "digits-medium")
    compiled = str(runner._compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())
    assert runner.asked == "f32"
    assert runner.describe().compute == compiled
    bf16_here = "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    assert compiled == ("bf16" if bf16_here else "f32")


def test_onnx_runtime_says_it_runs_the_graph_as_typed(repository: ModelRepository, tmp_path: Path) -> None:
    assert _runner(repository, tmp_path, "onnxruntime").describe().compute == "f16"
    assert _runner(repository, tmp_path, "onnxruntime", "digits-medium-int8").describe().compute == "int8"


def _row(
    precision: str, compute: str, peers: tuple[str, ...], diff: float, agreement: float = 1.0
) -> VerifyRow:
    return VerifyRow(
        name="v",
        tier="edge",
        precision=precision,
        runtime="openvino",
        format="onnx",
        accuracy=None,
        max_abs_diff=diff,
        runtime_agreement=agreement,
        compute=compute,
        peer_computes=peers,
    )


def test_each_pair_of_runtimes_is_judged_by_its_looser_arithmetic() -> None:
    # the Zen 4 figure: an FP16 file computed in bf16 against ONNX Runtime's f16
    assert _row("FP16", "bf16", ("f16",), 4.13e-2).runtimes_agree
    assert not _row("FP16", "f32", ("f16",), 4.13e-2).runtimes_agree
    assert not _row("FP16", "bf16", ("f16",), 4.13e-2, agreement=0.98).runtimes_agree
    assert not _row("FP16", "bf16", ("f16",), BF16_TOLERANCE * 1.1).runtimes_agree
    assert _row("FP32", "f32", ("f32",), TOLERANCE * 0.9).runtimes_agree
    assert not _row("FP32", "f32", ("f32",), TOLERANCE * 1.5).runtimes_agree
    # an FP32 file a plugin computed in bf16 is judged as bf16, and the row says so
    assert _row("FP32", "bf16", ("f32",), 1e-2).runtimes_agree
    assert _row("FP16", "f32", ("f32",), 0.0).tolerance == FP16_TOLERANCE
