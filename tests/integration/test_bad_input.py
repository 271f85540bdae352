"""Bad input of every kind gets a precise status, and nobody else is disturbed.

Fuzzes ModelInfer and ModelStreamInfer on the shared fleet's router with hypothesis, and
feeds its AgentLink garbage, out-of-order and malformed messages.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.fleet.states import MISSED_HEARTBEATS
from stratus.convert.errors import wire_error
from stratus.convert.parameters import set_parameter
from stratus.devtools.launcher import Launched
from stratus.serving.channels import grpc_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import Cluster, fleet_status, infer, request, wait_until

CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}

datatypes = st.sampled_from(
    ["FP32", "FP16", "FP64", "INT8", "INT32", "INT64", "UINT8", "BOOL", "BYTES", "FP8", ""]
)
dims = st.one_of(st.integers(-3, 70), st.sampled_from([1 << 31, 1 << 40, -(1 << 40)]))
parameter_values = st.one_of(
    st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=5)
)


@st.composite
def requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(
        model_name=draw(
            st.sampled_from(["digits", "digits-small", "digits-large", "letters", "", "digits-huge"])
        )
    )
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = message.inputs.add(
            name=draw(st.sampled_from(["input", "image", ""])),
            datatype=draw(datatypes),
            shape=draw(st.lists(dims, max_size=3)),
        )
        if raw:
            message.raw_input_contents.append(draw(st.binary(max_size=300)))
        elif draw(st.booleans()):
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=70)))
    if raw and draw(st.booleans()):
        message.raw_input_contents.append(b"extra")
    for key in draw(
        st.lists(
            st.sampled_from(
                [
                    "stratus.budget_ms",
                    "stratus.min_confidence",
                    "stratus.max_tier",
                    "stratus.min_tier",
                    "stratus.bogus",
                ]
            ),
            max_size=3,
            unique=True,
        )
    ):
        set_parameter(message.parameters, key, draw(parameter_values))
    return message


def clear_status(router: str, message: pb.ModelInferRequest) -> None:
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        try:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=10)
        except grpc.RpcError as error:
            assert error.code() in CLEAR, (error.code(), error.details())
            assert error.details()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=requests())
def test_fuzzed_model_infer_gets_a_clear_status(router: str, message: pb.ModelInferRequest) -> None:
    clear_status(router, message)


def fuzz_infer(router: str) -> None:
    @settings(max_examples=30, deadline=None, database=None)
    @given(message=requests())
    def run(message: pb.ModelInferRequest) -> None:
        clear_status(router, message)

    run()


def still_serves(router: str, x: np.ndarray) -> None:
    response, _ = infer(router, x[:4])
    assert len(response.raw_output_contents) == 1
    assert all(a.state == fpb.AGENT_STATE_READY for a in fleet_status(router).agents)


def test_the_router_still_serves_after_fuzzing(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    """Fuzzes inline (not relying on another test having run first), then serves."""
    fuzz_infer(router)
    still_serves(router, digits.held_out.x)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(requests(), min_size=1, max_size=6))
def test_fuzzed_stream_answers_each_request_and_keeps_the_stream(
    router: str, batch: list[pb.ModelInferRequest]
) -> None:
    for index, message in enumerate(batch):
        message.id = str(index)
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answers = list(stub.ModelStreamInfer(iter(batch), timeout=30))
    assert sorted(a.infer_response.id for a in answers) == sorted(m.id for m in batch)
    for answer in answers:
        if answer.error_message:
            assert answer.error_message.split(":")[0] in {"INVALID_ARGUMENT", "NOT_FOUND"}, (
                answer.error_message
            )


def test_oversized_messages_are_refused_by_the_router(router: str, digits) -> None:  # type: ignore[no-untyped-def]
    big = np.zeros((70_000, 64), np.float32)  # 17.9 MB, over the router's 16 MiB limit
    # A client that would send up to 64 MiB, so that only the router's own limit can refuse it.
    with (
        grpc.insecure_channel(router, options=grpc_options(64 << 20)) as channel,
        pytest.raises(grpc.RpcError) as error,
    ):
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request(big), timeout=30)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Received message larger than max" in (error.value.details() or ""), error.value.details()
    still_serves(router, digits.held_out.x)


def _raw_link(
    router: str, messages: list[bytes], *, read: bool = True
) -> tuple[list[bytes], grpc.RpcError | None]:
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        connect = channel.stream_stream(
            "/stratus.v1.AgentLink/Connect", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        received: list[bytes] = []
        try:
            for message in connect(iter(messages), timeout=5):
                received.append(message)
        except grpc.RpcError as error:
            return received, error
    return received, None


def hello(agent_id: str, variant: str = "digits-small", **changes: object) -> fpb.AgentMessage:
    message = fpb.Hello(
        agent_id=agent_id,
        tier=fpb.TIER_DEVICE,
        capacity=1,
        variants=[fpb.VariantInfo(name=variant, family="digits")],
    )
    for key, value in changes.items():
        setattr(message, key, value)
    return fpb.AgentMessage(hello=message)


@pytest.mark.parametrize(
    ("messages", "code", "text"),
    [
        ([b"\xff\xfe garbage \x00\x01"], grpc.StatusCode.INTERNAL, ""),
        (
            [fpb.AgentMessage(result=fpb.Result(request_id="r1")).SerializeToString()],
            grpc.StatusCode.INVALID_ARGUMENT,
            "first message on an AgentLink must be a Hello",
        ),
        ([hello("").SerializeToString()], grpc.StatusCode.INVALID_ARGUMENT, "agent_id is empty"),
        (
            [hello("x", tier=fpb.TIER_UNSPECIFIED).SerializeToString()],
            grpc.StatusCode.INVALID_ARGUMENT,
            "tier is unspecified",
        ),
        (
            [fpb.AgentMessage(hello=fpb.Hello(agent_id="x", tier=fpb.TIER_EDGE)).SerializeToString()],
            grpc.StatusCode.INVALID_ARGUMENT,
            "no variants",
        ),
    ],
)
def test_agent_link_refuses_malformed_peers(
    router: str, messages: list[bytes], code: grpc.StatusCode, text: str
) -> None:
    _, error = _raw_link(router, messages)
    assert error is not None and error.code() == code, error
    assert text in (error.details() or "")
    assert {a.id for a in fleet_status(router).agents} >= {"device-1", "device-2", "edge-1"}


@pytest.fixture(scope="module")
def lone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    """A router of its own, with no agents, so the peers these tests leave lost stay here."""
    cluster = Cluster(tmp_path_factory.mktemp("lone-router"))
    try:
        yield cluster.router()
    finally:
        cluster.stop_all()


class Peer:
    """A hand-driven AgentLink peer on a stream held open until ``close``."""

    def __init__(self, router: str, *first: fpb.AgentMessage) -> None:
        self._gate: queue.Queue[bytes | None] = queue.Queue()
        for message in first:
            self.send(message)
        self._channel = grpc.insecure_channel(router, options=grpc_options())
        connect = self._channel.stream_stream(
            "/stratus.v1.AgentLink/Connect", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        self.call = connect(self._outgoing(), timeout=30)

    def _outgoing(self) -> Iterator[bytes]:
        while (item := self._gate.get()) is not None:
            yield item

    def send(self, message: fpb.AgentMessage) -> None:
        self._gate.put(message.SerializeToString())

    def receive(self) -> fpb.RouterMessage:
        return fpb.RouterMessage.FromString(next(self.call))

    def wait_for_the_end(self) -> None:
        """Read until the router ends the stream, whether with OK or an error status."""
        try:
            for _ in self.call:
                pass
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._gate.put(None)
        self.call.cancel()
        self._channel.close()


def state_of(router: str, agent_id: str) -> fpb.AgentStatus:
    (found,) = [a for a in fleet_status(router).agents if a.id == agent_id]
    return found


def test_an_unknown_result_is_ignored_and_the_peer_still_gets_work(lone: Launched, digits) -> None:  # type: ignore[no-untyped-def]
    stray = fpb.AgentMessage(result=fpb.Result(request_id="no-such-request"))
    peer = Peer(lone.address, hello("stray-peer"), stray, fpb.AgentMessage(heartbeat=fpb.Heartbeat()))
    asked: list[BaseException | None] = []

    def ask() -> None:
        try:
            infer(lone.address, digits.held_out.x[:1], model="digits-small", timeout=10)
            asked.append(None)
        except grpc.RpcError as exc:
            asked.append(exc)

    client = threading.Thread(target=ask, name="stray-peer-client")
    try:
        assert peer.receive().HasField("welcome")
        wait_until(lambda: state_of(lone.address, "stray-peer").state == fpb.AGENT_STATE_READY)
        client.start()
        work = peer.receive()  # the router still routes to it, on the same link
        assert work.HasField("work"), work
        failed = wire_error(grpc.StatusCode.INTERNAL, "stray-peer cannot run it")
        peer.send(fpb.AgentMessage(result=fpb.Result(request_id=work.work.request_id, error=failed)))
        client.join(timeout=15)
        assert not client.is_alive(), "the client's request never ended"
        assert state_of(lone.address, "stray-peer").state == fpb.AGENT_STATE_READY
    finally:
        peer.close()
        if client.ident is not None:  # started
            client.join(timeout=15)
    (outcome,) = asked
    assert isinstance(outcome, grpc.RpcError) and "stray-peer cannot run it" in (outcome.details() or ""), (
        outcome
    )


def test_a_second_hello_is_taken_as_a_reload(lone: Launched) -> None:
    peer = Peer(lone.address, hello("reloading-peer"))
    try:
        assert peer.receive().HasField("welcome")
        wait_until(lambda: list(state_of(lone.address, "reloading-peer").variants) == ["digits-small"])
        peer.send(hello("reloading-peer", variant="digits-small-v2"))
        wait_until(lambda: list(state_of(lone.address, "reloading-peer").variants) == ["digits-small-v2"])
        assert state_of(lone.address, "reloading-peer").state == fpb.AGENT_STATE_READY  # same link
        assert "agent reloading-peer reloaded: variants ['digits-small-v2']" in lone.log()
    finally:
        peer.close()


def test_a_peer_that_goes_silent_after_hello_is_dropped_for_its_missed_heartbeats(lone: Launched) -> None:
    started = time.monotonic()
    peer = Peer(lone.address, hello("mute-peer"))  # gRPC's core still answers its pings
    try:
        assert peer.receive().HasField("welcome")
        peer.wait_for_the_end()  # the router ends the stream once it counts the peer lost
        took = time.monotonic() - started
    finally:
        peer.close()
    assert state_of(lone.address, "mute-peer").state == fpb.AGENT_STATE_LOST
    interval = fleet_status(lone.address).heartbeat_interval_s
    assert MISSED_HEARTBEATS * interval <= took < 10 * MISSED_HEARTBEATS * interval, took
    assert "agent mute-peer lost: missed 3 heartbeats" in lone.log()
