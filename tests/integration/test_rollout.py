"""Gray release through a real fleet: a worse candidate is rolled back by itself, a good one
reaches 100%, nothing is lost on the way, and every router of a site holds the same state,
across restarts."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratus.devtools.launcher import free_port
from stratus.serving.channels import open_sync_channel
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

from .cluster import Cluster, ready_count, wait_until
from .load import Load
from .natsd import NatsServer
from .test_metrics import samples, scrape, value
from .variants import add_device_variant, copy_digits


def steer(router: str, action: int, **fields: object) -> fpb.RolloutReply:
    request = fpb.RolloutRequest(action=action, family="digits", tier=fpb.TIER_DEVICE, **fields)  # type: ignore[arg-type]
    with open_sync_channel(router) as channel:
        return fpb_grpc.FleetStub(channel).Rollout(request, timeout=10)


def rollout(router: str) -> fpb.RolloutStatus | None:
    statuses = steer(router, fpb.ROLLOUT_ACTION_STATUS).rollouts
    return statuses[0] if statuses else None


def state_of(router: str) -> str:
    status = rollout(router)
    return status.state if status is not None else "none"


def start(router: str, candidate: str, **fields: object) -> fpb.RolloutStatus:
    reply = steer(router, fpb.ROLLOUT_ACTION_START, candidate=candidate, **fields)
    return reply.rollouts[0]


@pytest.fixture
def models(tmp_path: Path) -> Path:
    root = copy_digits(tmp_path / "models")
    add_device_variant(root, "digits-small-v2")
    add_device_variant(root, "digits-small-shuffled", shuffled=True)
    add_device_variant(root, "digits-small-swapped", swapped=(3, 8))
    return root


def test_bad_candidates_roll_back_good_one_reaches_100(cluster: Cluster, models: Path, digits) -> None:  # type: ignore[no-untyped-def]
    """An unsure candidate is caught on its requests; one wrong and sure of itself (two
    classes swapped: as sure, as fast) only on its agreement with the edge tier above it,
    which audits both arms; a good one climbs every step, its agreement measured."""
    metrics = f"127.0.0.1:{free_port()}"
    # audits at up to 200 a second an arm, so that a step's few hundred come in seconds
    router = cluster.router("--metrics", metrics, "--audit-max-per-s", "200").address
    cluster.agent("device-1", router, "--models", str(models))
    cluster.agent("edge-1", router, "--models", str(models), tier="edge")
    wait_until(lambda: ready_count(router) == 2, timeout_s=60)
    # a 5-point agreement margin: equal arms advance at the first look (50 audits each), where
    # a wrong rollback is 0.2% likely a step (simulated); the swapped candidate is surely lower
    steps = {
        "steps": [20, 50, 100],
        "min_requests": 40,
        "max_p99_ratio": 3.0,
        "max_disagreement_increase": 0.05,
    }
    with Load(router, digits.held_out.x) as load:
        started = start(router, "digits-small-shuffled", **steps)
        assert (started.state, started.share_percent) == ("running", 20.0)
        wait_until(lambda: state_of(router) == "rolled_back", timeout_s=60)
        rolled_back = time.monotonic()
        status = rollout(router)
        assert status is not None and status.share_percent == 0.0
        assert status.reason.startswith("rolled back at 20%: unsure"), status.reason
        time.sleep(1.0)  # answers still in flight from before the rollback may arrive
        counted = samples(scrape(metrics))
        device = {"family": "digits", "tier": "device"}
        assert (
            value(counted, "stratus_router_rollout_requests_total", arm="candidate", outcome="ok", **device)
            >= 40
        )
        assert value(counted, "stratus_router_rollout_rollbacks_total", reason="unsure", **device) == 1
        share = ("stratus_router_rollout_share_percent", frozenset(
            {**device, "candidate": "digits-small-shuffled", "state": "rolled_back"}.items()))  # fmt: skip
        assert counted[share] == 0.0
        since = load.device_variants(after=rolled_back + 0.5)
        assert sum(since.values()) > 0, "no device answers since the rollback: nothing to judge"
        assert since["digits-small-shuffled"] == 0, since

        start(router, "digits-small-swapped", **steps)
        wait_until(lambda: state_of(router) == "rolled_back", timeout_s=60)
        status = rollout(router)
        assert status is not None and status.share_percent == 0.0
        # 3s and 8s swapped: the edge tier above disagrees with its settled answers on those
        found = re.match(
            r"rolled back at 20%: agreement ([\d.]+)% vs ([\d.]+)% with the top tier over (\d+)/(\d+) audits",
            status.reason,
        )
        assert found, status.reason
        candidate_agrees, current_agrees, candidate_audits, current_audits = map(float, found.groups())
        assert candidate_agrees < 95.0 < current_agrees and min(candidate_audits, current_audits) >= 50
        time.sleep(1.0)
        counted = samples(scrape(metrics))
        assert value(counted, "stratus_router_rollout_rollbacks_total", reason="agreement", **device) == 1

        start(router, "digits-small-v2", **steps)
        wait_until(lambda: state_of(router) == "complete", timeout_s=120)
        completed = time.monotonic()
        time.sleep(1.0)
        after = load.device_variants(after=completed + 0.5)
    status = rollout(router)
    assert status is not None and status.share_percent == 100.0
    assert [line.split(":")[0] for line in status.history] == [
        "started by an operator at 20%",
        "advanced from 20% to 50%",
        "advanced from 50% to 100%",
    ]
    advanced = status.history[1:]
    assert all(re.search(r"agreement [\d.]+% vs [\d.]+% with the top tier over \d+/\d+ audits \(within 5\.0%\)$", line)
               for line in advanced), advanced  # fmt: skip
    assert set(after) == {"digits-small-v2"}, after
    assert not load.errors, load.errors
    assert len(load.answers) > 500
    listed = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", "rollout", "digits", "--status", "--router", router],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "digits/device: digits-small-v2 complete at 100%" in listed.stdout, listed.stdout
    assert "at least 40 requests and 50 audits each" in listed.stdout and "agree" in listed.stdout, (
        listed.stdout
    )


def test_refusals_name_what_is_wrong(cluster: Cluster, models: Path) -> None:
    router = cluster.router().address
    cluster.agent("device-1", router, "--models", str(models))
    wait_until(lambda: ready_count(router) == 1, timeout_s=60)
    with open_sync_channel(router) as channel:
        stub = fpb_grpc.FleetStub(channel)
        cases = [
            ({"candidate": "digits-small-v9"}, "NOT_FOUND", "no device agent serves 'digits-small-v9'"),
            ({"candidate": "digits-small"}, "INVALID_ARGUMENT", "already the current device variant"),
            ({"candidate": "digits-small-v2", "steps": [50, 20]}, "INVALID_ARGUMENT", "must rise strictly"),
            ({"candidate": "digits-small-v2", "tier": fpb.TIER_CLOUD}, "INVALID_ARGUMENT", "cloud tier"),
            ({"candidate": "x", "family": "letters"}, "NOT_FOUND", "no agent serves a family 'letters'"),
        ]
        for fields, code, words in cases:
            request = fpb.RolloutRequest(
                action=fpb.ROLLOUT_ACTION_START, family="digits", tier=fpb.TIER_DEVICE
            )
            for key, value in fields.items():
                if isinstance(value, list):
                    getattr(request, key).extend(value)
                else:
                    setattr(request, key, value)
            try:
                stub.Rollout(request, timeout=10)
            except Exception as exc:  # grpc.RpcError
                assert exc.code().name == code and words in exc.details(), (fields, exc)  # type: ignore[attr-defined]
            else:
                raise AssertionError(f"{fields} was accepted")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def stored_plan(url: str) -> dict[str, object]:
    """digits' device rollout as the site's store holds it."""
    from router.site.nats import NatsSiteState

    async def read() -> bytes:
        store = NatsSiteState(url)
        await store.start()
        try:
            async with asyncio.timeout(10):
                while not store.connected:  # start() connects in the background
                    await asyncio.sleep(0.05)
            entry = await store.get("rollout.digits.device")
        finally:
            await store.close()
        assert entry is not None
        return entry.value

    found: dict[str, object] = json.loads(asyncio.run(read()))
    return found


def test_routers_share_rollout_state_and_keep_it_across_a_restart(
    cluster: Cluster, models: Path, nats: NatsServer
) -> None:
    a, b = (f"127.0.0.1:{port}" for port in _free_ports(2))
    cluster.router("--site-state", nats.url, role="router-a", listen=a)
    cluster.router("--site-state", nats.url, role="router-b", listen=b)
    cluster.agent("device-1", f"{a},{b}", "--models", str(models))
    wait_until(lambda: ready_count(a) == 1 and ready_count(b) == 1, timeout_s=60)

    started = start(a, "digits-small-v2", steps=[10, 100], min_requests=1_000_000, shadow_percent=50)
    wait_until(lambda: (rollout(b) or fpb.RolloutStatus()).revision == started.revision, timeout_s=10)
    shared = rollout(b)
    assert shared is not None and shared.share_percent == 10.0
    assert stored_plan(nats.url)["shadow"] == 50.0  # the whole plan is the site's, the shadow share with it

    steer(b, fpb.ROLLOUT_ACTION_ABORT)
    wait_until(lambda: state_of(a) == "aborted", timeout_s=10)
    aborted = rollout(a)
    assert aborted is not None and aborted.share_percent == 0.0

    cluster.latest("router-a").stop()
    cluster.latest("router-b").stop()
    cluster.router("--site-state", nats.url, role="router-a2", listen=a)
    cluster.router("--site-state", nats.url, role="router-b2", listen=b)
    for restarted in (a, b):  # each read back what the site agreed on from the store
        restored = rollout(restarted)
        assert restored is not None
        assert (restored.state, restored.revision, list(restored.history)) == (
            "aborted",
            aborted.revision,
            list(aborted.history),
        ), restarted


def test_the_sdk_answers_with_the_line_a_promoted_rollout_made_current(
    cluster: Cluster, models: Path, tmp_path: Path, digits
) -> None:  # type: ignore[no-untyped-def]
    from edge_agent.sdk import Client
    from stratus.tiers import Tier

    from .cluster import MODELS

    router = cluster.router().address
    cluster.agent("device-1", router, "--models", str(models))
    wait_until(lambda: ready_count(router) == 1, timeout_s=60)
    x = digits.held_out.x[:1]
    with (
        Client(models, router=router, cache_dir=tmp_path, precision="fp32") as holding,  # has the candidate
        Client(MODELS, router=router, cache_dir=tmp_path, precision="fp32") as lacking,  # the shipped folder
    ):
        assert holding.wait_ready(timeout_s=10) and lacking.wait_ready(timeout_s=10)
        assert holding.current_lines()["digits"] == "digits-small"  # the agents' current, as family.toml says
        start(router, "digits-small-v2", steps=[100])  # complete at once, but not current until promoted
        assert holding.follow_router()["digits"] == "digits-small"
        steer(router, fpb.ROLLOUT_ACTION_PROMOTE)
        assert holding.follow_router()["digits"] == "digits-small-v2"
        answered = holding.infer("digits", x, min_confidence=0.0)
        assert (answered.variant, answered.path, answered.agent) == ("digits-small-v2", (Tier.DEVICE,), "sdk")
        assert lacking.follow_router()["digits"] == "digits-small"  # it has no such file: keeps its own
        assert lacking.infer("digits", x, min_confidence=0.0).variant == "digits-small"
