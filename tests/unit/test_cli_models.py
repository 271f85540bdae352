"""``stratus models verify`` as a user runs it: a real process, table and JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


def stratus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stratus.cli", *args], check=False, capture_output=True, text=True, timeout=300
    )


def test_verify_json_lists_every_runtime_of_digits_small(models_dir: Path) -> None:
    result = stratus("models", "verify", str(models_dir), "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["variants"]
    assert {"name", "tier", "runtime", "accuracy", "max_abs_diff"} <= set(rows[0])
    small = {r["runtime"] for r in rows if r["name"] == "digits-small"}
    assert {"onnxruntime", "openvino", "litert"} <= small
    large = [r for r in rows if r["name"] == "digits-large"]
    assert large and all(r["accuracy"] >= 0.98 for r in large)
    assert all(r["max_abs_diff"] <= 1e-4 for r in rows if r["precision"] == "FP32")
    children = [r for r in rows if r["parent"] and r["kind"] == "classifier"]
    assert {r["precision"] for r in children} == {"INT8", "FP16"}
    assert all(r["within_tolerance"] and set(r["latency_ms"]) == {"b1", "b32"} for r in children)
    generated = [r for r in rows if r["kind"] == "generative"]
    assert {r["name"] for r in generated} == {"arith-small", "arith-medium", "arith-large-fp16"}
    assert all(r["accuracy"] > 0.7 and r["runtime_agreement"] >= 0.99 for r in generated)


def test_verify_fails_when_a_variant_cannot_load(models_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(models_dir / "digits", tmp_path / "digits")
    (tmp_path / "digits" / "digits-medium.onnx").write_bytes(b"not an onnx file")
    result = stratus("models", "verify", str(tmp_path))
    assert result.returncode == 1
    assert "FAIL" in result.stdout
    assert "digits-medium" in result.stdout and "onnxruntime" in result.stdout


def test_malformed_repository_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "family.toml").write_text("[family]\n")
    result = stratus("models", "verify", str(tmp_path))
    assert result.returncode == 2
    assert "family.toml: key 'family.name': is missing" in result.stderr
