"""``models import`` of the files people actually export: skl2onnx's default (ZipMap) and
``zipmap=False`` exports, a pruned MLP, and odd or broken files, each refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from stratus.errors import ConfigError
from stratus.families.repository import load_family
from stratus.runtimes import LoadOptions, candidates, load_runner
from stratus.runtimes.openvino_rt import output_names
from stratus.runtimes.ort import dense_probabilities, is_probability_map
from stratus.tiers import Tier
from stratus.tools.calibrate import classifier, labelled_data
from stratus.tools.datasets import Split
from stratus.tools.importer import ImportOptions, import_model, stage
from stratus.tools.importer.trial import temperature_warning
from tests import exports
from tests.unit.test_importer import random_linear


@pytest.fixture(scope="module")
def data() -> exports.Digits:
    return exports.digits()


@pytest.fixture(scope="module")
def models(data: exports.Digits) -> dict[str, Any]:
    return {kind: exports.fitted(kind, data) for kind in ("logistic", "forest", "mlp")}


def options(root: Path, **kwargs: Any) -> ImportOptions:
    settings: dict[str, Any] = {"family": "sk", "tier": "device", "root": root}
    settings.update(kwargs)
    return ImportOptions(**settings)


def served(root: Path, family: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """What an agent's runner answers for the family's current device variant."""
    spec = load_family(root / family / "family.toml")
    variant = spec.current_variant(Tier.DEVICE)
    runner = load_runner(spec, variant, LoadOptions(tier=Tier.DEVICE, cache_dir=root / ".cache"))
    try:
        return runner.infer({spec.inputs[0].name: x})
    finally:
        runner.close()


def test_the_default_zipmap_export_is_served_by_onnxruntime_in_class_order(
    tmp_path: Path, data: exports.Digits, models: dict[str, Any]
) -> None:
    model = models["logistic"]
    source = exports.skl_onnx(model, tmp_path / "logistic.onnx")
    root = tmp_path / "repo"
    result = import_model(source, options(root, data=data.npz(tmp_path / "d.npz", "X")))
    family = result.family
    assert family.confidence.output == "output_probability"
    assert not family.confidence.apply_softmax
    outputs = {t.name: (t.datatype, t.shape) for t in family.outputs}
    assert outputs == {"output_label": ("INT64", (-1,)), "output_probability": ("FP32", (-1, 10))}
    assert result.variant.runtimes == ("onnxruntime",)
    assert set(result.variant.files) == {"onnx"}  # no OpenVINO IR of a file OpenVINO cannot read
    assert any(
        "skipped openvino: it cannot run the file: output 'output_probability' is not a tensor" in n
        for n in result.notes
    )
    assert 'runtimes = ["onnxruntime"]' in (root / "sk" / "family.toml").read_text()
    assert {r.runtime for r in result.report.rows} == {"onnxruntime"} and result.report.ok
    assert "openvino for sk-device" in result.report.skipped
    answer = served(root, "sk", data.unseen.x)
    np.testing.assert_allclose(answer["output_probability"], model.predict_proba(data.unseen.x), atol=1e-5)
    assert np.array_equal(answer["output_label"], model.predict(data.unseen.x))
    accuracy = next(r.accuracy for r in result.report.rows)
    assert accuracy == pytest.approx(model.score(*_report_part(tmp_path / "d.npz", family)), abs=1e-9)


def _report_part(npz: Path, family: Any) -> tuple[np.ndarray, np.ndarray]:
    split = labelled_data.load_npz(family, npz).report
    return split.x, split.y


@pytest.mark.parametrize(
    ("kind", "operator"),
    [
        ("logistic", "ai.onnx.ml.LinearClassifier"),
        ("forest", "ai.onnx.ml.TreeEnsembleClassifier"),
        ("mlp", "ai.onnx.ml.ArrayFeatureExtractor"),
    ],
)
def test_zipmap_false_exports_skip_openvino_with_the_operator_named(
    tmp_path: Path, data: exports.Digits, models: dict[str, Any], kind: str, operator: str
) -> None:
    model = models[kind]
    source = exports.skl_onnx(model, tmp_path / f"{kind}.onnx", zipmap=False)
    root = tmp_path / "repo"
    result = import_model(source, options(root))
    assert result.family.confidence.output == "probabilities"  # the label comes first
    assert result.variant.runtimes == ("onnxruntime",)
    assert f"skipped openvino: it cannot run the file: unsupported operator(s) {operator}" in result.notes
    config = (root / "sk" / "family.toml").read_text()
    assert f"# openvino cannot run it: unsupported operator(s) {operator}" in config
    answer = served(root, "sk", data.unseen.x[:50])
    np.testing.assert_allclose(answer["probabilities"], model.predict_proba(data.unseen.x[:50]), atol=1e-5)


def test_runtimes_chosen_on_import_are_recorded_and_honoured(tmp_path: Path, models: dict[str, Any]) -> None:
    root = tmp_path / "repo"
    plain = random_linear(tmp_path / "plain.onnx")  # OpenVINO runs it, but we say no
    result = import_model(plain, options(root, family="p", runtimes=("onnxruntime",)))
    assert result.variant.runtimes == ("onnxruntime",)
    assert set(result.variant.files) == {"onnx"}
    assert {r.runtime for r in result.report.rows} == {"onnxruntime"}
    variant = load_family(root / "p" / "family.toml").variant("p-device")
    assert [c.runtime for c in candidates(variant, tier=Tier.EDGE, gpu=True)] == ["onnxruntime"]
    sk = exports.skl_onnx(models["logistic"], tmp_path / "lr.onnx", zipmap=False)
    with pytest.raises(ConfigError, match=r"lr\.onnx: openvino \(named by --runtimes\) cannot run it: "):
        import_model(sk, options(root, runtimes=("openvino",)))
    with pytest.raises(ConfigError, match=r"--runtimes litert: it does not read onnx files"):
        import_model(sk, options(root, runtimes=("litert",)))
    assert not (root / "sk").exists()


def test_family_toml_runtimes_key_is_optional_and_checked(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    import_model(random_linear(tmp_path / "a.onnx"), options(root, family="a"))
    config = root / "a" / "family.toml"
    assert "runtimes" not in config.read_text()  # every runtime ran it: nothing recorded
    assert load_family(config).variant("a-device").runtimes == ()
    text = config.read_text()
    config.write_text(text.replace("files = {", 'runtimes = ["onnx-runtime"]\nfiles = {'))
    with pytest.raises(ConfigError, match=r"key 'variants\[0\]\.runtimes': 'onnx-runtime' is not one of"):
        load_family(config)
    config.write_text(text.replace("files = {", "runtimes = []\nfiles = {"))
    with pytest.raises(ConfigError, match=r"must name at least one runtime"):
        load_family(config)


def test_a_pruned_mlp_whose_output_has_two_names_in_openvino_imports(
    tmp_path: Path, data: exports.Digits, models: dict[str, Any]
) -> None:
    """The label branch cut away, OpenVINO runs the MLP; compiled, its output is named both
    ``out_activations_result`` and ``probabilities``."""
    full = exports.skl_onnx(models["mlp"], tmp_path / "mlp.onnx", zipmap=False)
    pruned = tmp_path / "pruned.onnx"
    onnx.utils.extract_model(str(full), str(pruned), ["X"], ["probabilities"])
    result = import_model(pruned, options(tmp_path / "repo"))
    assert result.report.ok and result.variant.runtimes == ()
    assert {(r.runtime, r.format) for r in result.report.rows} >= {
        ("openvino", "openvino"),
        ("openvino", "onnx"),
    }
    expected = models["mlp"].predict_proba(data.unseen.x[:20])
    for row in result.report.rows:
        assert row.max_abs_diff < 1e-4
    np.testing.assert_allclose(
        served(tmp_path / "repo", "sk", data.unseen.x[:20])["probabilities"], expected, atol=1e-5
    )


class _Port:
    def __init__(self, *names: str) -> None:
        self.names = set(names)

    def get_names(self) -> set[str]:
        return self.names

    def get_any_name(self) -> str:
        return sorted(self.names)[0]


def test_openvino_outputs_are_matched_by_any_of_their_names() -> None:
    ports = [_Port("out_activations_result", "probabilities"), _Port("label")]
    assert output_names(ports, ["label", "probabilities"]) == ["probabilities", "label"]
    assert output_names([_Port("a", "b")], ["zzz"]) == ["a"]  # none listed: any name


def test_probability_maps_become_dense_rows_in_class_order() -> None:
    assert is_probability_map("seq(map(int64,tensor(float)))")
    assert is_probability_map("seq(map(string,tensor(float)))")
    assert not is_probability_map("tensor(float)")
    maps = [{2: 0.1, 0: 0.7, 1: 0.2}, {0: 0.0, 1: 1.0, 2: 0.0}]
    dense = dense_probabilities(maps, classes=3)
    assert dense.dtype == np.float32
    np.testing.assert_allclose(dense, [[0.7, 0.2, 0.1], [0.0, 1.0, 0.0]])
    assert dense_probabilities([], classes=3).shape == (0, 3)


# ---------------------------------------------------------------------------------------------
# Odd and broken files: one line, never a traceback
# ---------------------------------------------------------------------------------------------


def _sequence_output(path: Path) -> Path:
    """A sequence output that no ZipMap makes (SequenceConstruct)."""
    graph = helper.make_graph(
        [helper.make_node("SequenceConstruct", ["x"], ["seq"])],
        "odd",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, ["batch", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _fails_when_run(path: Path) -> Path:
    """Loads everywhere, fails on every input: a Reshape to a size the input never has
    (ONNX Runtime raises; OpenVINO answers an empty [0, 7] tensor, refused by the warm-up)."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 7])],
        [onnx.numpy_helper.from_array(np.array([-1, 7], np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_bytes(b"\x08\x07garbage, not a protobuf") and p, r"not a readable ONNX model"),
        (lambda p: p.write_bytes(b"") and p, r"(not a readable ONNX model|has 0 inputs)"),
        (_sequence_output, r"output 'seq' is a sequence; Stratus carries tensors"),
        (
            _fails_when_run,
            r"no runtime here can run it \(openvino: .*output 'y' has shape \[0, 7\].*; onnxruntime: ",
        ),
    ],
    ids=["garbage", "empty", "sequence", "fails-when-run"],
)
def test_odd_files_are_refused_in_one_line_by_the_command(tmp_path: Path, make: Any, message: str) -> None:
    source = tmp_path / "odd.onnx"
    make(source)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratus.cli",
            "models",
            "import",
            str(source),
            "--family",
            "odd",
            "--tier",
            "device",
            "--dir",
            str(tmp_path / "repo"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"stratus: error: {source}: "), done.stderr
    assert __import__("re").search(message, lines[0]), lines[0]
    assert not (tmp_path / "repo" / "odd").exists()


def test_an_unexpected_error_inside_the_import_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*_: Any) -> Any:
        raise KeyError("probabilities")

    monkeypatch.setattr(stage, "_output_kind", crash)
    root = tmp_path / "repo"
    with pytest.raises(
        ConfigError, match=r"a\.onnx: cannot import it: KeyError: 'probabilities' \(nothing was"
    ):
        import_model(random_linear(tmp_path / "a.onnx"), options(root))
    assert not (root / "sk").exists()


# ---------------------------------------------------------------------------------------------
# Warnings: a temperature at the edge of its range, a target the report split misses
# ---------------------------------------------------------------------------------------------


def test_a_temperature_at_the_edge_of_its_range_is_warned_about(
    tmp_path: Path, data: exports.Digits, models: dict[str, Any]
) -> None:
    assert temperature_warning("v", 1.0, False) == "" and temperature_warning("v", 3.9, True) == ""
    assert "under-confident" in temperature_warning("v", 0.25, False)
    assert "over-confident" in temperature_warning("v", 4.0, True)
    # A forest grown on every example, those of --data included: right on them all, its vote
    # shares far flatter than that, so the best temperature lies below the range.
    everything = Split(
        np.concatenate([data.fit.x, data.unseen.x]), np.concatenate([data.fit.y, data.unseen.y])
    )
    grown = exports.fitted("forest", exports.Digits(fit=everything, unseen=data.unseen), trees=20, depth=None)
    forest = exports.skl_onnx(grown, tmp_path / "forest.onnx", zipmap=False)
    npz = data.npz(tmp_path / "d.npz", "X")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratus.cli",
            "models",
            "import",
            str(forest),
            "--family",
            "rf",
            "--tier",
            "device",
            "--dir",
            str(tmp_path / "repo"),
            "--data",
            str(npz),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "temperature 0.25, fitted on the calibration part of --data" in done.stdout
    warning = "rf-device: fitted temperature 0.25 is at the edge of its range [0.25, 4]"
    assert f"warning: {warning}" in done.stdout
    assert f"stratus: warning: {warning}" in done.stderr
    assert "stratus models calibrate --data FILE.npz" in done.stderr


def _scores(tier: Tier, confidence: list[float], correct: list[bool]) -> classifier.TierScores:
    return classifier.TierScores(tier, tier.label, np.array(confidence), np.array(correct))


def test_calibrate_warns_when_the_report_split_misses_the_target() -> None:
    """The issue's case: the device alone reaches 0.88 on the calibration split, so its
    threshold is 0 (never escalate), and the report split says 0.8467."""
    n = 100
    on_calibration = [
        _scores(Tier.DEVICE, [0.9] * n, [True] * 90 + [False] * 10),
        _scores(Tier.CLOUD, [1.0] * n, [True] * n),
    ]
    on_report = [
        _scores(Tier.DEVICE, [0.9] * 150, [True] * 127 + [False] * 23),
        _scores(Tier.CLOUD, [1.0] * 150, [True] * 150),
    ]
    split = Split(np.zeros((1, 1), np.float32), np.zeros(1, np.int64))
    data = labelled_data.LabelledData(split, split, "100 calibration examples", "the other 150")
    result = classifier.choose(
        on_calibration, lambda: on_report, data, target_accuracy=0.88, max_escalation=None
    )
    assert result.thresholds == {Tier.DEVICE: 0.0}
    assert result.held_out.accuracy == pytest.approx(0.8467, abs=1e-4)
    (warning,) = result.warnings
    assert warning.startswith("the report split's accuracy 0.8467 is below the target 0.8800")
    assert "A threshold of 0 (device) means that tier never escalates" in warning
    assert "--target-accuracy 0.92" in warning
    assert "warning: the report split's accuracy 0.8467" in classifier.describe(result)
    fine = classifier.choose(
        on_calibration, lambda: on_calibration, data, target_accuracy=0.88, max_escalation=None
    )
    assert fine.warnings == ()
