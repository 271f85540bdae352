"""Offline-first (issue 36), with real processes: while the cloud is away, unsure answers come
back provisional with an id and are kept on disk; a router killed with SIGKILL loses none of
them; once the cloud is back every one is judged, and the corrections are exactly the items
the cloud's model, run here directly on its own file, answers otherwise. A full store refuses
as documented; ``stratus.explain`` tells the path a request took."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort

from stratus.convert import codec
from stratus.convert.parameters import Served
from stratus.devtools.launcher import free_port
from stratus.serving.channels import open_sync_channel
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, infer, ready_count, request, wait_until
from .variants import copy_digits

REQUESTS = 500


def deferring(models: Path, **bounds: int) -> Path:
    toml = models / "digits" / "family.toml"
    extra = "".join(f"{key} = {value}\n" for key, value in bounds.items())
    toml.write_text(toml.read_text() + f"\n[offline]\ndefer = true\n{extra}")
    return models


def deferred_files(state: Path) -> list[Path]:
    return sorted((state / "deferred").glob("*.deferred"))


def corrections(router: str, **fields: object) -> list[fpb.Correction]:
    with open_sync_channel(router) as channel:
        return list(fpb_grpc.FleetStub(channel).Corrections(fpb.CorrectionsRequest(**fields), timeout=10))  # type: ignore[arg-type]


def ask(
    router: str, x: np.ndarray, request_id: str = "", **parameters: object
) -> tuple[pb.ModelInferResponse, Served]:
    """As cluster.infer, with the client's request id."""
    message = request(x, "digits", **parameters)
    message.id = request_id
    with open_sync_channel(router) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=10)
    return response, Served.read(response.parameters)


def cloud_labels(variant: str, x: np.ndarray) -> np.ndarray:
    """The cloud's variant, run here on its own model file."""
    session = ort.InferenceSession(
        str(MODELS / "digits" / f"{variant}.onnx"), providers=["CPUExecutionProvider"]
    )
    (scores,) = session.run(None, {"input": x.astype(np.float32)})
    labels: np.ndarray = np.asarray(scores).argmax(axis=1)
    return labels


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        return str(response.read().decode())


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text page (0 when it is absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
        if not wanted and line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_provisional_answers_survive_a_router_crash_and_are_judged_when_the_cloud_returns(  # type: ignore[no-untyped-def]
    cluster: Cluster, tmp_path: Path, digits
) -> None:
    cloud_address = f"127.0.0.1:{free_port()}"
    router_address = f"127.0.0.1:{free_port()}"
    state = tmp_path / "state"
    models = deferring(copy_digits(tmp_path / "models"))
    cloud = cluster.cloud("--listen", cloud_address)
    router_args = ["--listen", router_address, "--cloud", cloud_address, "--state-dir", str(state)]
    cluster.router(*router_args)
    cluster.agent("dev-1", router_address, "--models", str(models))
    wait_until(lambda: ready_count(router_address) == 1, 60)
    x = digits.held_out.x[:REQUESTS].astype(np.float32)
    _, served = infer(router_address, x[:8], min_confidence=1.0)
    assert served.tier.label == "cloud" and not served.provisional  # the cloud is there: no deferral

    cloud.kill()
    device_labels: dict[str, int] = {}
    provisional: list[int] = []
    for row in range(REQUESTS):
        response, served = ask(router_address, x[row : row + 1], f"r{row}")
        answered = codec.decode_response_outputs(response)["probabilities"]
        unsure = served.confidence < 0.7366  # the device threshold in models/digits/family.toml
        assert served.tier.label == "device", served
        assert served.provisional == unsure, (row, served)  # every unsure item, and only those
        if unsure:
            assert served.degraded and served.request_id == f"r{row}" == response.id, served
            assert "answered provisionally" in served.reason, served.reason
            provisional.append(row)
            device_labels[f"r{row}"] = int(answered.argmax(axis=1)[0])
    assert provisional, "no item was unsure: the test proves nothing"
    assert len(deferred_files(state)) == len(provisional)

    cluster.latest("router").kill()  # SIGKILL: nothing is flushed on the way out
    cluster.router(*router_args)
    cluster.agent("dev-2", router_address, "--models", str(models))  # dev-1 is still linking back, too
    wait_until(lambda: ready_count(router_address) >= 1, 60)
    assert len(deferred_files(state)) == len(provisional)  # nothing acknowledged was lost

    cluster.cloud("--listen", cloud_address, role="cloud-again")
    wait_until(lambda: not deferred_files(state), 90)  # every deferred request judged
    made = corrections(router_address)
    judged_by = {c.cloud.variant for c in made} or {"digits-large"}
    assert len(judged_by) == 1, judged_by
    truth = cloud_labels(judged_by.pop(), x[provisional])
    expected = {
        f"r{row}" for row, label in zip(provisional, truth, strict=True) if label != device_labels[f"r{row}"]
    }
    assert expected, "the cloud agreed with every provisional answer: the comparison is not exercised"
    assert {c.request_id for c in made} == expected
    for correction in made:
        assert (
            correction.provisional.tier == "device"
            and correction.provisional.label == device_labels[correction.request_id]
        )
        assert correction.cloud.label != correction.provisional.label and correction.item == 0
        assert correction.judged_unix >= correction.provisional_unix > 0

    shown = subprocess.run(  # the CLI reads the same, as JSON lines
        [sys.executable, "-m", "stratus.cli", "fleet", "corrections", "--router", router_address, "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert sorted(json.loads(line)["request_id"] for line in shown.stdout.splitlines()) == sorted(expected)
    assert corrections(router_address, since_unix=made[-1].judged_unix + 1 if made else 0) == []
    assert _sdk_corrections(models, router_address) == sorted(expected)


def _sdk_corrections(models: Path, router: str) -> list[str]:
    from edge_agent.sdk import Client

    async def read() -> list[str]:
        client = Client(models, router)
        try:
            return sorted([c.request_id async for c in client.corrections(follow=False)])
        finally:
            await client.aclose()

    return asyncio.run(read())


def test_a_full_store_refuses_new_items_and_counts_them(cluster: Cluster, tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    metrics = f"127.0.0.1:{free_port()}"
    state = tmp_path / "state"
    models = deferring(copy_digits(tmp_path / "models"), max_items=5)
    cloud = cluster.cloud()
    router = cluster.router("--cloud", cloud.address, "--state-dir", str(state), "--metrics", metrics).address
    cluster.agent("dev-1", router, "--models", str(models))
    wait_until(lambda: ready_count(router) == 1, 60)
    cloud.kill()
    x = digits.held_out.x[:20].astype(np.float32)
    served = [infer(router, x[row : row + 1], min_confidence=1.0)[1] for row in range(len(x))]
    kept = [s for s in served if s.provisional]
    refused = [s for s in served if s.degraded and not s.provisional]  # unsure (an item at 1.0 is sure)
    assert len(kept) == 5 and len(deferred_files(state)) == 5 and len(refused) >= 10
    assert all("not kept for the cloud to judge (full_items)" in s.reason for s in refused), refused
    page = scrape(metrics)
    assert sample(page, "stratus_router_deferred_total", family="digits", outcome="full_items") == len(
        refused
    )
    assert sample(page, "stratus_router_deferred_total", family="digits", outcome="kept") == 5
    assert sample(page, "stratus_router_deferred_items", family="digits") == 5


def test_explain_returns_the_path_the_request_took(cluster: Cluster, tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud()
    models = deferring(copy_digits(tmp_path / "models"))
    decisions = tmp_path / "decisions"
    router = cluster.router(
        "--cloud", cloud.address, "--state-dir", str(tmp_path / "state"), "--decision-log", str(decisions)
    ).address
    cluster.agent("dev-1", router, "--models", str(models))
    wait_until(lambda: ready_count(router) == 1, 60)
    x = digits.held_out.x[:4].astype(np.float32)

    response, served = infer(router, x, min_confidence=1.0, explain=True)
    record = json.loads(response.parameters["stratus.decision"].string_param)
    assert [(h["tier"], h["outcome"]) for h in record["hops"]] == [
        ("device", "unsure"),
        ("cloud", "accepted"),
    ]
    assert [h["tier"] for h in record["hops"] if h["outcome"] not in ("skipped",)] == [
        t.label for t in served.path
    ]
    assert record["hops"][0]["items"] == 4 and record["hops"][0]["unsure"] == 4
    assert record["final_tier"] == served.tier.label == "cloud" and not record["provisional"]

    plain, _ = infer(router, x[:1])
    assert "stratus.decision" not in plain.parameters  # only when asked

    cloud.kill()
    response, served = ask(router, x, "asked", min_confidence=1.0, explain=True)
    record = json.loads(response.parameters["stratus.decision"].string_param)
    outcomes = [(h["tier"], h["outcome"]) for h in record["hops"]]
    assert outcomes[0] == ("device", "unsure") and outcomes[-1][0] == "cloud"
    assert outcomes[-1][1] in ("failed", "unavailable", "too_slow"), outcomes
    assert record["provisional"] and served.provisional and record["request_id"] == "asked", json.dumps(
        record
    )
    assert record["reason"] == served.reason

    assert cluster.latest("router").stop() == 0  # its decision log's file is finished on the way out
    import pyarrow.parquet as pq

    (written,) = decisions.glob("decisions-*.parquet")
    rows = pq.read_table(written).to_pylist()  # every provisional request's record, no other (share 0)
    assert [(r["request_id"], r["provisional"]) for r in rows] == [("asked", True)]
    assert [h["outcome"] for h in rows[0]["hops"]] == [h["outcome"] for h in record["hops"]]
