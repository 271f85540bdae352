"""``stratus models import`` builds an imported model's INT8 and FP16 children: calibrated on
``--data`` (or a shipped family's bundled split), verified against their parent within the
family's ``max_accuracy_drop``, recorded in ``verified.toml``, and chosen by an agent only
where its CPU runs their arithmetic natively; never from synthetic data, and never half-done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from stratus.cli.main import main
from stratus.errors import ConfigError
from stratus.families.cpu import NATIVE_FLAGS, hardware_precisions, native_on
from stratus.families.precision import (
    choose_variant,
    file_sha256,
    load_verification,
    record_path,
    variant_files,
)
from stratus.families.repository import load_family
from stratus.tools.datasets import dataset_for
from stratus.tools.importer import ImportOptions, children, import_model, stage
from tests import exports

VNNI = hardware_precisions(["avx2", "avx512_vnni"], "x86_64")
PLAIN = hardware_precisions(["avx2", "fma"], "x86_64")


@pytest.fixture(scope="module")
def digits() -> exports.Digits:
    return exports.digits()


@pytest.fixture(scope="module")
def mlp(digits: exports.Digits) -> Any:
    return exports.fitted("mlp", digits)


@pytest.fixture
def model(tmp_path: Path, mlp: Any) -> Path:
    return exports.mlp_onnx(mlp, tmp_path / "mine.onnx")


@pytest.fixture
def npz(tmp_path: Path, digits: exports.Digits) -> Path:
    return digits.npz(tmp_path / "digits.npz", "x")


def options(root: Path, **kwargs: Any) -> ImportOptions:
    settings: dict[str, Any] = {"family": "mine", "tier": "device", "root": root, "hardware": VNNI}
    return ImportOptions(**{**settings, **kwargs})


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.is_dir() else {}


def op_types(path: Path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path)).graph.node}


def test_children_are_built_verified_and_recorded_with_data(tmp_path: Path, model: Path, npz: Path) -> None:
    result = import_model(model, options(tmp_path / "models", data=npz))
    family = load_family(tmp_path / "models" / "mine" / "family.toml")
    assert [(v.name, v.precision, v.parent) for v in family.variants] == [
        ("mine-device", "FP32", None),
        ("mine-device-int8", "INT8", "mine-device"),
        ("mine-device-fp16", "FP16", "mine-device"),
    ]
    assert [c.name for c in result.children] == ["mine-device-int8", "mine-device-fp16"]
    int8, fp16 = family.variant("mine-device-int8"), family.variant("mine-device-fp16")
    assert set(int8.files) == set(fp16.files) == {"onnx", "openvino"}
    assert all(v.tier is family.variant("mine-device").tier for v in (int8, fp16))
    assert {"QuantizeLinear", "DequantizeLinear", "MatMul"} <= op_types(int8.files["onnx"])
    half = onnx.load(str(fp16.files["onnx"]))
    assert any(t.data_type == TensorProto.FLOAT16 for t in half.graph.initializer)
    assert half.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT  # FP32 at the edges
    for child in (int8, fp16):  # each its own temperature, fitted as its parent's is
        assert any(n.startswith(f"{child.name}: temperature") and "--data" in n for n in result.notes)
    record = load_verification(family)
    assert record is not None and record.source == record_path(family)
    assert set(record.variants) == {"mine-device", "mine-device-int8", "mine-device-fp16"}
    for variant in family.variants:
        entry = record.variants[variant.name]
        files = variant_files(family, variant)
        assert entry.sha256 == {name: file_sha256(path) for name, path in files.items()}
        assert entry.within_tolerance and entry.accuracy_drop <= family.max_accuracy_drop
        assert record.problem(family, variant) is None
    assert {"onnxruntime", "openvino"} <= {r.runtime for r in result.report.rows if r.name == int8.name}
    files = {p.name for p in family.folder.iterdir()}  # nothing left behind (scratch, calibration)
    assert files == {"family.toml", "verified.toml"} | {
        f"{v.name}.{ext}" for v in family.variants for ext in ("onnx", "xml", "bin")
    }


def test_the_import_says_which_variant_each_cpu_serves(tmp_path: Path, model: Path, npz: Path) -> None:
    result = import_model(model, options(tmp_path / "models", data=npz))
    family, record = result.family, load_verification(result.family)
    served = {
        name: choose_variant(family, result.variant.tier, hardware=hw, record=record).variant.name
        for name, hw in (("vnni", VNNI), ("plain", PLAIN))
    }
    assert served == {"vnni": "mine-device-int8", "plain": "mine-device"}
    assert result.serving[0].startswith("this CPU would serve mine-device-int8 for mine-device: int8: native")
    assert f"mine-device-int8 (INT8) is chosen on {native_on('INT8')}" in result.serving
    assert f"mine-device-fp16 (FP16) is chosen on {native_on('FP16')}" in result.serving
    assert all(flag in native_on("INT8") for flag in (*NATIVE_FLAGS["INT8"]["x86"], "asimddp"))
    plain = import_model(model, options(tmp_path / "other", data=npz, hardware=PLAIN))
    assert plain.serving[0] == f"this CPU would serve mine-device for mine-device: fp32: {PLAIN.reason}"


def test_without_labelled_data_there_are_no_children_and_the_note_says_why(
    tmp_path: Path, model: Path, models_dir: Path
) -> None:
    result = import_model(model, options(tmp_path / "models"))
    assert result.children == () and [v.name for v in result.family.variants] == ["mine-device"]
    (note,) = [n for n in result.notes if "children" in n]
    assert "synthetic" in note and "--data FILE.npz" in note
    assert not (tmp_path / "models" / "mine" / "verified.toml").exists()  # FP32 needs no record
    assert sorted(p.name for p in (tmp_path / "models" / "mine").iterdir()) == [
        "family.toml",
        "mine-device.bin",
        "mine-device.onnx",
        "mine-device.xml",
    ]
    tflite = import_model(models_dir / "digits" / "digits-small.tflite", options(tmp_path / "t"))
    assert tflite.children == ()
    assert any("made from ONNX" in n and ".tflite" in n for n in tflite.notes)


def test_no_children_imports_the_fp32_variant_alone(
    tmp_path: Path, model: Path, npz: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "models"
    args = ["models", "import", str(model), "--family", "mine", "--tier", "device", "--models", str(root)]
    assert main([*args, "--data", str(npz), "--no-children"]) == 0
    said = capsys.readouterr().out
    assert "no INT8/FP16 children (--no-children)" in said and "(it has no children)" in said
    assert [v.name for v in load_family(root / "mine" / "family.toml").variants] == ["mine-device"]
    assert not (root / "mine" / "verified.toml").exists()
    with pytest.raises(SystemExit):
        main(["models", "import", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert "--no-children import the FP32 variant alone; by default an ONNX file with labelled data" in helped


def ruined(fp32_path: Path, path: Path, **_: Any) -> None:
    """An "INT8 child" that is the parent with every weight tensor's values shuffled: it
    runs, with the parent's tensors, and is mostly wrong."""
    graph = onnx.load(str(fp32_path))
    rng = np.random.default_rng(0)
    for tensor in graph.graph.initializer:
        values = numpy_helper.to_array(tensor).flatten()
        rng.shuffle(values)
        tensor.CopyFrom(numpy_helper.from_array(values.reshape(tensor.dims), tensor.name))
    onnx.save(graph, str(path))


def test_a_child_outside_tolerance_is_removed_and_the_import_still_succeeds(
    tmp_path: Path, model: Path, npz: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(children, "write_onnx_int8", ruined)
    result = import_model(model, options(tmp_path / "models", data=npz))
    folder = tmp_path / "models" / "mine"
    assert [c.name for c in result.children] == ["mine-device-fp16"]
    assert [v.name for v in load_family(folder / "family.toml").variants] == [
        "mine-device",
        "mine-device-fp16",
    ]
    assert not list(folder.glob("mine-device-int8*")) and not list(folder.glob(".*"))
    (note,) = [n for n in result.notes if "not kept" in n]
    assert note.startswith("mine-device-int8 not kept (its files removed): held-out accuracy drop ")
    drop = float(note.split("accuracy drop ")[1].split()[0])
    assert drop > 0.01 and "above the family's max_accuracy_drop 0.0100" in note
    record = load_verification(folder)
    assert record is not None and set(record.variants) == {"mine-device", "mine-device-fp16"}
    assert result.report.ok and {r.name for r in result.report.rows} == {"mine-device", "mine-device-fp16"}
    assert "mine-device-int8" not in (folder / "family.toml").read_text()


def test_a_refused_import_puts_the_config_the_record_and_the_folder_back(
    tmp_path: Path, model: Path, npz: Path, mlp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "models"
    import_model(model, options(root, data=npz))
    folder = root / "mine"
    before = snapshot(folder)
    seen: list[str] = []

    def refuse(*_: Any) -> None:
        seen.append((folder / "verified.toml").read_text())  # already rewritten with the edge line
        raise ConfigError("refused at the last step")

    monkeypatch.setattr(stage, "_commit", refuse)
    other = exports.mlp_onnx(mlp, tmp_path / "edge.onnx")
    with pytest.raises(ConfigError, match="refused at the last step"):
        import_model(other, options(root, tier="edge", data=npz))
    assert '[variants."mine-edge-int8"]' in seen[0]
    assert snapshot(folder) == before
    with pytest.raises(ConfigError, match="refused at the last step"):
        import_model(model, options(root, family="fresh", data=npz))
    assert not (root / "fresh").exists()


def test_a_small_cnn_gets_its_convolutions_quantized(tmp_path: Path, models_dir: Path) -> None:
    """The shipped defects-small CNN (Conv, MaxPool, Gemm) as a user's model, with 1,000 of
    its held-out images as --data: the INT8 child quantizes its Conv and Gemm nodes. (Its
    drop is near the limit: on 560 other images it measured 0.0107 and was not kept.)"""
    held_out = dataset_for("defects").held_out
    np.savez(tmp_path / "images.npz", image=held_out.x[:1000], labels=held_out.y[:1000])
    result = import_model(
        models_dir / "defects" / "defects-small.onnx",
        options(tmp_path / "models", family="cnn", data=tmp_path / "images.npz", convert=False),
    )
    assert [c.precision for c in result.children] == ["INT8", "FP16"]
    int8 = result.children[0]
    assert {"Conv", "Gemm", "QuantizeLinear", "DequantizeLinear"} <= op_types(int8.files["onnx"])
    assert any("(QDQ) of its Conv, Gemm, int8 symmetric weights" in n for n in result.notes)
    record = load_verification(result.family)
    assert record is not None and record.variants["cnn-device-int8"].within_tolerance
    assert record.variants["cnn-device-int8"].accuracy_drop <= result.family.max_accuracy_drop
