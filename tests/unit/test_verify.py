"""``models verify`` on the real repository: precision checks, the record, its freshness."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from stratus.families.precision import format_record, load_verification
from stratus.families.repository import ModelRepository, load_family
from stratus.families.spec import FamilySpec
from stratus.runtimes import available_runtimes
from stratus.tools.datasets import dataset_for
from stratus.tools.verify.classifier import build_record, record_state, verify_family
from stratus.tools.verify.report import TOLERANCE, VerifyReport, VerifyRow, format_report


@pytest.fixture(scope="module")
def rows(repository: ModelRepository, tmp_path_factory: pytest.TempPathFactory) -> list[VerifyRow]:
    usable = {name for name, status in available_runtimes().items() if status.available}
    family = repository.family("digits")
    return verify_family(family, dataset_for("digits").held_out, usable, tmp_path_factory.mktemp("cache"))


def test_every_variant_runs_and_runtimes_agree(rows: list[VerifyRow]) -> None:
    assert not [r for r in rows if r.failed], format_report(VerifyReport(rows=tuple(rows), skipped={}))
    assert all(r.max_abs_diff <= TOLERANCE for r in rows if r.precision == "FP32")
    names = {r.name for r in rows}
    assert {"digits-small-int8", "digits-medium-int8", "digits-medium-fp16", "digits-large-fp16"} <= names
    small_int8 = {r.runtime for r in rows if r.name == "digits-small-int8"}
    assert {"litert", "onnxruntime", "openvino"} <= small_int8


def test_children_are_compared_with_their_parent(rows: list[VerifyRow]) -> None:
    for row in rows:
        assert row.size_kib > 0 and set(row.latency_ms) == {"b1", "b32"}
        if row.parent is None:
            assert row.agreement is None and row.accuracy_drop is None
        else:
            assert row.agreement is not None and row.agreement >= 0.98
            assert row.accuracy_drop is not None and row.within_tolerance
    tflite = [r for r in rows if r.format == "tflite"]
    assert min(r.size_kib for r in tflite if r.precision == "INT8") < 0.35 * max(r.size_kib for r in tflite)


def test_outside_tolerance_is_reported_but_does_not_fail(rows: list[VerifyRow]) -> None:
    worse = [
        dataclasses.replace(r, accuracy_drop=0.05, within_tolerance=False)
        if r.name == "digits-small-int8"
        else r
        for r in rows
    ]
    report = VerifyReport(rows=tuple(worse), skipped={})
    assert report.ok
    text = format_report(report)
    assert "outside tolerance (drop 0.0500)" in text
    assert "outside tolerance (reported, never served): digits-small-int8" in text
    assert "verdict: PASS" in text


def test_disagreeing_runtimes_fail(rows: list[VerifyRow]) -> None:
    fp16 = dataclasses.replace(next(r for r in rows if r.precision == "FP16"), max_abs_diff=0.01)
    int8 = dataclasses.replace(next(r for r in rows if r.precision == "INT8"), runtime_agreement=0.9)
    assert fp16.failed and int8.failed and fp16.status == "runtimes disagree"
    assert not VerifyReport(rows=(fp16,), skipped={}).ok


def test_the_committed_record_is_what_verify_writes(
    repository: ModelRepository, rows: list[VerifyRow]
) -> None:
    family = repository.family("digits")
    committed = load_verification(family)
    assert committed is not None
    assert format_record(build_record(family, rows)) == format_record(committed)
    assert all(entry.within_tolerance for entry in committed.variants.values())
    assert record_state(family).startswith("fresh")


@pytest.fixture
def family_copy(repository: ModelRepository, tmp_path: Path) -> FamilySpec:
    shutil.copytree(repository.family("digits").folder, tmp_path / "digits")
    return load_family(tmp_path / "digits" / "family.toml")


def test_a_changed_file_or_no_record_is_reported(family_copy: FamilySpec) -> None:
    (family_copy.folder / "digits-medium-fp16.bin").write_bytes(b"changed")
    state = record_state(family_copy)
    assert state.startswith("stale") and "digits-medium-fp16.bin changed" in state
    (family_copy.folder / "verified.toml").unlink()
    assert record_state(family_copy).startswith("missing")
