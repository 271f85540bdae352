"""Other people's OIP servers as the cloud tier: NVIDIA Triton (PyTriton), MLServer and
KServe's model server, each a real server from the package registry in an environment of
its own (scripts/foreign_env.py), serving digits' cloud variant as ``digits-large`` from
models/digits/digits-large.onnx through ONNX Runtime.

Each server is started once for this module; a real router and a device agent (digits only)
climb to it. What each test shows comes from outside the router: the server's own request
counter, ONNX Runtime's answer on the same file in this process, and the router's answers
as any client reads them. Triton runs hardened (every protocol needs its access token, so
the router's header must go on every call); KServe has no ModelStreamInfer and MLServer's
is not the protocol's (both get unary calls). Each is found another way: Triton through
``--cloud-models``, KServe (no repository index) through the cloud variants the agents'
families name, MLServer through its repository index.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from router.cloud.link import RECONNECT_OPTIONS
from stratus.serving.channels import open_sync_channel
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc
from tests.scripts import load

from .cluster import MODELS, Cluster, fleet_status, infer, ready_count, wait_until

MODEL = MODELS / "digits" / "digits-large.onnx"
NAME = "digits-large"
TOKEN = "stratus-test-token"
TOKEN_HEADER = "triton-grpc-protocol-triton-access-token"


foreign_env = load("foreign_env")


@dataclass
class Setup:
    """How the router is pointed at one kind of server, and what it should learn there."""

    server: str
    router_flags: tuple[str, ...]
    transport: str
    start: dict[str, Any]


SETUPS = {
    "triton": Setup(
        "triton",
        ("--cloud-models", NAME, "--cloud-header", f"{TOKEN_HEADER}={TOKEN}"),
        "stream",
        {"access_token": TOKEN, "restrict_inference": True},
    ),
    "kserve": Setup("kserve", (), "unary", {}),  # found as digits' cloud variant, no flag
    "mlserver": Setup("mlserver", (), "unary", {}),  # its RepositoryIndex lists digits-large
}


@dataclass
class Foreign:
    setup: Setup
    cluster: Cluster
    server: Any  # foreign_env.Running
    router: str
    log_dir: Path

    def restart(self) -> None:
        self.server = foreign_env.start(
            self.server.server,
            MODEL,
            name=NAME,
            log_dir=self.log_dir,
            grpc_port=self.server.ports["grpc"],
            **self.setup.start,
        )


@pytest.fixture(scope="module", params=sorted(SETUPS))
def foreign(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Foreign]:
    setup = SETUPS[request.param]
    server_kind = foreign_env.SERVERS[setup.server]
    if not foreign_env.is_ready(server_kind):
        pytest.skip(foreign_env.why_not_ready(server_kind))
    log_dir = tmp_path_factory.mktemp(f"foreign-{setup.server}")
    server = foreign_env.start(server_kind, MODEL, name=NAME, log_dir=log_dir, **setup.start)
    cluster = Cluster(log_dir / "logs")
    built = None
    try:
        router = cluster.router("--cloud", server.address, *setup.router_flags).address
        cluster.agent("dev-1", router, "--variants", "digits-small")
        built = Foreign(setup=setup, cluster=cluster, server=server, router=router, log_dir=log_dir)
        wait_until(lambda: ready_count(router) == 1 and _escalates(router), timeout_s=30)
        yield built
    finally:
        cluster.stop_all()
        (built.server if built else server).stop()


def _settled(foreign: Foreign, *, quiet_s: float = 0.5) -> float:
    """The server's counter once it has stopped moving: a server may count a request a
    moment after its answer left (Triton does), so a count read right after an earlier
    request can still be short of it."""
    count = foreign.server.served()
    while True:
        time.sleep(quiet_s)
        latest = foreign.server.served()
        if latest == count:
            return latest
        count = latest


def _counted(foreign: Foreign, before: float, requests: int) -> None:
    """The server's own counter has gone up by exactly ``requests`` (it may publish late)."""
    wait_until(lambda: foreign.server.served() - before >= requests, timeout_s=5)
    assert foreign.server.served() - before == requests


def _escalates(router: str) -> bool:
    return infer(router, np.zeros((1, 64), np.float32), min_confidence=1.0)[1].tier is Tier.CLOUD


@pytest.fixture(scope="module")
def onnx_runtime() -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])


def _probabilities(response: pb.ModelInferResponse) -> np.ndarray:
    (output,) = response.outputs
    assert (output.name, output.datatype) == ("probabilities", "FP32")
    data = response.raw_output_contents[0] if response.raw_output_contents else None
    if data is not None:
        return np.frombuffer(data, np.float32).reshape(tuple(output.shape))
    return np.asarray(output.contents.fp32_contents, np.float32).reshape(tuple(output.shape))


def test_escalations_reach_the_server_and_answer_as_onnx_runtime(
    foreign: Foreign, digits, onnx_runtime
) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x[:12].astype(np.float32)
    expected = onnx_runtime.run(None, {"input": x})[0]
    before = _settled(foreign)
    for index in range(len(x)):
        response, served = infer(foreign.router, x[index : index + 1], min_confidence=1.0)
        assert (served.tier, served.path, served.degraded) == (Tier.CLOUD, (Tier.DEVICE, Tier.CLOUD), False)
        assert served.variant == NAME and served.agent == f"cloud@{foreign.server.address}"
        got = _probabilities(response)
        np.testing.assert_allclose(got, expected[index : index + 1], rtol=1e-6, atol=1e-7)
        assert served.confidence == pytest.approx(float(got.max()), rel=1e-6)  # the router judged it
    _counted(foreign, before, len(x))  # the server itself counted each one
    assert f"connected ({foreign.setup.transport})" in foreign.cluster.latest("router").log()


def test_a_batch_climbs_whole_and_keeps_its_order(foreign: Foreign, digits, onnx_runtime) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x[20:28].astype(np.float32)
    response, served = infer(foreign.router, x, min_confidence=1.0)
    assert served.item_tiers == (Tier.CLOUD,) * len(x)
    np.testing.assert_allclose(
        _probabilities(response), onnx_runtime.run(None, {"input": x})[0], rtol=1e-6, atol=1e-7
    )
    _, served = infer(foreign.router, x[:1], min_confidence=0.0)
    assert served.tier is Tier.DEVICE  # nothing needed the cloud


def test_the_server_going_away_degrades_and_its_return_is_picked_up(foreign: Foreign, digits) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x
    foreign.server.process.send_signal(signal.SIGKILL)
    foreign.server.stop(timeout_s=5.0)
    wait_until(lambda: fleet_status(foreign.router).cloud.state != "connected", timeout_s=20)
    for index in range(5):
        response, served = infer(foreign.router, x[index : index + 1], min_confidence=1.0)
        assert served.degraded and served.path == (Tier.DEVICE,)
        assert response.outputs[0].name == "probabilities"
    foreign.restart()
    # from the moment it serves again, the next redial (at most one capped backoff away) finds
    # it; the slack is for connecting and learning its models on shared cores (as test_faults)
    cap_s = dict(RECONNECT_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000
    back_s = wait_until(lambda: _escalates(foreign.router), timeout_s=20)
    assert back_s < cap_s + 2.0, f"escalations stayed degraded {back_s:.1f} s after {foreign.setup.server} was back"
    before = _settled(foreign)
    assert infer(foreign.router, x[1:2], min_confidence=1.0)[1].tier is Tier.CLOUD
    _counted(foreign, before, 1)


@pytest.mark.parametrize("foreign", ["triton"], indirect=True)
def test_hardened_triton_serves_only_callers_with_its_token(foreign: Foreign, digits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x = digits.held_out.x[:1].astype(np.float32)
    before = _settled(foreign)
    asked = pb.ModelInferRequest(model_name=NAME)
    asked.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    asked.raw_input_contents.append(x.tobytes())
    with open_sync_channel(foreign.server.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(asked, timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and TOKEN_HEADER in refused.value.details()
        assert stub.ModelInfer(asked, timeout=5, metadata=[(TOKEN_HEADER, TOKEN)]).outputs
    cluster = Cluster(tmp_path / "logs")
    try:  # the same router without the header: escalations are refused there and degrade
        router = cluster.router("--cloud", foreign.server.address, "--cloud-models", NAME)
        cluster.agent("dev-2", router.address, "--variants", "digits-small")
        wait_until(lambda: ready_count(router.address) == 1)
        wait_until(lambda: f"serves digits->{NAME}" in router.log())  # learnt, without the token
        assert "the cloud refused the stream: UNAVAILABLE" in router.log()
        for _ in range(3):
            _, served = infer(router.address, x, min_confidence=1.0)
            assert served.degraded and served.path == (Tier.DEVICE,)
        assert fleet_status(router.address).cloud.state != "connected"
    finally:
        cluster.stop_all()
    _counted(foreign, before, 1)  # the call with the token; nothing from the router without it
