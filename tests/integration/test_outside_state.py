"""What comes from outside is checked before it is used, against real processes (security
review F2, F4, F16, F19): a Hello describing a family unlike the fleet, declared sizes past the
maxima, a poisoned rollout record in the site's store, and more Watch calls than the router keeps."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from router.fleet.hello import MAX_CAPACITY, MAX_QUEUE_LIMIT
from router.fleet.watchers import MAX_WATCHERS_PER_ADDRESS
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc

from .cluster import Cluster, fleet_status, infer, ready_count, wait_until


def rogue_hello() -> fpb.AgentMessage:
    """digits described with a threshold of 0 (every answer settles at once), a family of its
    own, and sizes far past any maximum."""
    return fpb.AgentMessage(
        hello=fpb.Hello(
            agent_id="rogue-1",
            tier=fpb.TIER_DEVICE,
            capacity=4_000_000_000,
            queue_limit=4_000_000_000,
            variants=[
                fpb.VariantInfo(name="digits-small", family="digits", max_batch=1_000_000),
                fpb.VariantInfo(name="rogue-variant", family="rogue-family"),
            ],
            families=[
                fpb.FamilyInfo(name="digits", thresholds={"device": 0.0}),
                fpb.FamilyInfo(name="rogue-family"),
            ],
        )
    )


def test_a_conflicting_family_is_refused_alone_and_sizes_are_clamped(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router()
    cluster.agent("dev-1", router.address)
    wait_until(lambda: ready_count(router.address) == 1, timeout_s=30)
    done, works = threading.Event(), []

    def messages() -> Iterator[fpb.AgentMessage]:
        yield rogue_hello()
        done.wait(30)

    with grpc.insecure_channel(router.address) as channel:
        call = fpb_grpc.AgentLinkStub(channel).Connect(messages(), timeout=30)

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled at the end of the test
                for message in call:
                    works.append(message.WhichOneof("kind"))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            wait_until(lambda: "rogue-1" in {a.id for a in fleet_status(router.address).agents})
            rogue = next(a for a in fleet_status(router.address).agents if a.id == "rogue-1")
            assert (rogue.capacity, rogue.queue_limit) == (MAX_CAPACITY, MAX_QUEUE_LIMIT)
            assert list(rogue.variants) == ["rogue-variant"]  # digits refused, the rest served
            assert any("digits" in u and "refused by the router: " in u for u in rogue.unavailable)
            served = {infer(router.address, digits.held_out.x[i : i + 1])[1].agent for i in range(20)}
            assert served == {"dev-1"}
        finally:
            done.set()
            call.cancel()
            reader.join(10)
    assert works.count("work") == 0 and works[0] == "welcome"
    assert "agent rogue-1: not serving ['digits'] here" in router.log()


def test_a_poisoned_rollout_record_in_the_sites_store_is_skipped_and_named(
    cluster: Cluster, tmp_path: Path, digits  # type: ignore[no-untyped-def]
) -> None:
    """The plan that once made every digits request INTERNAL, written into the store by whoever
    could: refused when read, the key and the problem named in the log, and the family served
    on its current variant; a record of the store's that is fine still applies beside it."""
    from router.site.file import FileSiteState

    plan = {"family": "digits", "tier": "device", "candidate": "digits-small", "min_requests": 1,
            "state": "running", "reason": "x", "revision": 9, "updated": 0.0, "origin": "evil",
            "steps": [5.0], "step": 9}  # fmt: skip
    pushed = {"family": "digits", "history": [{"version": 1, "thresholds": {"device": 0.5}}]}
    path = tmp_path / "site.json"

    async def poison() -> None:
        store = FileSiteState(path)
        await store.start()
        await store.put("rollout.digits.device", json.dumps(plan).encode())
        await store.put("thresholds.digits", json.dumps(pushed).encode())
        await store.close()

    asyncio.run(poison())
    router = cluster.router("--site-state", f"file:{path}")
    cluster.agent("device-1", router.address)
    wait_until(lambda: ready_count(router.address) == 1)
    response, _ = infer(router.address, digits.held_out.x[:4])
    assert response.outputs  # served, not INTERNAL
    assert "site state rollout.digits.device (revision 1) is not valid and was skipped" in router.log()
    assert "rollout step 9 is outside its 1 steps" in router.log()
    with grpc.insecure_channel(router.address) as channel:
        reply = fpb_grpc.FleetStub(channel).Thresholds(fpb.ThresholdsRequest(family="digits"), timeout=5)
    assert reply.in_force["device"] == 0.5


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        (("--peers", "127.0.0.1:9"), "--peers was removed with the routers' peer protocol"),
        (("--rollout-state", "rollouts.json"), "--rollout-state was removed with the routers' peer protocol"),
    ],
)
def test_the_peer_protocols_flags_stop_the_router_saying_what_replaced_them(
    flag: tuple[str, str], says: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "router", "--listen", "127.0.0.1:0", "--no-advertise", *flag],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"stratus: error: {says}") and "--site-state" in last, done.stderr
    assert "Traceback" not in done.stderr


def test_watch_calls_past_the_cap_are_refused_and_the_operator_keeps_a_place(cluster: Cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """security2 N16: 64 strangers' watchers locked the operator out of Watch."""
    token = tmp_path / "operator.token"
    token.write_text("operator-token-00000001\n")
    router = cluster.router("--operator-token-file", str(token)).address
    with grpc.insecure_channel(router) as channel:
        stub = fpb_grpc.FleetStub(channel)
        calls = [
            stub.Watch(fpb.FleetWatchRequest(include_agents=True), timeout=30)
            for _ in range(MAX_WATCHERS_PER_ADDRESS)
        ]
        try:
            for call in calls:
                next(call)  # each has its first status
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.Watch(fpb.FleetWatchRequest(), timeout=10))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"this address holds {MAX_WATCHERS_PER_ADDRESS} Watch calls" in (refused.value.details() or "")
            operator = stub.Watch(fpb.FleetWatchRequest(token="operator-token-00000001"), timeout=10)
            assert next(operator).status.router_version  # the operator's still gets its status
            operator.cancel()
        finally:
            for call in calls:
                call.cancel()
