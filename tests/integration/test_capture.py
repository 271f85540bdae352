"""``--capture`` through a real fleet: audited and escalated digits items land as Parquet rows
whose inputs are what the client sent and whose labels are the cloud's answers; a router
killed mid-traffic leaves only whole files in sight; a tiny cap deletes the oldest files while
every request is still answered."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from stratus.convert import codec
from stratus.convert.parameters import Served
from stratus.devtools.launcher import free_port
from stratus.obs.capture import PARTIAL, captured_files, read_rows
from stratus.serving.channels import open_sync_channel
from stratus.tiers import Tier
from stratus.tools.datasets import Splits
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import Cluster, fleet_status, ready_count, request, wait_until
from .load import Load
from .test_metrics import Samples, count, samples, scrape

AGENT = ["--variants", "digits-small", "--runtimes", "onnxruntime"]
EVERY_ITEM = ["--audit-share", "1", "--audit-max-per-s", "10000"]


def fleet(cluster: Cluster, folder: Path, *extra: str) -> tuple[str, str, str]:
    """A cloud, a router capturing digits into ``folder``, one device agent: (router, cloud, metrics)."""
    metrics = f"127.0.0.1:{free_port()}"
    cloud = cluster.cloud().address
    router = cluster.router(
        "--cloud", cloud, "--metrics", metrics, "--capture", str(folder), "--capture-families", "digits",
        *EVERY_ITEM, *extra,
    ).address  # fmt: skip
    cluster.agent("device-1", router, *AGENT)
    wait_until(lambda: ready_count(router) == 1 and fleet_status(router).cloud.state == "connected", timeout_s=90)
    return router, cloud, metrics


def cloud_classes(cloud: str, x: np.ndarray) -> np.ndarray:
    """What the cloud gateway itself answers for each row of ``x`` (asked directly)."""
    with open_sync_channel(cloud) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request(x), timeout=30)
    scores = codec.decode_response_outputs(response)["probabilities"]
    best: np.ndarray = np.asarray(scores).argmax(axis=1)
    return best


def settled_samples(metrics: str, still_s: float = 1.0, timeout_s: float = 30.0) -> Samples:
    """The router's samples once its captured counts stopped moving for ``still_s``."""
    deadline = time.monotonic() + timeout_s
    last: tuple[float, ...] = ()
    while True:
        now = samples(scrape(metrics))
        captured = tuple(
            count(now, "stratus_router_captured_total", family="digits", source=source)
            for source in ("audit", "escalated")
        )
        if captured == last or time.monotonic() > deadline:
            return now
        last = captured
        time.sleep(still_s)


def test_audited_and_escalated_items_are_captured_with_the_cloud_answers(
    cluster: Cluster,
    tmp_path: Path,
    digits: Splits,
) -> None:
    folder = tmp_path / "capture"
    router, cloud, metrics = fleet(cluster, folder)
    x = digits.held_out.x[:120].astype(np.float32)
    served: dict[str, Served] = {}
    with open_sync_channel(router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for n in range(len(x)):
            message = request(x[n : n + 1])
            message.id = f"item-{n}"
            served[message.id] = Served.read(stub.ModelInfer(message, timeout=10).parameters)
    wait_until(lambda: count(samples(scrape(metrics)), "stratus_router_captured_total",
                             family="digits", source="audit") > 0, timeout_s=30)  # fmt: skip
    counted = settled_samples(metrics)  # the last audits queued are still on their way to the cloud
    assert cluster.latest("router").stop() == 0  # SIGTERM: the writer drains and renames its file
    assert not list(folder.glob(f"*{PARTIAL}"))

    rows = list(read_rows(folder, "digits"))
    expected = cloud_classes(cloud, x)
    by_source = {"audit": 0, "escalated": 0}
    for row in rows:
        n = int(row["request_id"].removeprefix("item-"))
        (tensor,) = row["inputs"]
        sent = np.frombuffer(tensor["data"], dtype=np.dtype(tensor["dtype"])).reshape(tensor["shape"])
        np.testing.assert_array_equal(sent, x[n])  # the item's own input, without the batch dimension
        assert row["top"]["tier"] == "cloud" and row["top"]["label"] == expected[n]
        assert row["answers"][0]["tier"] == "device"
        by_source[row["source"]] += 1
    climbed = {rid for rid, s in served.items() if s.tier is Tier.CLOUD and Tier.DEVICE in s.path}
    assert climbed, "no item climbed: nothing here shows escalated items are captured"
    assert {r["request_id"] for r in rows if r["source"] == "escalated"} == climbed
    settled = sum(1 for s in served.values() if s.tier is Tier.DEVICE)
    assert 0 < by_source["audit"] <= settled  # each settled item at most once (some audits may drop)
    for source, found in by_source.items():
        assert count(counted, "stratus_router_captured_total", family="digits", source=source) == found


def test_a_tiny_cap_deletes_the_oldest_files_and_a_sigkill_leaves_only_whole_files(
    cluster: Cluster,
    tmp_path: Path,
    digits: Splits,
) -> None:
    folder = tmp_path / "capture"
    cap = 60_000
    limits = ["--capture-max-bytes", str(cap), "--capture-file-bytes", "8000", "--capture-file-age-s", "0.5"]
    router, _, metrics = fleet(cluster, folder, *limits)
    with Load(router, digits.held_out.x, clients=4) as load:
        wait_until(lambda: bool(captured_files(folder)), timeout_s=60)
        oldest = captured_files(folder)[0]
        wait_until(lambda: not oldest.exists(), timeout_s=120, interval_s=0.2)  # the cap was reached
        answered = len(load.answers)
        wait_until(lambda: len(load.answers) > answered + 20, timeout_s=30)  # still serving past the cap
        assert sum(size(p) for p in captured_files(folder)) <= cap
        handed_over = captured(metrics)
        assert not load.errors, load.errors  # the cap cost no request anything
        router_process = cluster.latest("router").process
        router_process.send_signal(signal.SIGKILL)  # mid-traffic, mid-write
        router_process.wait()

    files = captured_files(folder)
    assert files, "no whole file was ever renamed into sight"
    kept = [row for path in files for row in pq.read_table(path).to_pylist()]  # every visible file reads
    assert all(row["family"] == "digits" for row in kept)
    assert 0 < len(kept) < handed_over  # the oldest were deleted
    assert sum(p.stat().st_size for p in files) <= cap


def size(path: Path) -> int:
    """A file's size, 0 once the writer deleted it (it may, between the listing and the stat)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def captured(metrics: str) -> float:
    """Items the router handed to its writer so far."""
    found = samples(scrape(metrics))
    return sum(
        count(found, "stratus_router_captured_total", family="digits", source=source)
        for source in ("audit", "escalated")
    )
