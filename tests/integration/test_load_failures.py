"""A runtime that cannot load a variant never takes the process down.

Each test breaks real model files in a copy of the shipped repository, so the runtimes
refuse them for real: OpenVINO reads a corrupt IR, both generative runtimes a corrupt GGUF.
The next runtime in the order serves where one can; where none can, the process serves
every other family, the broken one is not ready (and says why), and each refusal is counted.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stratus.devtools.launcher import free_port
from stratus.runtimes import GENERATORS
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, fleet_status, infer, ready_count, wait_until

NOT_A_MODEL = b"this file was broken on purpose by a test\n"


def broken_copy(root: Path, *files: str) -> Path:
    """The shipped models folder with each of ``files`` (family/name) overwritten."""
    models = root / "models"
    shutil.copytree(MODELS, models)
    for name in files:
        (models / name).write_bytes(NOT_A_MODEL)
    return models


def load_failures(address: str) -> dict[tuple[str, str], float]:
    """stratus_model_load_failures_total by (variant, runtime), as scraped."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.labels["variant"], s.labels["runtime"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "stratus_model_load_failures_total"
    }


def model_ready(address: str, name: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        return stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=5).ready


def test_an_edge_agent_serves_through_the_next_runtime_and_without_the_family_none_loads(
    cluster: Cluster, tmp_path: Path, digits
) -> None:  # type: ignore[no-untyped-def]
    models = broken_copy(tmp_path, "digits/digits-medium.xml", "arith/arith-medium.gguf")
    metrics = f"127.0.0.1:{free_port()}"
    router = cluster.router().address
    cluster.agent("edge-1", router, "--models", str(models), "--precision", "fp32", "--metrics", metrics, tier="edge")
    wait_until(lambda: ready_count(router) == 1, timeout_s=30)

    # digits-medium's IR is OpenVINO's first choice on an edge server: ONNX Runtime serves it.
    (agent,) = fleet_status(router).agents
    assert "digits-medium" in agent.variants and "arith-medium" not in agent.variants
    _, served = infer(router, digits.held_out.x[:1], model="digits-medium")
    assert served.variant == "digits-medium" and served.agent == "edge-1"
    runtime = next(c for c in agent.variant_choices if c.startswith("digits-medium "))
    assert "onnxruntime" in agent.runtimes and "openvino " not in runtime

    # arith-medium loads in neither generative runtime: arith is not ready, and says why.
    assert model_ready(router, "digits") and not model_ready(router, "arith")
    (why,) = agent.unavailable
    assert why.startswith("arith (arith-medium): ") and "openvino_genai cannot load" in why
    counted = load_failures(metrics)
    assert counted[("digits-medium", "openvino")] == 1
    assert counted[("arith-medium", "openvino_genai")] == 1
    assert GENERATORS["llama_cpp"].availability().available, "llama.cpp is part of `make test`"
    assert "llama_cpp cannot load" in why and counted[("arith-medium", "llama_cpp")] == 1  # tried second

    shown = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", "status", "--router", router, "--agents"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert f"edge-1: not serving {why}" in shown


def test_a_cloud_gateway_serves_every_family_but_the_one_it_cannot_load(
    cluster: Cluster, tmp_path: Path, digits
) -> None:  # type: ignore[no-untyped-def]
    models = broken_copy(tmp_path, "defects/defects-large.onnx")
    metrics = f"127.0.0.1:{free_port()}"
    cloud = cluster.cloud("--models", str(models), "--metrics", metrics).address
    wait_until(lambda: model_ready(cloud, "digits"), timeout_s=30)
    assert not model_ready(cloud, "defects")
    response, served = infer(cloud, digits.held_out.x[:2], model="digits")
    assert served.variant.startswith("digits-large") and response.outputs[0].shape == [2, 10]
    with pytest.raises(grpc.RpcError) as refused:
        infer(cloud, digits.held_out.x[:1], model="defects")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "model 'defects' could not be loaded here" in refused.value.details()
    counted = load_failures(metrics)
    assert {runtime for (variant, runtime) in counted if variant == "defects-large"} == {"openvino", "onnxruntime"}
