"""The model repository reader: the shipped family loads, malformed configs are refused precisely."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from stratus.errors import ConfigError, InvalidInput, NotFound
from stratus.families.confidence import PASS_ALL
from stratus.families.repository import ModelRepository, load_family
from stratus.families.spec import CalibrationRecord
from stratus.families.writer import write_thresholds
from stratus.tiers import Tier


def test_shipped_digits_family(repository: ModelRepository) -> None:
    family = repository.family("digits")
    fp32 = [v for v in family.variants if v.precision == "FP32"]
    assert [v.name for v in fp32] == ["digits-small", "digits-medium", "digits-large"]
    assert [v.tier for v in fp32] == [Tier.DEVICE, Tier.EDGE, Tier.CLOUD]
    children = {v.name: (v.precision, v.parent) for v in family.variants if v.parent}
    assert children == {
        "digits-small-int8": ("INT8", "digits-small"),
        "digits-medium-int8": ("INT8", "digits-medium"),
        "digits-medium-fp16": ("FP16", "digits-medium"),
        "digits-large-fp16": ("FP16", "digits-large"),
    }
    assert family.max_accuracy_drop == 0.01
    assert all(v.temperature > 0 for v in family.variants)
    assert set(family.variant("digits-small").files) == {"tflite", "onnx", "openvino"}
    assert family.inputs[0].shape == (-1, 64) and family.outputs[0].shape == (-1, 10)
    assert repository.resolve("digits-large") == (family, family.variant("digits-large"))
    assert repository.resolve("digits") == (family, None)


def test_unknown_models_are_not_found(repository: ModelRepository) -> None:
    with pytest.raises(NotFound, match="unknown model 'letters'"):
        repository.resolve("letters")
    with pytest.raises(NotFound, match="no variant 'digits-huge'"):
        repository.family("digits").variant("digits-huge")


def test_inputs_are_checked_against_the_family(repository: ModelRepository) -> None:
    family = repository.family("digits")
    family.check_inputs({"input": np.zeros((3, 64), np.float32)})
    with pytest.raises(InvalidInput, match=r"shape \[3, 63\] does not fit the model's \[-1, 64\]"):
        family.check_inputs({"input": np.zeros((3, 63), np.float32)})
    with pytest.raises(InvalidInput, match="datatype is FP64, the model takes FP32"):
        family.check_inputs({"input": np.zeros((3, 64), np.float64)})
    with pytest.raises(InvalidInput, match="has no input 'image'"):
        family.check_inputs({"image": np.zeros((3, 64), np.float32)})
    with pytest.raises(InvalidInput, match="needs input 'input'"):
        family.check_inputs({})


@pytest.fixture
def family_copy(tmp_path: Path, models_dir: Path) -> Path:
    target = tmp_path / "digits"
    shutil.copytree(models_dir / "digits", target)
    return target / "family.toml"


@pytest.mark.parametrize(
    ("old", "new", "key", "problem"),
    [
        ('tier = "edge"', 'tier = "fog"', "variants[2].tier", "'fog' is not one of device, edge, cloud"),
        (
            'datatype = "FP32"\nshape = [-1, 64]',
            'datatype = "FP31"\nshape = [-1, 64]',
            "inputs[0].datatype",
            "'FP31' is not one of",
        ),
        ("shape = [-1, 64]", "shape = [-1, 0]", "inputs[0].shape", "dimensions must be positive"),
        ('method = "max_softmax"', 'method = "vibes"', "confidence.method", "'vibes' is not one of"),
        (
            'output = "probabilities"',
            'output = "logits"',
            "confidence.output",
            "is not one of the family's outputs",
        ),
        (
            "[thresholds]\ndevice = ",
            "[thresholds]\ndevice = 1.5 # ",
            "thresholds.device",
            "is not in [0, 1] (or 1.0001: the tier passes every request up)",
        ),
        (
            "[thresholds]\ndevice = ",
            '[thresholds]\ndevice = "high" # ',
            "thresholds.device",
            "must be a float, not str",
        ),
        (
            '[current]\ndevice = "digits-small"',
            '[current]\ndevice = "digits-medium"',
            "current.device",
            "'digits-medium' is on the edge tier",
        ),
        (
            '[current]\ndevice = "digits-small"',
            '[current]\ndevice = "digits-small-int8"',
            "current.device",
            "name its parent 'digits-small'",
        ),
        (
            '[current]\ndevice = "digits-small"',
            '[current]\ndevice = "digits-tiny"',
            "current.device",
            "'digits-tiny' is not a variant",
        ),
        ('onnx = "digits-large.onnx"', 'onnx = "missing.onnx"', "variants[5].files.onnx", "does not exist"),
        ('onnx = "digits-large.onnx"', 'pt = "digits-large.onnx"', "variants[5].files.pt", "unknown format"),
        (
            "max_accuracy_drop = 0.01",
            "max_accuracy_drop = 1.5",
            "family.max_accuracy_drop",
            "between 0 and 1",
        ),
        (
            "max_accuracy_drop = 0.01",
            'max_accuracy_drop = "low"',
            "family.max_accuracy_drop",
            "must be a float",
        ),
        (
            'parent = "digits-small"',
            'parent = "digits-tiny"',
            "variants[1].parent",
            "'digits-tiny' is not a variant of this family",
        ),
        (
            'parent = "digits-small"',
            'parent = "digits-medium"',
            "variants[1].parent",
            "on the edge tier, not device",
        ),
        (
            'parent = "digits-medium"',
            'parent = "digits-medium-int8"',
            "variants[3].parent",
            "is INT8, not FP32",
        ),
        ('parent = "digits-small"\n', "", "variants[1].parent", "every INT8 variant names its FP32 parent"),
        (
            'precision = "FP32"\ntemperature',
            'precision = "FP32"\nparent = "digits-large"\ntemperature',
            "variants[0].parent",
            "an FP32 variant has no parent",
        ),
        ("temperature = ", "temperature = -", "variants[0].temperature", "must be a positive number"),
        ('name = "digits"', 'nmae = "digits"', "family.name", "is missing"),
        ('name = "digits-medium"', 'name = "digits-small"', "variants", "listed more than once"),
        ("cloud_share = 0.0159", "cloud_share = 1.59", "calibration.cloud_share", "must lie between 0 and 1"),
        ("cloud_share = 0.0159", 'cloud_share = "1.6%"', "calibration.cloud_share", "must be a float"),
        ("cloud_share = 0.0159", "cloud_shares = 0", "calibration.cloud_shares", "is not a known setting"),
        ('goal = "max_escalation 0.04"\n', "", "calibration.goal", "is missing"),
    ],
)
def test_malformed_config_names_file_key_and_problem(
    family_copy: Path, old: str, new: str, key: str, problem: str
) -> None:
    text = family_copy.read_text()
    assert old in text
    family_copy.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError) as error:
        load_family(family_copy)
    message = str(error.value)
    assert str(family_copy) in message and f"key '{key}'" in message and problem in message


def test_invalid_toml_is_refused_with_the_file_name(family_copy: Path) -> None:
    family_copy.write_text("[family\nname = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_family(family_copy)


def test_a_pass_all_threshold_is_written_and_read_back(family_copy: Path) -> None:
    write_thresholds(family_copy, {Tier.DEVICE: PASS_ALL, Tier.EDGE: 0.5})
    assert load_family(family_copy).thresholds == {Tier.DEVICE: PASS_ALL, Tier.EDGE: 0.5}
    written = family_copy.read_text().splitlines()
    assert "device = 1.0001  # above 1: the device tier answers nothing, every request passes it up" in written
    assert "edge = 0.5000" in written


def test_write_thresholds_replaces_only_the_table(family_copy: Path) -> None:
    before = family_copy.read_text()
    write_thresholds(family_copy, {Tier.DEVICE: 0.91234, Tier.EDGE: 0.5})
    family = load_family(family_copy)
    assert family.thresholds == {Tier.DEVICE: 0.9123, Tier.EDGE: 0.5}
    after = family_copy.read_text()
    assert after.split("[thresholds]")[0] == before.split("[thresholds]")[0]
    assert after.split("[[variants]]", 1)[1] == before.split("[[variants]]", 1)[1]


def test_the_calibration_record_is_read_and_rewritten_with_the_thresholds(family_copy: Path) -> None:
    """calibrate writes what its thresholds gave beside them; a second calibration replaces
    it (one table, the rest of the file untouched); thresholds written without a record
    drop it, since it would describe other thresholds."""
    recorded = load_family(family_copy).calibration
    assert recorded == CalibrationRecord(
        goal="max_escalation 0.04",
        data="the bundled calibration split (315 examples)",
        accuracy=0.9841,
        cloud_share=0.0159,
    )
    before = family_copy.read_text()
    again = CalibrationRecord(
        goal="target_accuracy 0.99", data='a "quoted" file\\name', accuracy=0.99, cloud_share=0.25
    )
    write_thresholds(family_copy, {Tier.DEVICE: 0.8, Tier.EDGE: 0.7}, again)
    write_thresholds(family_copy, {Tier.DEVICE: 0.8, Tier.EDGE: 0.7}, again)
    rewritten = load_family(family_copy)
    assert rewritten.calibration == again and rewritten.thresholds == {Tier.DEVICE: 0.8, Tier.EDGE: 0.7}
    after = family_copy.read_text()
    assert after.count("[calibration]") == 1 and after.count("# Written with [thresholds]") == 1
    assert after.split("[thresholds]")[0] == before.split("[thresholds]")[0]
    assert after.split("[[variants]]", 1)[1] == before.split("[[variants]]", 1)[1]
    write_thresholds(family_copy, {Tier.DEVICE: 0.8, Tier.EDGE: 0.7})
    assert load_family(family_copy).calibration is None
    assert "[calibration]" not in family_copy.read_text() and "# Written with" not in family_copy.read_text()


def test_empty_repository_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no \*/family\.toml"):
        ModelRepository.load(tmp_path)


@pytest.mark.parametrize("where", ["../outside.onnx", "/etc/hostname", "link.onnx"])
def test_a_file_outside_the_family_folder_is_refused(family_copy: Path, where: str) -> None:
    """A family.toml names files of its own folder only: "..", an absolute path or a link out
    would let a model folder load (and an agent serve) any file the process can read."""
    folder = family_copy.parent
    (folder.parent / "outside.onnx").write_bytes((folder / "digits-small.onnx").read_bytes())
    (folder / "link.onnx").symlink_to(folder.parent / "outside.onnx")
    text = family_copy.read_text()
    family_copy.write_text(text.replace('onnx = "digits-small.onnx"', f'onnx = "{where}"', 1))
    with pytest.raises(ConfigError, match="is outside the family folder") as refused:
        load_family(family_copy)
    assert "key 'variants[0].files.onnx'" in str(refused.value)


def test_a_family_may_keep_its_inputs_on_the_site(family_copy: Path) -> None:
    """[privacy] escalate (issue 36 §2): true unless the file says false; it travels in the
    Hello, so a router sees what the agent's files say."""
    from stratus.convert.fleet import family_from_wire, family_to_wire
    from stratus.families.description import described

    toml = family_copy
    assert load_family(toml).escalate
    assert family_from_wire(family_to_wire(described(load_family(toml)))).escalate
    toml.write_text(toml.read_text() + "\n[privacy]\nescalate = false\n")
    kept = load_family(toml)
    assert not kept.escalate and not family_from_wire(family_to_wire(described(kept))).escalate


@pytest.mark.parametrize(
    ("table", "says"),
    [("escalate = 0", "key 'privacy.escalate': must be a bool, not int"), ("share = true", "key 'privacy.share': is not a known setting")],
)
def test_a_malformed_privacy_table_is_refused_by_key(family_copy: Path, table: str, says: str) -> None:
    toml = family_copy
    toml.write_text(toml.read_text() + f"\n[privacy]\n{table}\n")
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_family(toml)
