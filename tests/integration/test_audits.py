"""Audits through a real fleet: a share of the answers settled on devices is asked of the cloud
too, and counted there and in the router; `stratus fleet accuracy digits --agents` ranks a
device agent whose model swaps classes last, with an agreement near its true accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper, numpy_helper

from stratus.devtools.launcher import free_port
from stratus.serving.channels import open_sync_channel
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, ready_count, wait_until
from .load import Load
from .test_metrics import count, samples, scrape
from .test_stream_bounds import settled_count
from .variants import copy_digits

# Three pairs of classes swapped: the model stays as sure as before, but is right only on 6-9.
SWAPPED = [1, 0, 3, 2, 5, 4, 6, 7, 8, 9]
AGENT = ["--variants", "digits-small", "--runtimes", "onnxruntime"]


def swap_classes(source: Path, target: Path) -> None:
    """digits-small with its output columns reordered by SWAPPED (a Gather after the softmax)."""
    model = onnx.load(source)
    graph = model.graph
    last = next(node for node in graph.node if "probabilities" in node.output)
    last.output[list(last.output).index("probabilities")] = "unswapped"
    graph.initializer.append(numpy_helper.from_array(np.array(SWAPPED, dtype=np.int64), "swap"))
    graph.node.append(helper.make_node("Gather", ["unswapped", "swap"], ["probabilities"], axis=1))
    onnx.checker.check_model(model)
    onnx.save(model, target)


@pytest.fixture
def broken_models(tmp_path: Path) -> Path:
    root = copy_digits(tmp_path / "broken")
    swap_classes(MODELS / "digits" / "digits-small.onnx", root / "digits" / "digits-small.onnx")
    return root


def true_accuracy(model: Path, x: np.ndarray, labels: np.ndarray) -> float:
    session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (scores,) = session.run(["probabilities"], {"input": x.astype(np.float32)})
    return float((scores.argmax(axis=1) == labels).mean())


def cloud_items(cloud: str) -> int:
    with open_sync_channel(cloud) as channel:
        stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            pb.ModelStatisticsRequest(name="digits"), timeout=5
        )
    return int(stats.model_stats[0].inference_count)


def accuracy(router: str, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "stratus.cli", "fleet", "accuracy", "digits", "--router", router, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


def accuracy_json(router: str) -> dict[str, Any]:
    done = accuracy(router, "--agents", "--json")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def outcomes(metrics: str) -> tuple[float, float, float]:
    """The router's audit counters for digits' device tier: agreed, disagreed, dropped."""
    counted = samples(scrape(metrics))
    device = {"family": "digits", "tier": "device"}
    return tuple(  # type: ignore[return-value]
        count(counted, "stratus_router_audits_total", outcome=outcome, **device)
        for outcome in ("agreed", "disagreed", "dropped")
    )


def audited(found: dict[str, Any]) -> dict[str, int]:
    return {a["agent"]: a["live"]["audits"] for a in found["agents"]}


def test_audits_reach_the_cloud_and_rank_a_broken_agent_last(
    cluster: Cluster,
    broken_models: Path,
    digits,  # type: ignore[no-untyped-def]
) -> None:
    metrics = f"127.0.0.1:{free_port()}"
    cloud = cluster.cloud().address
    router = cluster.router(
        "--cloud", cloud, "--metrics", metrics, "--audit-share", "0.5", "--audit-max-per-s", "1000"
    ).address
    for name in ("device-1", "device-2"):
        cluster.agent(name, router, *AGENT)
    cluster.agent("device-bad", router, *AGENT, models=str(broken_models))
    wait_until(lambda: ready_count(router) == 3, timeout_s=90)
    wait_until(lambda: accuracy_json(router)["top_tier"] == "cloud", timeout_s=30)  # the link learnt digits
    before = cloud_items(cloud)
    with Load(router, digits.held_out.x, clients=6) as load:
        wait_until(
            lambda: min(audited(accuracy_json(router)).values(), default=0) >= 80, timeout_s=120, interval_s=1
        )
    assert not load.errors, load.errors

    # The cloud answers every climb the clients' items made, and every audited item besides.
    # The last audits queued when the load stopped are still on their way for a moment: every
    # figure is read once neither the cloud's count nor the router's audits move any more (read
    # while they did, the per-agent counts came later than the counters: 336 against 320).
    climbed = sum(1 for answer in load.answers if answer.tier is Tier.CLOUD)
    settled_count(lambda: cloud_items(cloud) + sum(outcomes(metrics)))
    agreed, disagreed, dropped = outcomes(metrics)
    assert cloud_items(cloud) - before == climbed + agreed + disagreed
    found = accuracy_json(router)
    assert agreed > 0 and disagreed > 0 and dropped == found["dropped"] == 0

    # Per agent: the broken one last, its agreement near what it truly gets right.
    ranked = found["agents"]
    assert [a["agent"] for a in ranked][-1] == "device-bad", ranked
    bad = ranked[-1]["live"]
    truth = true_accuracy(
        broken_models / "digits" / "digits-small.onnx", digits.held_out.x, digits.held_out.y
    )
    assert 0.25 < truth < 0.55  # right on four classes of ten
    assert bad["lower"] - 0.05 <= truth <= bad["upper"] + 0.05, (bad, truth)
    assert ranked[-1]["verdict"] == "drifted"
    assert all(a["verdict"] != "drifted" and a["live"]["agreement"] > 0.9 for a in ranked[:-1]), ranked

    # Per tier: every audit counted once; the biased sample of escalated items kept apart.
    (row,) = found["tiers"]
    assert row["tier"] == "device" and row["variants"] == ["digits-small"]
    assert row["live"]["audits"] == sum(audited(found).values()) == agreed + disagreed
    assert row["calibrated"]["agreement"] > 0.95 and row["verdict"] == "drifted"  # a third of it is broken
    assert row["escalated"]["audits"] > 0

    table = accuracy(router, "--agents")
    assert table.returncode == 0, table.stderr
    assert table.stdout.rstrip().splitlines()[-1].startswith("device-bad")


def test_accuracy_is_read_with_the_status_role(cluster: Cluster, tmp_path: Path) -> None:
    """Behind --private-status, as Status is: the operator token opens it; an unknown family is
    then a clear NOT_FOUND, not an empty table."""
    token = tmp_path / "operator.token"
    token.write_text("operator-secret\n")
    router = cluster.router("--private-status", "--operator-token-file", str(token)).address
    base = {k: v for k, v in os.environ.items() if not k.startswith("STRATUS_")}

    def asked(secret: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "stratus.cli", "fleet", "accuracy", "digits", "--router", router]
        env = {**base, "STRATUS_OPERATOR_TOKEN": secret}
        return subprocess.run(command, capture_output=True, text=True, timeout=30, env=env, check=False)

    refused = asked("wrong")
    assert refused.returncode == 2 and "Accuracy needs the operator token" in refused.stderr, refused.stderr
    unknown = asked("operator-secret")
    assert unknown.returncode == 2, unknown.stdout
    assert unknown.stderr.strip() == "stratus: error: NOT_FOUND: no agent serves a family 'digits'"
