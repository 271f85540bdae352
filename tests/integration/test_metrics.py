"""Prometheus metrics from every real process, checked by what they count and by promtool."""

from __future__ import annotations

import contextlib
import platform
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib import metadata

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stratus.devtools.launcher import free_port
from stratus.families.repository import ModelRepository

from .cluster import MODELS, Cluster, fleet_status, infer, ready_count, wait_until
from .expected import served_for


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        assert response.status == 200
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def value(found: Samples, name: str, **labels: str) -> float:
    """The sample with exactly these labels; a missing or mislabelled series fails, not 0."""
    key = (name, frozenset(labels.items()))
    assert key in found, f"no sample {name}{labels}; {name} has {[dict(k[1]) for k in found if k[0] == name]}"
    return found[key]


def count(found: Samples, name: str, **labels: str) -> float:
    """A labelled counter's sample, 0 when that label set was never incremented (and so is
    not exported yet). Only for a count that may truly be 0: a renamed or mislabelled
    series reads 0 here too, so a test pairs it with a ``value`` or a positive expectation."""
    return found.get((name, frozenset(labels.items())), 0.0)


def total(found: Samples, name: str) -> float:
    """The sum of every sample of ``name``, whatever its labels."""
    return sum(v for (sample, _labels), v in found.items() if sample == name)


@pytest.fixture
def scraped(cluster: Cluster, digits) -> dict[str, str]:  # type: ignore[no-untyped-def]
    where = {role: f"127.0.0.1:{free_port()}" for role in ("router", "device", "cloud")}
    cloud = cluster.cloud("--metrics", where["cloud"]).address
    # No audits: each count below is exact, and an audit is one more cloud Work (test_audits.py).
    router = cluster.router("--cloud", cloud, "--metrics", where["router"], "--audit-share", "0").address
    cluster.agent("dev-1", router, "--metrics", where["device"])
    cluster.agent("edge-1", router, tier="edge")
    wait_until(lambda: ready_count(router) == 2 and fleet_status(router).cloud.state == "connected")
    for row in digits.held_out.x[:20]:
        infer(router, row[None, :], min_confidence=0.0)  # settled on the device
    for row in digits.held_out.x[:5]:
        infer(router, row[None, :], min_confidence=1.0)  # climbs to the cloud
    with pytest.raises(grpc.RpcError):
        infer(router, np.zeros((1, 63), np.float32))  # refused: wrong shape
    for row in digits.held_out.x[:3]:
        infer(router, row[None, :], model="digits-large")  # pinned: only the cloud serves it
    for row in digits.held_out.x[:2]:
        infer(router, row[None, :], model="digits-small", min_confidence=0.0)  # pinned to the device
    with pytest.raises(grpc.RpcError):
        infer(cloud, digits.held_out.x[:1], model="no-such-model")  # straight to the cloud: not found
    return {role: scrape(address) for role, address in where.items()}


def test_each_process_counts_what_happened(scraped: dict[str, str]) -> None:
    router = samples(scraped["router"])
    assert value(router, "stratus_router_requests_total", family="digits", tier="device", outcome="ok") == 22
    assert value(router, "stratus_router_requests_total", family="digits", tier="cloud", outcome="ok") == 8
    refused = {"family": "digits", "tier": "none", "outcome": "invalid_argument"}
    assert value(router, "stratus_router_requests_total", **refused) == 1
    assert total(router, "stratus_router_requests_total") == 31  # and nothing else was counted
    assert value(router, "stratus_router_refusals_total", reason="invalid_argument") == 1
    climbs = {"from_tier": "device", "to_tier": "edge", "reason": "unsure"}
    assert value(router, "stratus_router_escalations_total", family="digits", **climbs) == 5
    assert value(router, "stratus_router_tier_duration_seconds_count", family="digits", tier="cloud") == 8
    assert value(router, "stratus_router_confidence_count", family="digits", tier="device") == 27
    assert value(router, "stratus_router_agents", tier="device", state="ready") == 1
    assert value(router, "stratus_router_cloud_breaker", state="closed") == 1
    assert value(router, "stratus_router_batch_items_count") == 32  # 27 device + 5 edge Works

    device = samples(scraped["device"])
    small = served_for("digits-small")
    runs = {"variant": small.name, "runtime": "litert", "precision": small.precision}
    assert value(device, "stratus_inference_duration_seconds_count", **runs) == 27
    assert value(device, "stratus_work_total", family="digits", variant=small.name, outcome="ok") == 27
    assert total(device, "stratus_work_total") == 27
    assert value(device, "stratus_process_resident_memory_bytes") > 20e6

    cloud = samples(scraped["cloud"])
    large = served_for("digits-large").name
    assert value(cloud, "stratus_work_total", family="digits", variant=large, outcome="ok") == 8
    assert value(cloud, "stratus_work_total", family="unknown", variant="unknown", outcome="not_found") == 1
    assert total(cloud, "stratus_work_total") == 9
    assert value(cloud, "stratus_queue_items") == 0


def labels_of(found: Samples, name: str, label: str) -> set[str]:
    return {dict(labels)[label] for sample, labels in found if sample == name}


def test_a_pinned_variant_counts_under_its_family_never_as_one(scraped: dict[str, str]) -> None:
    """Requests naming digits-large (the cloud's) and digits-small (the device's) are digits
    requests in every family label; variant labels name only what the model files hold."""
    router = samples(scraped["router"])
    for name in ("stratus_router_requests_total", "stratus_router_tier_duration_seconds_count",
                 "stratus_router_confidence_count"):  # fmt: skip
        assert labels_of(router, name, "family") == {"digits"}, name
    repository = ModelRepository.load(MODELS)
    variants = {v.name for f in repository.families.values() for v in f.variants}
    for role in ("device", "cloud"):
        found = samples(scraped[role])
        assert labels_of(found, "stratus_work_total", "family") <= {*repository.families, "unknown"}, role
        assert labels_of(found, "stratus_work_total", "variant") <= {*variants, "unknown"}, role


def test_every_process_says_what_it_is_built_from(scraped: dict[str, str]) -> None:
    built = {
        "version": metadata.version("stratus-router"),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "machine": platform.machine(),
    }
    for role, text in scraped.items():
        assert value(samples(text), "stratus_build_info", **built) == 1, role


def test_the_router_exports_each_familys_calibrated_cloud_share(scraped: dict[str, str]) -> None:
    """From the agents' family.toml files ([calibration] cloud_share), which
    stratus:calibrated_cloud_share (deploy/prometheus/rules.yml) reads."""
    router = samples(scraped["router"])
    repository = ModelRepository.load(MODELS)
    for name in ("digits", "defects"):
        record = repository.family(name).calibration
        assert record is not None
        share = value(router, "stratus_router_family_calibrated_cloud_share", family=name)
        assert share == pytest.approx(record.cloud_share), name


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)"
)
def test_promtool_accepts_every_exposition(scraped: dict[str, str]) -> None:
    for role, text in scraped.items():
        checked = subprocess.run(
            ["promtool", "check", "metrics"],
            check=False,
            input=text,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert checked.returncode == 0, f"{role}: {checked.stdout}{checked.stderr}"


def test_killing_the_cloud_opens_the_breaker_gauge_and_counts_degraded_answers(
    cluster: Cluster, digits
) -> None:  # type: ignore[no-untyped-def]
    import signal

    where = f"127.0.0.1:{free_port()}"
    cloud = cluster.cloud()
    router = cluster.router("--cloud", cloud.address, "--metrics", where).address
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1 and fleet_status(router).cloud.state == "connected")
    before = samples(scrape(where))
    assert value(before, "stratus_router_cloud_breaker", state="closed") == 1
    cloud.process.send_signal(signal.SIGKILL)
    cloud.process.wait()
    wait_until(lambda: value(samples(scrape(where)), "stratus_router_cloud_breaker", state="open") == 1)
    for row in digits.held_out.x[:3]:
        _, served = infer(router, row[None, :], min_confidence=1.0)
        assert served.degraded
    after = samples(scrape(where))
    assert value(after, "stratus_router_degraded_answers_total", family="digits", reason="unavailable") == 3
    assert (
        value(after, "stratus_router_requests_total", family="digits", tier="device", outcome="degraded") == 3
    )


def test_metrics_off_loopback_need_a_scrape_token_or_the_operators_word(cluster: Cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """security2 N8: /metrics listed agent ids past --private-status to whoever reached the port,
    on any address, and an oversize request head wrote a traceback to the log."""
    import socket

    refused = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "router", "--listen", "127.0.0.1:0", "--metrics", f"0.0.0.0:{free_port()}"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 2 and "--metrics-token-file" in refused.stderr, refused.stderr
    token = tmp_path / "metrics.token"
    token.write_text("metrics-token-0000000001\n")
    where = f"127.0.0.1:{free_port()}"
    router = cluster.router("--metrics", where, "--metrics-token-file", str(token))
    with pytest.raises(urllib.error.HTTPError) as anonymous:
        scrape(where)
    assert anonymous.value.code == 401
    asked = urllib.request.Request(f"http://{where}/metrics", headers={"Authorization": "Bearer metrics-token-0000000001"})
    with urllib.request.urlopen(asked, timeout=5) as response:
        assert b"stratus_router_agents" in response.read()
    host, port = where.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as flood:
        flood.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 200_000 + b"\r\n\r\n")
        with contextlib.suppress(OSError):
            flood.recv(1)
    time.sleep(0.5)
    assert "Traceback" not in router.log() and "ERROR" not in router.log()
