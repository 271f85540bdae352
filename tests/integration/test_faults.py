"""Faults: agents killed or silent, a router restart, a cloud that is down or slow.

A request the router accepts is answered or gets a clear error; none is lost.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from edge_agent.sdk import Client
from stratus.launcher import free_port
from stratus.serving import grpc_options
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, fleet_status, infer, ready_count, request, states, wait_until
from .expected import unsure_rows


async def blast(
    router: str, x: np.ndarray, *, count: int, concurrency: int, on_progress=None, **parameters: object
):  # type: ignore[no-untyped-def]
    """Send ``count`` requests; return (answers, errors) where each error is (code, details)."""
    answers, errors = 0, []
    slots = asyncio.Semaphore(concurrency)
    done = 0
    async with grpc.aio.insecure_channel(router, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def one(index: int) -> None:
            nonlocal answers, done
            async with slots:
                try:
                    await stub.ModelInfer(request(x[index % len(x)][None, :], **parameters), timeout=30)
                    answers += 1
                except grpc.aio.AioRpcError as error:
                    errors.append((error.code(), error.details()))
                done += 1
                if on_progress is not None:
                    on_progress(done)

        await asyncio.gather(*(one(i) for i in range(count)))
    return answers, errors


def test_agent_killed_with_requests_in_flight_loses_nothing_and_rejoins(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router().address
    victim = cluster.agent("dev-1", router)
    cluster.agent("dev-2", router)
    wait_until(lambda: ready_count(router) == 2)
    killed = []

    def kill_midway(done: int) -> None:
        if done == 60 and not killed:
            victim.process.send_signal(signal.SIGKILL)
            killed.append(time.monotonic())

    answers, errors = asyncio.run(
        blast(
            router, digits.held_out.x, count=400, concurrency=32, on_progress=kill_midway, max_tier="device"
        )
    )
    assert killed, "the agent was never killed"
    assert errors == [] and answers == 400
    assert states(router)["dev-1"] == fpb.AGENT_STATE_LOST
    cluster.agent("dev-1", router)  # same name, a new process: it rejoins
    wait_until(lambda: states(router).get("dev-1") == fpb.AGENT_STATE_READY)


def test_a_silent_agent_is_lost_after_three_heartbeats_and_comes_back(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router().address
    silent = cluster.agent("dev-1", router)
    cluster.agent("dev-2", router)
    wait_until(lambda: ready_count(router) == 2)
    silent.process.send_signal(signal.SIGSTOP)
    try:
        took = wait_until(lambda: states(router)["dev-1"] == fpb.AGENT_STATE_LOST, timeout_s=10)
        assert took < 5.0
        served = {infer(router, digits.held_out.x[i : i + 1], max_tier="device")[1].agent for i in range(20)}
        assert served == {"dev-2"}
    finally:
        silent.process.send_signal(signal.SIGCONT)
    wait_until(lambda: states(router)["dev-1"] == fpb.AGENT_STATE_READY, timeout_s=15)


def test_router_restart_sdk_degrades_then_the_fleet_is_whole_within_5_s(
    cluster: Cluster, digits, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    listen = f"127.0.0.1:{free_port()}"
    router = cluster.router(listen=listen)
    for name in ("dev-1", "dev-2"):
        cluster.agent(name, listen)
    cluster.agent("edge-1", listen, tier="edge")
    wait_until(lambda: ready_count(listen) == 3)
    with Client(MODELS, router=listen, cache_dir=tmp_path) as client:
        assert client.infer("digits", digits.held_out.x[:1], min_confidence=1.0).path[-1] is Tier.EDGE
        assert router.stop() == 0
        away = client.infer("digits", digits.held_out.x[:1], min_confidence=1.0)
        assert away.degraded and away.path == (Tier.DEVICE,)
        cluster.router(listen=listen)
        started = time.monotonic()
        wait_until(lambda: ready_count(listen) == 3, timeout_s=10)
        assert time.monotonic() - started < 5.0
    _response, served = infer(listen, digits.held_out.x[:1], min_confidence=1.0)
    assert served.path == (Tier.DEVICE, Tier.EDGE)


def test_cloud_down_gives_degraded_answers_and_the_link_recovers(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud()
    router = cluster.router("--cloud", cloud.address).address
    cluster.agent("dev-1", router)
    cluster.agent("edge-1", router, tier="edge")
    wait_until(lambda: ready_count(router) == 2 and fleet_status(router).cloud.state == "connected")
    assert infer(router, digits.held_out.x[:1], min_confidence=1.0)[1].tier is Tier.CLOUD
    cloud.process.send_signal(signal.SIGKILL)
    cloud.process.wait()
    wait_until(lambda: fleet_status(router).cloud.state != "connected")
    for row in unsure_rows(digits.held_out.x, 10):
        response, served = infer(router, row[None, :], min_confidence=1.0)
        assert served.degraded and served.path == (Tier.DEVICE, Tier.EDGE)
        assert response.outputs[0].name == "probabilities"
    _confident, served = infer(router, digits.held_out.x[:1], min_confidence=0.0)
    assert not served.degraded  # nothing needed the cloud
    time.sleep(3.0)  # long enough for reconnect attempts to have backed off
    cluster.processes["cloud"] = cluster.start(
        "cloud", ["cloud", "--listen", cloud.address, "--models", str(MODELS)]
    )
    # from the moment the gateway listens again: escalations reach it (not degraded) within ~1 s
    recovered_s = wait_until(
        lambda: not infer(router, digits.held_out.x[:1], min_confidence=1.0)[1].degraded, timeout_s=15
    )
    assert recovered_s < 2.0, f"escalations stayed degraded {recovered_s:.2f} s after the cloud came back"
    assert infer(router, digits.held_out.x[:1], min_confidence=1.0)[1].tier is Tier.CLOUD


def test_on_cloud_failure_fail_answers_unavailable(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud()
    router = cluster.router("--cloud", cloud.address, "--on-cloud-failure", "fail").address
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1 and fleet_status(router).cloud.state == "connected")
    cloud.process.send_signal(signal.SIGKILL)
    cloud.process.wait()
    wait_until(lambda: fleet_status(router).cloud.state != "connected")
    with pytest.raises(grpc.RpcError) as error:
        infer(router, digits.held_out.x[:1], min_confidence=1.0)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "--on-cloud-failure fail" in error.value.details()
    _, served = infer(router, digits.held_out.x[:1], min_confidence=0.0)  # needs no cloud: answered
    assert served.tier is Tier.DEVICE and not served.degraded


def test_slow_cloud_answers_inside_the_budget_and_the_breaker_opens(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud()
    slow = cluster.start("netem", ["--target", cloud.address, "--delay-ms", "400"], module="stratus.netem")
    router = cluster.router("--cloud", slow.address).address
    cluster.agent("dev-1", router)
    wait_until(
        lambda: ready_count(router) == 1 and fleet_status(router).cloud.state == "connected", timeout_s=20
    )
    latencies = []
    for index in range(8):
        started = time.monotonic()
        _, served = infer(router, digits.held_out.x[index : index + 1], min_confidence=1.0, budget_ms=150.0)
        latencies.append(time.monotonic() - started)
        assert served.degraded and served.tier is Tier.DEVICE
    assert max(latencies) < 0.5  # 150 ms budget plus local overhead, never the 800 ms round trip
    _, served = infer(router, digits.held_out.x[:1], min_confidence=1.0, timeout=0.3)  # a gRPC deadline alone
    assert served.degraded and served.tier is Tier.DEVICE
    wait_until(lambda: fleet_status(router).cloud.state.startswith("circuit"), timeout_s=5)


def test_cloud_cut_while_escalations_are_in_flight(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    cloud = cluster.cloud()
    link = cluster.start("netem", ["--target", cloud.address], module="stratus.netem")
    router = cluster.router("--cloud", link.address).address
    cluster.agent("dev-1", router)
    wait_until(
        lambda: ready_count(router) == 1 and fleet_status(router).cloud.state == "connected", timeout_s=20
    )
    link.process.send_signal(signal.SIGUSR1)  # the cable is pulled: silence, no reset
    answers, errors = asyncio.run(
        blast(router, digits.held_out.x, count=30, concurrency=10, min_confidence=1.0, budget_ms=300.0)
    )
    assert answers == 30 and errors == []  # each comes back degraded within its budget


def test_overload_gets_resource_exhausted_naming_the_queue_and_loses_nothing(
    cluster: Cluster, digits
) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router().address
    cluster.agent(
        "dev-1",
        router,
        "--concurrency",
        "1",
        "--queue-limit",
        "2",
        "--max-batch",
        "1",
        "--emulate-slow-ms",
        "20",
    )
    wait_until(lambda: ready_count(router) == 1)
    (agent,) = fleet_status(router).agents
    assert (agent.capacity, agent.queue_limit) == (1, 2)  # what the router will hold it to
    answers, errors = asyncio.run(
        blast(router, digits.held_out.x, count=300, concurrency=300, max_tier="device", budget_ms=2000.0)
    )
    assert answers + len(errors) == 300
    assert answers > 0 and errors
    for code, details in errors:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        assert "full work queue" in details or "work queues are too long" in details
    assert infer(router, digits.held_out.x[:1], max_tier="device")[1].agent == "dev-1"  # and it recovers


def test_a_peer_that_heartbeats_but_never_reads_is_dropped_with_a_logged_reason(
    cluster: Cluster, digits
) -> None:  # type: ignore[no-untyped-def]
    import queue
    import threading

    router = cluster.router()
    cluster.agent("dev-1", router.address)
    wait_until(lambda: ready_count(router.address) == 1)
    outgoing: queue.Queue[bytes | None] = queue.Queue()
    outgoing.put(
        fpb.AgentMessage(
            hello=fpb.Hello(
                agent_id="deaf-peer",
                tier=fpb.TIER_DEVICE,
                capacity=1,
                variants=[fpb.VariantInfo(name="digits-small", family="digits")],
            )
        ).SerializeToString()
    )
    stop = threading.Event()

    def heartbeats() -> None:  # alive, says it has read nothing
        while not stop.wait(0.3):
            outgoing.put(fpb.AgentMessage(heartbeat=fpb.Heartbeat(received=0)).SerializeToString())

    def messages():  # type: ignore[no-untyped-def]
        while (item := outgoing.get()) is not None:
            yield item

    channel = grpc.insecure_channel(router.address, options=grpc_options())
    call = channel.stream_stream(
        "/stratus.v1.AgentLink/Connect", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )(messages())  # never read
    beating = threading.Thread(target=heartbeats, name="deaf-peer-heartbeats")
    beating.start()
    try:
        wait_until(lambda: ready_count(router.address) == 2)
        answers, errors = asyncio.run(
            blast(
                router.address, digits.held_out.x, count=300, concurrency=4, max_tier="device", budget_ms=50.0
            )
        )
        assert answers + len(errors) == 300
        # Requests sent to the deaf peer run out of their 50 ms budget, or fail with it when it is dropped.
        clear = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
        # Each names its cause: a budget in ms that ran out, or the deaf peer that was dropped.
        assert all(code in clear and (" ms" in text or "deaf-peer" in text) for code, text in errors), errors[
            :3
        ]
        wait_until(lambda: states(router.address)["deaf-peer"] == fpb.AGENT_STATE_LOST, timeout_s=10)
        assert "deaf-peer lost: not reading its link" in router.log()
        assert infer(router.address, digits.held_out.x[:1], max_tier="device")[1].agent == "dev-1"
    finally:
        stop.set()
        beating.join()
        outgoing.put(None)
        call.cancel()
        channel.close()
