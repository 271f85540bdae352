"""Bring your own model, end to end: an ONNX file imported into a fresh repository, served by
a real router and agent, and queried with tritonclient."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as triton

from stratus.families.repository import load_family
from stratus.tools.calibrate import labelled_data
from tests import exports
from tests.unit.test_importer import linear_onnx

from .cluster import QUIET, Cluster, fleet_status, ready_count, wait_until


def test_an_imported_model_answers_through_the_fleet_as_onnxruntime_does(
    cluster: Cluster, tmp_path: Path
) -> None:
    rng = np.random.default_rng(3)
    model = linear_onnx(
        tmp_path / "mine.onnx",
        rng.normal(size=(12, 5)),
        rng.normal(size=5),
        input_name="features",
        output_name="logits",
    )
    root = tmp_path / "repo"
    imported = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratus.cli",
            "models",
            "import",
            str(model),
            "--family",
            "mine",
            "--tier",
            "device",
            "--dir",
            str(root),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.returncode == 0, imported.stderr
    assert "imported mine-device (device tier, FP32, current) into family 'mine'" in imported.stdout

    router = cluster.router().address
    cluster.start(
        "agent",
        [
            "agent",
            "--tier",
            "device",
            "--models",
            str(root),
            "--router",
            router,
            "--name",
            "mine-agent",
            *QUIET,
        ],
    )
    wait_until(lambda: ready_count(router) == 1)

    x = rng.normal(size=(7, 12)).astype(np.float32)
    tensor = triton.InferInput("features", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = triton.InferenceServerClient(router).infer("mine", [tensor])
    direct = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(
        ["logits"], {"features": x}
    )[0]
    answer = result.as_numpy("logits")
    assert answer.shape == (7, 5)
    np.testing.assert_allclose(answer, direct, rtol=1e-5, atol=1e-5)
    assert np.array_equal(answer.argmax(axis=1), direct.argmax(axis=1))
    parameters = result.get_response().parameters
    assert parameters["stratus.tier"].string_param == "device"
    assert parameters["stratus.variant"].string_param == "mine-device"


VNNI, PLAIN = "avx2,fma,avx512_vnni", "avx2,fma"


def test_an_imported_mlp_gets_verified_children_and_a_vnni_agent_serves_the_int8_one(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``models import --data``: the INT8 and FP16 children in family.toml, verified.toml
    vouching for them (within tolerance, every file hashed), and the agents' own choice:
    the INT8 child where STRATUS_CPU_FLAGS names VNNI, the FP32 variant where it names none."""
    digits = exports.digits()
    mlp = exports.fitted("mlp", digits)
    model = exports.mlp_onnx(mlp, tmp_path / "mlp.onnx", input_name="pixels")
    npz = digits.npz(tmp_path / "digits.npz", "pixels")
    root = tmp_path / "repo"
    imported = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "models", "import", str(model), "--family", "mlp",
         "--tier", "device", "--dir", str(root), "--data", str(npz)],
        check=False, capture_output=True, text=True, timeout=120,
        env={**os.environ, "STRATUS_CPU_FLAGS": VNNI},
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert "Traceback" not in imported.stderr
    assert (
        "imported mlp-device (device tier, FP32, current), mlp-device-int8 (INT8), mlp-device-fp16 (FP16) "
        "into family 'mlp'"
    ) in imported.stdout
    assert (
        "this CPU (flags from STRATUS_CPU_FLAGS) would serve mlp-device-int8 for mlp-device: int8: native "
        "(cpu flags: avx512_vnni)"
    ) in imported.stdout
    folder = root / "mlp"
    config = tomllib.loads((folder / "family.toml").read_text())
    assert [(v["name"], v["precision"], v.get("parent")) for v in config["variants"]] == [
        ("mlp-device", "FP32", None),
        ("mlp-device-int8", "INT8", "mlp-device"),
        ("mlp-device-fp16", "FP16", "mlp-device"),
    ]
    assert all(v["tier"] == "device" for v in config["variants"])
    record = tomllib.loads((folder / "verified.toml").read_text())
    limit = record["family"]["max_accuracy_drop"]
    hashed = {}
    for name, entry in record["variants"].items():
        assert entry["within_tolerance"] and entry["accuracy_drop"] <= limit, name
        hashed.update(entry["sha256"])
    on_disk = {p.name for p in folder.iterdir()} - {"family.toml", "verified.toml"}
    assert set(hashed) == on_disk  # every file of every variant, nothing else
    for name, digest in hashed.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest

    router = cluster.router().address
    for name, flags in (("vnni", VNNI), ("plain", PLAIN)):
        cluster.agent(name, router, models=str(root), env={"STRATUS_CPU_FLAGS": flags})
    wait_until(lambda: ready_count(router) == 2)
    served = {a.id: list(a.variants) for a in fleet_status(router).agents}
    assert served == {"vnni": ["mlp-device-int8"], "plain": ["mlp-device"]}
    report = labelled_data.load_npz(load_family(folder / "family.toml"), npz).report
    x = report.x[:64]
    tensor = triton.InferInput("pixels", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = triton.InferenceServerClient(router).infer("mlp-device-int8", [tensor])
    assert result.get_response().parameters["stratus.variant"].string_param == "mlp-device-int8"
    agreement = float((result.as_numpy("probabilities").argmax(axis=1) == mlp.predict(x)).mean())
    assert agreement >= 0.98, agreement  # the INT8 child answers as the model does
