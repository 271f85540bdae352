"""Every queue and stream is bounded (the security review's F11-F13): a stream client that
never reads, a link that never says Hello, ids and names that would forge log lines or grow
the router. Each against a real router, with an agent serving beside it."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stratus.convert import codec
from stratus.convert.tensors import MAX_REQUEST_ITEMS
from stratus.devtools.launcher import free_port
from stratus.serving.channels import grpc_options
from stratus.serving.client_limits import IDLE_STREAMS_PER_CLIENT, MAX_STREAMS_PER_CLIENT, SILENT_STREAM_S
from stratus.serving.stream import STREAM_WINDOW, STREAM_WINDOW_BYTES
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import Cluster, fleet_status, infer, ready_count, wait_until


def answered(metrics: str) -> float:
    """Requests the router has answered on the device tier, as it counts them."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "stratus_router_requests_total" and s.labels.get("tier") == "device"
    )


def settled_count(read: Callable[[], float], still_s: float = 1.0, timeout_s: float = 60.0) -> float:
    """A count once it has not moved for ``still_s``: a router that read every request would
    move on until all were answered, so what it settles at is what it holds back, on any machine."""
    deadline = time.monotonic() + timeout_s
    last = read()
    while time.monotonic() < deadline:
        time.sleep(still_s)
        now = read()
        if now == last:
            return now
        last = now
    raise AssertionError(f"the count never settled: {last} after {timeout_s} s")


def test_a_stream_client_that_never_reads_holds_a_window_of_answers_not_all(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    metrics = f"127.0.0.1:{free_port()}"
    router = cluster.router("--metrics", metrics).address
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1, timeout_s=30)
    sent = 5_000
    request = pb.ModelInferRequest(model_name="digits")
    codec.encode_request_inputs(request, {"input": digits.held_out.x[:8]})  # 320 bytes answered
    request.parameters["stratus.max_tier"].string_param = "device"
    # No window growth on this client: HTTP/2 then buffers about 64 KiB of answers unread,
    # so what the router answered beyond its window is small and known.
    options = [*grpc_options(), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(router, options=options) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request] * sent), timeout=120)
        wait_until(lambda: answered(metrics) >= STREAM_WINDOW, timeout_s=30)
        held = settled_count(lambda: answered(metrics))  # however slow the machine: it stopped
        assert STREAM_WINDOW <= held < sent / 2, held  # the window, and what the transport buffers
        responses = list(call)  # now read: every request is answered, none lost
    assert len(responses) == sent and not any(r.error_message for r in responses)


def test_a_stream_of_big_requests_is_bounded_by_bytes_too(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    metrics = f"127.0.0.1:{free_port()}"
    # The byte window admits 8 MiB of requests, 31 of 1,024 items: 31,744 items, past the default
    # per-client cap of 16,384. Where most are computed at once (a slow moment), the cap refused
    # a few (Overloaded, on the stream); that cap is tested in unit/test_auth.py, the window here.
    router = cluster.router("--metrics", metrics, "--max-items-per-client", "65536").address
    cluster.agent("dev-1", router, "--queue-limit", "1024")  # room for every request the router reads
    wait_until(lambda: ready_count(router) == 1, timeout_s=30)
    request = pb.ModelInferRequest(model_name="digits")
    codec.encode_request_inputs(request, {"input": np.repeat(digits.held_out.x[:1], MAX_REQUEST_ITEMS, axis=0)})
    request.parameters["stratus.max_tier"].string_param = "device"
    by_bytes = STREAM_WINDOW_BYTES // request.ByteSize()  # 31 of these 256 KiB requests
    assert by_bytes < STREAM_WINDOW / 1.5  # so the byte window, not the count, is what binds
    sent = by_bytes * 2 + 20
    options = [*grpc_options(), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(router, options=options) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request] * sent), timeout=120)
        wait_until(lambda: answered(metrics) >= by_bytes, timeout_s=60)
        time.sleep(2.0)
        held = answered(metrics)
        # The byte window, and the one or two 40 KiB answers HTTP/2 buffers unread.
        assert by_bytes <= held <= by_bytes + 4, (held, by_bytes)
        responses = list(call)
    assert len(responses) == sent and not any(r.error_message for r in responses)


def test_a_link_that_never_says_hello_is_closed(cluster: Cluster) -> None:
    router = cluster.router("--hello-timeout-s", "1").address
    done = threading.Event()

    def silence() -> Iterator[fpb.AgentMessage]:  # says nothing until the test is over
        done.wait(30)
        yield from ()

    with grpc.insecure_channel(router) as channel:
        started = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as closed:
                list(fpb_grpc.AgentLinkStub(channel).Connect(silence(), timeout=20))
        finally:
            done.set()  # the channel's sending thread ends with the iterator
    assert closed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert closed.value.details() == "no Hello within 1 s of opening an AgentLink"
    assert time.monotonic() - started < 15  # closed by the router, not by the client's deadline


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (
            {"agent_id": "innocent\n2026-12-01 07:00:00,000 WARNING stratus.registry: agent device-1 lost"},
            "Hello.agent_id 'innocent\\n2026-12-01 07:00:00,000 WARNING' must be 1-128 of",
        ),
        ({"agent_id": "a" * 129}, "must be 1-128 of A-Z a-z 0-9"),
        (
            {"families": [fpb.FamilyInfo(name=f"f{i}") for i in range(65)]},
            "65 families; at most 64 and 64",
        ),
        (
            {"variants": [fpb.VariantInfo(name="x y", family="digits")]},
            "model name 'x y' must be 1-128 of",
        ),
    ],
)
def test_ids_and_names_past_the_bounds_are_refused_before_they_are_logged(
    cluster: Cluster, change: dict[str, object], refusal: str
) -> None:
    router = cluster.router()
    hello = fpb.Hello(
        agent_id="fine", tier=fpb.TIER_DEVICE, variants=[fpb.VariantInfo(name="digits-small", family="digits")]
    )
    for field, value in change.items():
        if isinstance(value, list):
            getattr(hello, field).extend(value)
        else:
            setattr(hello, field, value)
    with grpc.insecure_channel(router.address) as channel, pytest.raises(grpc.RpcError) as refused:
        list(fpb_grpc.AgentLinkStub(channel).Connect(iter([fpb.AgentMessage(hello=hello)]), timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal in refused.value.details()
    assert "07:00:00,000 WARNING" not in router.log()  # the injected line never became one
    assert list(fleet_status(router.address).agents) == []


def test_a_misspelled_model_lists_a_bounded_number_of_names(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    router = cluster.router().address
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1, timeout_s=30)
    with pytest.raises(grpc.RpcError) as refused:
        infer(router, np.zeros((1, 64), np.float32), model="digts")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert refused.value.details().startswith("unknown model 'digts'; the fleet serves [")


def test_silent_streams_are_capped_per_client_closed_when_silent_and_starve_nobody(cluster: Cluster, digits) -> None:  # type: ignore[no-untyped-def]
    """security2 N1: one address opening many ModelStreamInfer streams that never ask anything
    gets MAX_STREAMS_PER_CLIENT of them; all but IDLE_STREAMS_PER_CLIENT are closed once silent
    for SILENT_STREAM_S; meanwhile ServerLive, an operator's Status and a new agent's link work,
    and the streams allowed to wait still answer."""
    router = cluster.router().address
    cluster.agent("dev-1", router)
    wait_until(lambda: ready_count(router) == 1, timeout_s=30)
    opened = MAX_STREAMS_PER_CLIENT + 40

    async def flood() -> tuple[dict[str, int], dict[str, int], pb.ModelInferResponse]:
        never = asyncio.Event()
        first = pb.ModelInferRequest(model_name="digits", id="late")
        codec.encode_request_inputs(first, {"input": digits.held_out.x[:1]})
        queues: list[asyncio.Queue[pb.ModelInferRequest | None]] = [asyncio.Queue() for _ in range(opened)]

        async def requests(queue: asyncio.Queue[pb.ModelInferRequest | None]) -> AsyncIterator[pb.ModelInferRequest]:
            while (request := await queue.get()) is not None:
                yield request
            await never.wait()

        async with grpc.aio.insecure_channel(router, options=grpc_options()) as a, grpc.aio.insecure_channel(
            router, options=grpc_options()
        ) as b:
            calls = [
                pb_grpc.GRPCInferenceServiceStub((a, b)[i % 2]).ModelStreamInfer(requests(q))
                for i, q in enumerate(queues)
            ]
            await asyncio.sleep(3.0)
            early = Counter([(await call.code()).name for call in calls if call.done()])
            # the router still serves everyone else while the streams are held
            async with grpc.aio.insecure_channel(router, options=grpc_options()) as other:
                live = await pb_grpc.GRPCInferenceServiceStub(other).ServerLive(pb.ServerLiveRequest(), timeout=5)
                assert live.live
            assert len(fleet_status(router).agents) == 1
            cluster.agent("dev-2", router)
            wait_until(lambda: ready_count(router) == 2, timeout_s=30)
            await asyncio.sleep(SILENT_STREAM_S + 2.0)
            late = Counter([(await call.code()).name for call in calls if call.done()])
            waiting = [(call, q) for call, q in zip(calls, queues, strict=True) if not call.done()]
            call, queue = waiting[0]
            queue.put_nowait(first)
            answer = await asyncio.wait_for(call.read(), 10)
            never.set()
            for call, queue in zip(calls, queues, strict=True):
                queue.put_nowait(None)  # each request iterator ends, and with it gRPC's task reading it
                call.cancel()
            await asyncio.sleep(0.5)
            return early, late, answer.infer_response

    early, late, answer = asyncio.run(flood())
    assert early == {"RESOURCE_EXHAUSTED": opened - MAX_STREAMS_PER_CLIENT}, early
    assert late == {
        "RESOURCE_EXHAUSTED": opened - MAX_STREAMS_PER_CLIENT,
        "DEADLINE_EXCEEDED": MAX_STREAMS_PER_CLIENT - IDLE_STREAMS_PER_CLIENT,
    }, late
    assert answer.id == "late" and codec.decode_response_outputs(answer)["probabilities"].shape == (1, 10)
