"""A fleet-wide threshold push through real routers and agents: ``stratus fleet thresholds
--apply`` on one router is in force on its peer too, changes which tier answers each item
(a device threshold of 1.0001, PASS_ALL, sends every item up, from the router and from the
SDK), survives a restart of both routers, and ``--revert`` brings the agents' own thresholds back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from stratus.families.confidence import PASS_ALL
from stratus.serving.channels import open_sync_channel
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

from .cluster import Cluster, fleet_status, infer, ready_count, wait_until
from .natsd import NatsServer
from .test_rollout import _free_ports

ITEMS = 40


def status(router: str) -> fpb.ThresholdsReply:
    with open_sync_channel(router) as channel:
        request = fpb.ThresholdsRequest(family="digits", action=fpb.THRESHOLDS_ACTION_STATUS)
        reply: fpb.ThresholdsReply = fpb_grpc.FleetStub(channel).Thresholds(request, timeout=10)
    return reply


def version(router: str) -> int:
    history = status(router).history
    return history[-1].version if history else 0


def cli(router: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", "thresholds", "digits", "--router", router, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def item_tiers(router: str, x: np.ndarray) -> list[Tier]:
    _, served = infer(router, x)
    return list(served.item_tiers)


def device_confidences(router: str, x: np.ndarray) -> list[float]:
    """Each item's own device confidence (asked alone, kept on the device)."""
    return [infer(router, x[i : i + 1], max_tier="device")[1].confidence for i in range(len(x))]


def sdk_tiers(router: str, x: np.ndarray, cache: Path, *, threshold: float) -> None:
    """An SDK on the device answers here what the router's threshold for its tier settles, and
    sends the rest up: each item's tier follows from its own local confidence."""
    from edge_agent.sdk import Client

    from .cluster import MODELS

    with Client(MODELS, router=router, cache_dir=cache, precision="fp32") as client:
        assert client.wait_ready(timeout_s=10)
        local = [client.infer("digits", x[i : i + 1], max_tier="device").confidence for i in range(len(x))]
        expected = [Tier.DEVICE if c >= threshold else Tier.EDGE for c in local]
        assert list(client.infer("digits", x).item_tiers) == expected, threshold


def test_a_push_reaches_both_routers_changes_the_answers_survives_restarts_and_reverts(  # type: ignore[no-untyped-def]
    cluster: Cluster, tmp_path: Path, digits, nats: NatsServer
) -> None:
    a, b = (f"127.0.0.1:{port}" for port in _free_ports(2))

    def routers(tag: str) -> None:
        cluster.router("--site-state", nats.url, role=f"router-a{tag}", listen=a)
        cluster.router("--site-state", nats.url, role=f"router-b{tag}", listen=b)

    routers("")
    cluster.agent("device-1", f"{a},{b}")
    cluster.agent("edge-1", f"{a},{b}", tier="edge")
    linked = lambda: ready_count(a) == 2 and ready_count(b) == 2  # noqa: E731
    wait_until(linked, timeout_s=90)
    x = digits.held_out.x[:ITEMS]
    own = status(a).agents["device"]
    sure = device_confidences(a, x)
    settled_before = [Tier.DEVICE if c >= own else Tier.EDGE for c in sure]
    climbing = [Tier.EDGE] * len(sure)  # no confidence reaches PASS_ALL
    assert Tier.DEVICE in settled_before, "no item would change tier"
    assert item_tiers(a, x) == settled_before == item_tiers(b, x)

    pushed = cli(a, "--apply", f"device={PASS_ALL}", "--reason", "every item to the edge")
    assert "pushed version 1 in force" in pushed and "device=1.0001 by" in pushed, pushed
    wait_until(lambda: version(b) == 1, timeout_s=10)
    for router in (a, b):
        now = status(router)
        assert now.in_force["device"] == PASS_ALL and now.agents["device"] == own
        assert now.in_force["edge"] == now.agents["edge"]  # a tier the push does not name keeps its own
        assert item_tiers(router, x) == climbing, router
    sdk_tiers(b, x, tmp_path, threshold=PASS_ALL)  # the SDK judges its own answers by the push too

    for launched in ("router-a", "router-b"):
        cluster.latest(launched).stop()
    routers("2")  # each reads the site's store back; the agents link again
    wait_until(linked, timeout_s=90)
    for router in (a, b):
        assert version(router) == 1 and item_tiers(router, x) == climbing, router

    reverted = cli(b, "--revert", "--reason", "back to calibration")
    assert "pushed version 2 in force" in reverted and "(the agents' own)" in reverted, reverted
    wait_until(lambda: version(a) == 2, timeout_s=10)
    for router in (a, b):
        assert dict(status(router).in_force) == dict(status(router).agents)
        assert item_tiers(router, x) == settled_before, router
    sdk_tiers(a, x, tmp_path, threshold=own)
    history = status(a).history
    assert [(v.version, dict(v.thresholds), v.base, v.reason) for v in history] == [
        (1, {"device": PASS_ALL}, 0, "every item to the edge"),
        (2, {}, 0, "back to calibration"),
    ]


def test_a_suggestion_from_every_routers_real_audits_is_pushed_and_a_recalibrated_agent_then_joins(  # type: ignore[no-untyped-def]
    cluster: Cluster, tmp_path: Path, digits, nats: NatsServer
) -> None:
    """The routers find each other through the site's store (each registers its address), so
    the suggestion reads both routers' rows with no list of peers anywhere."""
    from stratus.tools.calibrate.from_audits import suggest

    from .variants import copy_digits

    cloud = cluster.cloud().address
    router, peer = (f"127.0.0.1:{port}" for port in _free_ports(2))
    audited = ("--cloud", cloud, "--audit-share", "1", "--audit-max-per-s", "10000")
    cluster.router(*audited, "--site-state", nats.url, role="router-a", listen=router)
    cluster.router(*audited, "--site-state", nats.url, role="router-b", listen=peer)
    cluster.agent("device-1", f"{router},{peer}")
    cluster.agent("edge-1", f"{router},{peer}", tier="edge")
    wait_until(lambda: ready_count(router) == 2 and ready_count(peer) == 2, timeout_s=90)

    def rows(at: str = router) -> list[fpb.AuditRow]:
        return list(status_with_rows(at).rows)

    x = digits.held_out.x
    for batch in range(60):  # audits that find no free slot are dropped: send until enough rows are kept
        start = (batch * 20) % (len(x) - 20)
        infer(router if batch % 3 else peer, x[start : start + 20])  # a third of the traffic to the peer
        if batch % 5 == 4 and len(rows()) >= 200 and len(rows(peer)) >= 50:
            break
    wait_until(lambda: len(rows()) >= 200 and len(rows(peer)) >= 50, timeout_s=30)
    counts = [len(rows()) + len(rows(peer))]

    def steady() -> bool:  # the audits still queued have finished: the rows no longer change
        counts.append(len(rows()) + len(rows(peer)))
        return counts[-1] == counts[-2]

    wait_until(steady, timeout_s=30, interval_s=1.0)
    site = rows() + rows(peer)  # each router audits only what it routed
    assert {r.top_tier for r in site} == {"cloud"}
    assert all([a.tier for a in r.tiers] == ["device", "edge"] for r in site)  # the edge asked too

    shown = cli(router, "--suggest", "--target-accuracy", "0.97")
    assert "suggested" in shown and "audit rows" in shown and version(router) == 0, shown
    expected = suggest(site, target_accuracy=0.97).thresholds
    applied = cli(router, "--suggest", "--apply", "--target-accuracy", "0.97")
    ids = [status_with_rows(at).router_id for at in (router, peer)]
    assert f"(suggested on {len(site)} audit rows of 2 routers: {', '.join(ids)})" in applied, applied
    assert "not read" not in applied, applied
    pushed = status(router)
    assert pushed.history[-1].reason == "suggested from the audits"
    assert {t: v for t, v in pushed.in_force.items() if t in ("device", "edge")} == {
        tier.label: value for tier, value in expected.items()
    }
    wait_until(lambda: version(peer) == 1, timeout_s=10)  # the push reached the peer too

    recalibrated = copy_digits(tmp_path / "recalibrated")
    toml = recalibrated / "digits" / "family.toml"
    text = toml.read_text()
    for pattern, value in (  # calibrate rewrites all three: each must be found, whatever its value
        (r"^\[thresholds\]\ndevice = ", "[thresholds]\ndevice = 0.1\n# was "),
        (r"^cloud_share = [0-9.]+$", "cloud_share = 0.2"),
        (r"^device = \{ accuracy = [0-9.]+, agreement = [0-9.]+", "device = { accuracy = 0.95, agreement = 0.96"),
    ):
        text, found = re.subn(pattern, value, text, flags=re.MULTILINE)
        assert found == 1, f"{pattern!r} is not in {toml} once"
    toml.write_text(text)
    cluster.agent("device-2", router, "--models", str(recalibrated))
    wait_until(lambda: ready_count(router) == 3, timeout_s=90)  # not refused: the push wins
    assert status(router).in_force["device"] == pushed.in_force["device"]
    (joined,) = [a for a in fleet_status(router).agents if a.id == "device-2"]
    assert any(v.startswith("digits-small") for v in joined.variants) and not joined.unavailable, joined


def status_with_rows(router: str) -> fpb.ThresholdsReply:
    with open_sync_channel(router) as channel:
        request = fpb.ThresholdsRequest(family="digits", include_rows=True)
        reply: fpb.ThresholdsReply = fpb_grpc.FleetStub(channel).Thresholds(request, timeout=10)
    return reply
