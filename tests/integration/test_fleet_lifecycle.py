"""Joining, draining and leaving: zeroconf discovery, `stratus fleet drain`, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from edge_agent.sdk import Client
from stratus.cli import demo
from stratus.cli.demo import wait_for_agents
from stratus.convert import codec
from stratus.convert.parameters import Served
from stratus.devtools.launcher import Launched, launch
from stratus.errors import ConfigError, Unavailable
from stratus.serving.channels import TlsSettings, grpc_options, open_sync_channel
from stratus.serving.discovery import discover
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .conftest import MODELS


@pytest.fixture
def processes() -> Iterator[list[Launched]]:
    started: list[Launched] = []
    yield started
    for process in reversed(started):
        process.stop()


def status(router: str) -> dict[str, fpb.AgentStatus]:
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        fleet = fpb_grpc.FleetStub(channel).Status(fpb.FleetStatusRequest(include_agents=True), timeout=5)
    return {a.id: a for a in fleet.agents}


def agent(router: str, name: str, log_dir: Path, tier: str = "device", *extra: str) -> Launched:
    return launch(
        ["agent", "--tier", tier, "--models", str(MODELS), "--router", router, "--name", name, *extra],
        role=name,
        log_dir=log_dir,
    )


def infer_agent(router: str, x: np.ndarray) -> str:
    request = pb.ModelInferRequest(model_name="digits")
    codec.encode_request_inputs(request, {"input": x})
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
    return Served.read(response.parameters).agent


def test_agent_and_sdk_find_an_advertised_router_with_zeroconf(
    processes: list[Launched],
    tmp_path: Path,
    pki: dict[str, TlsSettings],
    digits,  # type: ignore[no-untyped-def]
) -> None:
    """zeroconf is opt-in and verified: the agent and the SDK dial what they find only over TLS
    to a certificate the fleet CA signed (an impostor's is refused, tests/integration/test_identities.py)."""
    server = pki["router"]
    router = launch(
        ["router", "--listen", "127.0.0.1:0", "--tls-cert", str(server.cert), "--tls-key", str(server.key)],
        role="router",
        log_dir=tmp_path,
    )
    processes.append(router)
    assert asyncio.run(discover(timeout_s=10.0)) == router.address
    verify = TlsSettings(ca=server.ca)
    processes.append(agent("auto", "found-by-zeroconf", tmp_path, "edge", "--tls-ca", str(server.ca)))
    with open_sync_channel(router.address, verify) as channel:
        stub = fpb_grpc.FleetStub(channel)
        started = time.monotonic()
        while not stub.Status(fpb.FleetStatusRequest(include_agents=True), timeout=5).agents:
            assert time.monotonic() - started < 30, "the agent did not find the router"
            time.sleep(0.1)
        (found,) = stub.Status(fpb.FleetStatusRequest(include_agents=True), timeout=5).agents
    assert (found.id, found.state) == ("found-by-zeroconf", fpb.AGENT_STATE_READY)
    # The SDK finds the router the same way; an unsure answer climbs through it to the edge.
    with pytest.raises(ConfigError, match="insecure=True"):
        Client(MODELS, router="auto", cache_dir=tmp_path / "sdk")  # not without a CA to verify it
    sdk = Client(MODELS, router="auto", cache_dir=tmp_path / "sdk", discover_timeout_s=10.0, tls=verify)
    with sdk as client:
        served = client.infer("digits", digits.held_out.x[:1], min_confidence=1.0)
    assert served.path == (Tier.DEVICE, Tier.EDGE) and served.agent == "found-by-zeroconf", served


def test_a_fleet_that_fails_to_start_leaves_no_process_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched: list[Launched] = []

    def recorded(*args: Any, **kwargs: Any) -> Launched:
        launched.append(launch(*args, **kwargs))
        return launched[-1]

    def never_ready(router: str, count: int) -> None:
        raise Unavailable(f"the fleet at {router} did not reach {count} ready agents")

    monkeypatch.setattr(demo, "launch", recorded)
    monkeypatch.setattr(demo, "wait_for_agents", never_ready)  # the last step of the start fails
    with pytest.raises(Unavailable, match="did not reach 1 ready agents"):
        demo.start_fleet(MODELS, tmp_path, devices=1, edges=0)
    assert [p.role for p in launched] == ["cloud", "router", "device-1"]
    assert all(p.process.poll() is not None for p in launched), [p.role for p in launched]


def test_drain_moves_work_off_an_agent_and_sigterm_exits_cleanly(
    processes: list[Launched],
    tmp_path: Path,
    digits,  # type: ignore[no-untyped-def]
) -> None:
    router = launch(["router", "--listen", "127.0.0.1:0", "--no-advertise"], role="router", log_dir=tmp_path)
    processes.append(router)
    first, second = agent(router.address, "dev-a", tmp_path), agent(router.address, "dev-b", tmp_path)
    processes += [first, second]
    wait_for_agents(router.address, 2)
    drained = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", "drain", "dev-a", "--router", router.address],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert drained.returncode == 0 and "dev-a is draining" in drained.stdout
    assert status(router.address)["dev-a"].state == fpb.AGENT_STATE_DRAINING
    served_by = {infer_agent(router.address, digits.held_out.x[i : i + 1]) for i in range(30)}
    assert served_by == {"dev-b"}
    second.process.send_signal(signal.SIGTERM)
    assert second.process.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while status(router.address)["dev-b"].state != fpb.AGENT_STATE_LEFT and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status(router.address)["dev-b"].state == fpb.AGENT_STATE_LEFT  # it drained first: left, not lost
    with pytest.raises(grpc.RpcError) as error:  # dev-a drains, dev-b left: no device agent remains
        infer_agent(router.address, digits.held_out.x[:1])
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_unknown_agent_cannot_be_drained(processes: list[Launched], tmp_path: Path) -> None:
    router = launch(["router", "--listen", "127.0.0.1:0", "--no-advertise"], role="router", log_dir=tmp_path)
    processes.append(router)
    result = subprocess.run(
        [sys.executable, "-m", "stratus.cli", "fleet", "drain", "nobody", "--router", router.address],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "no linked agent 'nobody'" in result.stderr
    assert (
        json.loads(
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "stratus.cli",
                    "fleet",
                    "status",
                    "--router",
                    router.address,
                    "--json",
                ],
                check=True,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
        )["cloud"]["state"]
        == "none"
    )


def test_sighup_leaves_the_cloud_gateway_and_the_router_serving(
    processes: list[Launched], tmp_path: Path
) -> None:
    """The cloud gateway reloads its models folder on SIGHUP (tests/integration/test_cloud_reload.py);
    the router has none and says it ignored the signal."""
    cloud = launch(
        ["cloud", "--listen", "127.0.0.1:0", "--models", str(MODELS)], role="cloud", log_dir=tmp_path
    )
    processes.append(cloud)
    router = launch(["router", "--listen", "127.0.0.1:0", "--no-advertise"], role="router", log_dir=tmp_path)
    processes.append(router)
    for server, said in ((cloud, "nothing changed"), (router, "SIGHUP ignored")):
        server.process.send_signal(signal.SIGHUP)
        started = time.monotonic()
        while said not in server.log():
            assert time.monotonic() - started < 10, server.log()[-2000:]
            time.sleep(0.05)
        assert server.process.poll() is None  # SIGHUP's default would have ended it
        with grpc.insecure_channel(server.address, options=grpc_options()) as channel:
            assert (
                pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=5).live
            )


def test_json_logs_say_stopping_and_stopped(processes: list[Launched], tmp_path: Path) -> None:
    router = launch(
        ["router", "--listen", "127.0.0.1:0", "--no-advertise", "--log-format", "json"],
        role="router",
        log_dir=tmp_path,
    )
    agent_process = launch(
        ["agent", "--tier", "device", "--models", str(MODELS), "--router", router.address, "--name", "j-1",
         "--log-format", "json"],
        role="j-1",
        log_dir=tmp_path,
    )  # fmt: skip
    wait_for_agents(router.address, 1)
    assert agent_process.stop() == 0 and router.stop() == 0
    for launched in (agent_process, router):
        records = [json.loads(line) for line in launched.log().splitlines() if line.startswith("{")]
        messages = [r["message"] for r in records]
        assert any(m.startswith("stopping") for m in messages) and messages[-1] == "stopped", messages[-5:]
        assert {"time", "level", "logger", "message"} <= set(records[0])
        assert "Traceback" not in launched.log() and "Task was destroyed" not in launched.log()
