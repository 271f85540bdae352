"""A site's routers on one store (``--site-state``): a real nats-server with JetStream, or a
lone router's file. What one router is told reaches the others within a second and survives
restarts; two changes at once cannot both win; a store that goes away stops changes, never
requests, and the site converges when it is back (issue 35)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from stratus.serving.channels import open_sync_channel
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

from .cluster import Cluster, fleet_status, infer, ready_count, wait_until
from .natsd import NatsServer


def fleet_cli(router: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", *args, "--router", router],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def agent_state(router: str, agent_id: str) -> int:
    return {a.id: a.state for a in fleet_status(router).agents}.get(agent_id, -1)


def thresholds(
    router: str, *, action: int = fpb.THRESHOLDS_ACTION_STATUS, **fields: object
) -> fpb.ThresholdsReply:
    with open_sync_channel(router) as channel:
        request = fpb.ThresholdsRequest(family="digits", action=action, **fields)  # type: ignore[arg-type]
        reply: fpb.ThresholdsReply = fpb_grpc.FleetStub(channel).Thresholds(request, timeout=10)
    return reply


def pushed_version(router: str) -> int:
    history = thresholds(router).history
    return history[-1].version if history else 0


def push(router: str, device: float, expected: int = 0) -> fpb.ThresholdsReply:
    return thresholds(
        router,
        action=fpb.THRESHOLDS_ACTION_APPLY,
        thresholds={"device": device},
        author="test",
        reason="site state",
        expected_version=expected,
    )


def seconds_until(predicate, timeout_s: float = 10.0) -> float:  # type: ignore[no-untyped-def]
    return wait_until(predicate, timeout_s, interval_s=0.02)


def race(values: dict[str, float], *, expected: int) -> dict[str, object]:
    """Each router pushed its value at the same moment (a barrier), as two operators would:
    per router, its reply or its error."""
    outcomes: dict[str, object] = {}
    start = threading.Barrier(len(values))

    def change(router: str, value: float) -> None:
        start.wait()
        try:
            outcomes[router] = push(router, value, expected=expected)
        except grpc.RpcError as error:
            outcomes[router] = error

    threads = [threading.Thread(target=change, args=item) for item in values.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outcomes


def site(cluster: Cluster, url: str, *names: str) -> list[str]:
    """Routers on one store, and one device agent linked to all of them."""
    routers = [cluster.router("--site-state", url, role=name).address for name in names]
    cluster.agent("dev-1", ",".join(routers))
    for router in routers:
        wait_until(lambda r=router: ready_count(r) == 1, 60)
    return routers


def restart(cluster: Cluster, role: str, url: str, address: str) -> None:
    cluster.latest(role).stop()
    cluster.router("--site-state", url, role=role, listen=address)


def test_a_drain_and_a_push_on_one_router_apply_on_the_other_within_a_second_and_survive_restarts(
    cluster: Cluster, nats: NatsServer
) -> None:
    a, b = site(cluster, nats.url, "router-a", "router-b")
    drained = fleet_cli(a, "drain", "dev-1")
    assert drained.returncode == 0 and "on every router of the site" in drained.stdout, drained
    reached_b_s = seconds_until(lambda: agent_state(b, "dev-1") == fpb.AGENT_STATE_DRAINING)
    push(b, 0.5)
    reached_a_s = seconds_until(lambda: pushed_version(a) == 1)
    assert reached_b_s < 1.0 and reached_a_s < 1.0, (reached_b_s, reached_a_s)
    # both restarted: what the site agreed on is read back from the store, and applied to the
    # agent as it links again
    for role, address in (("router-a", a), ("router-b", b)):
        restart(cluster, role, nats.url, address)
    for router in (a, b):
        wait_until(lambda r=router: agent_state(r, "dev-1") == fpb.AGENT_STATE_DRAINING, 60)
        assert thresholds(router).in_force["device"] == 0.5 and pushed_version(router) == 1
    assert fleet_cli(b, "undrain", "dev-1").returncode == 0
    seconds_until(lambda: agent_state(a, "dev-1") == fpb.AGENT_STATE_READY)
    status = fleet_status(a)
    assert status.site_state.url == nats.url and status.site_state.connected


def test_two_changes_at_once_on_two_routers_exactly_one_wins(cluster: Cluster, nats: NatsServer) -> None:
    a, b = site(cluster, nats.url, "router-a", "router-b")
    push(a, 0.3)  # version 1: each operator below changes the version it read
    for read in range(1, 4):
        seconds_until(lambda expected=read: pushed_version(a) == pushed_version(b) == expected)
        outcomes = race({a: 0.4, b: 0.6}, expected=read)
        won = [r for r, o in outcomes.items() if isinstance(o, fpb.ThresholdsReply)]
        lost = [o for o in outcomes.values() if isinstance(o, grpc.RpcError)]
        assert len(won) == 1 and len(lost) == 1, outcomes
        assert lost[0].code() == grpc.StatusCode.FAILED_PRECONDITION, lost[0]
        # it names what it lost to: the version (read before) or the store's revision (raced)
        assert "version" in (lost[0].details() or "") or "revision" in (lost[0].details() or ""), lost[
            0
        ].details()
    seconds_until(lambda: thresholds(a).in_force == thresholds(b).in_force)


def test_the_store_away_stops_changes_not_requests_and_the_site_converges_when_it_is_back(
    cluster: Cluster,
    nats: NatsServer,
    digits,  # type: ignore[no-untyped-def]
) -> None:
    a, b = site(cluster, nats.url, "router-a", "router-b")
    push(a, 0.5)
    seconds_until(lambda: pushed_version(b) == 1)
    nats.kill()
    seconds_until(lambda: not fleet_status(a).site_state.connected)
    failed = 0
    x = digits.held_out.x
    for index in range(100):
        try:
            infer((a, b)[index % 2], x[index : index + 1])
        except grpc.RpcError:
            failed += 1
    assert failed == 0
    assert thresholds(b).in_force["device"] == 0.5  # served on what it had
    status = fleet_status(a).site_state
    assert nats.url in status.detail and "unreachable" in status.detail, status
    refused = fleet_cli(a, "thresholds", "digits", "--apply", "device=0.6")
    assert refused.returncode != 0 and "UNAVAILABLE" in refused.stderr and nats.url in refused.stderr, refused
    assert thresholds(a).in_force["device"] == 0.5, "a refused change is not kept here either"
    nats.start()  # the same port and store
    seconds_until(lambda: fleet_status(a).site_state.connected and fleet_status(b).site_state.connected, 30)
    push(a, 0.6, expected=1)
    seconds_until(lambda: thresholds(b).in_force["device"] == 0.6)


def test_a_lone_router_keeps_the_sites_state_in_a_file_across_restarts(
    cluster: Cluster, tmp_path: Path
) -> None:
    url = f"file:{tmp_path / 'site.json'}"
    (router,) = site(cluster, url, "router-a")
    push(router, 0.5)
    assert fleet_cli(router, "drain", "dev-1").returncode == 0
    restart(cluster, "router-a", url, router)
    wait_until(lambda: agent_state(router, "dev-1") == fpb.AGENT_STATE_DRAINING, 60)
    assert thresholds(router).in_force["device"] == 0.5
    assert fleet_status(router).site_state.url == url


def judge_of(router: str) -> str:
    return fleet_status(router).site_state.judge


def test_one_router_of_the_site_judges_and_another_takes_over_when_it_dies(
    cluster: Cluster, nats: NatsServer
) -> None:
    """The judge lease (rollout steps, --auto-thresholds): exactly one holder among live
    routers, each lists the others' addresses from the store, a killed holder's lease passes to
    a survivor once its ttl has run out, and a clean stop hands it over at once."""
    ttl_s = 9.0
    lease = {"STRATUS_ROUTER_SITE_LEASE_S": str(ttl_s)}
    routers = {
        name: cluster.router("--site-state", nats.url, role=name, env=lease).address
        for name in ("router-a", "router-b", "router-c")
    }
    holders = lambda: [n for n, r in routers.items() if judge_of(r) == "this router"]  # noqa: E731
    wait_until(lambda: len(holders()) == 1, 10)
    for name, address in routers.items():
        others = sorted(a for n, a in routers.items() if n != name)
        wait_until(lambda r=address, o=others: sorted(fleet_status(r).site_state.routers) == o, 15)
    (first,) = holders()
    killed_at = time.monotonic()
    cluster.latest(first).kill()  # no release: the lease must run out
    del routers[first]
    wait_until(lambda: len(holders()) == 1, 2 * ttl_s, interval_s=0.05)
    assert time.monotonic() - killed_at < ttl_s + ttl_s / 3 + 1  # the ttl, then one look
    (second,) = holders()
    cluster.latest(second).stop()  # a clean stop releases it
    stopped_at = time.monotonic()
    del routers[second]
    (last,) = routers.values()
    wait_until(lambda: judge_of(last) == "this router", ttl_s, interval_s=0.05)
    # Without the release it would wait out the ttl from the last renewal (at least ttl*2/3 - the stop's length).
    assert time.monotonic() - stopped_at < 1.5


def test_a_credential_revoked_on_one_router_is_refused_by_every_router_and_kept_across_restarts(
    cluster: Cluster, nats: NatsServer
) -> None:
    """`fleet revoke agent:ID` on router A: the agent's link to router B ends at its next
    heartbeat and its Hellos are refused by both (so it stops, refused everywhere); a router
    restarted reads the revocation back; lifted, the same agent joins again."""
    a, b = site(cluster, nats.url, "router-a", "router-b")
    revoked = fleet_cli(a, "revoke", "agent:dev-1", "--reason", "device stolen")
    assert revoked.returncode == 0, revoked
    assert "agent:dev-1 is revoked on every router of the site" in revoked.stdout
    seconds = seconds_until(lambda: ready_count(b) == 0 and ready_count(a) == 0, 10)
    assert seconds < 5, seconds  # one heartbeat, on each router
    agent = cluster.latest("dev-1")
    wait_until(lambda: agent.process.poll() is not None, 30)  # refused by every router: it stops
    assert agent.process.returncode == 2 and "agent 'dev-1' is revoked (site-wide)" in agent.log()
    restart(cluster, "router-b", nats.url, b)
    listed = fleet_cli(b, "revoke", "--list", "--json")
    assert listed.returncode == 0, listed
    (entry,) = json.loads(listed.stdout)["revoked"]
    assert (entry["credential"], entry["reason"]) == ("agent:dev-1", "device stolen")
    lifted = fleet_cli(b, "revoke", "--lift", "agent:dev-1")
    assert lifted.returncode == 0 and "agent:dev-1 is trusted again" in lifted.stdout, lifted
    cluster.agent("dev-1", f"{a},{b}")
    wait_until(lambda: ready_count(a) == 1 and ready_count(b) == 1, 60)
    malformed = fleet_cli(a, "revoke", "dev-1")
    assert malformed.returncode != 0 and "INVALID_ARGUMENT" in malformed.stderr, malformed
    assert "give a SPIFFE id" in malformed.stderr


def test_a_router_without_a_store_refuses_a_site_wide_revocation_saying_what_to_do(cluster: Cluster) -> None:
    router = cluster.router().address
    refused = fleet_cli(router, "revoke", "agent:dev-1")
    assert refused.returncode != 0 and "FAILED_PRECONDITION" in refused.stderr, refused
    assert "--revoked-certificates" in refused.stderr and "--site-state" in refused.stderr
