"""Bring your own model, end to end: an ONNX file imported into a fresh repository, served by
a real router and agent, and queried with tritonclient."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as triton

from tests.unit.test_importer import linear_onnx

from .cluster import QUIET, Cluster, ready_count, wait_until


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
