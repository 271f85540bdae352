"""A router on every core (``stratus router --workers N``, issue 37 §2): real processes.

The workers share the listening port; an agent that dials it links to every worker at its
own address; clients' connections spread over the workers; a drain through one worker holds
on all (their site state is a private nats-server); a worker that dies is started again at
its address and its agents link back; SIGTERM stops every process the router started.
"""

from __future__ import annotations

import os
import re
import signal
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from stratus.devtools.launcher import Launched, free_port
from stratus.serving.channels import grpc_options
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

from .cluster import MODELS, Cluster, request, states, wait_until

LOCAL = "router-edge"


def worker_addresses(router: Launched) -> list[str]:
    found = re.search(r"with 2 workers: (\S+), (\S+)", router.log_path.read_text())
    assert found, router.log_path.read_text()[-2000:]
    return [found.group(1), found.group(2)]


def state_at(address: str, agent: str) -> int | None:
    """``agent``'s state at one worker; None while that worker is not answering (restarting)."""
    try:
        return states(address).get(agent)
    except grpc.RpcError:
        return None


def answered_by(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stats = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            pb.ModelStatisticsRequest(name="digits")
        )
    return sum(model.inference_stats.success.count for model in stats.model_stats)


def pids_with(*words: str) -> list[int]:
    """Processes whose command line holds each of ``words`` as an argument."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                arguments = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if all(word in arguments for word in words):
                found.append(int(entry.name))
    return found


def worker_pid(address: str) -> int:
    (pid,) = pids_with("--worker-address", address)
    return pid


def ask_over_connections(shared: str, rows: np.ndarray, connections: int) -> list[int]:
    """Each row once, over ``connections`` connections of their own: the predicted classes."""
    options = [*grpc_options(), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(shared, options=options) for _ in range(connections)]
    try:
        stubs = [pb_grpc.GRPCInferenceServiceStub(channel) for channel in channels]
        predicted = []
        for index, row in enumerate(rows):
            response = stubs[index % connections].ModelInfer(request(row[None, :]), timeout=10)
            predicted.append(int(np.frombuffer(response.raw_output_contents[0], np.float32).argmax()))
        return predicted
    finally:
        for channel in channels:
            channel.close()


def test_workers_share_the_port_the_agents_and_the_site_state_and_come_back(tmp_path: Path, digits) -> None:  # type: ignore[no-untyped-def]
    cluster = Cluster(tmp_path)
    try:
        http, openai = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        router = cluster.router(
            "--models", str(MODELS), "--local-tier", "edge", "--local-name", LOCAL, "--workers", "2",
            "--http", http, "--openai", openai, "--log-level", "INFO",
        )  # fmt: skip
        first, second = workers = worker_addresses(router)
        assert router.address not in workers
        cluster.agent("dev-1", router.address)  # the shared port: its door to both workers
        for worker in workers:
            wait_until(lambda w=worker: state_at(w, "dev-1") == fpb.AGENT_STATE_READY, timeout_s=60)

        for front in (f"http://{http}/v2/health/live", f"http://{openai}/health"):  # the HTTP fronts shared too
            with urllib.request.urlopen(front, timeout=10) as answer:
                assert answer.status == 200, front

        rows, labels = digits.held_out.x[:64], digits.held_out.y[:64]
        predicted = ask_over_connections(router.address, rows, connections=16)
        assert np.mean(np.array(predicted) == labels) > 0.9
        served = [answered_by(worker) for worker in workers]
        assert sum(served) == len(rows) and min(served) > 0, served  # the connections spread

        with grpc.insecure_channel(first) as channel:
            fpb_grpc.FleetStub(channel).Drain(fpb.DrainRequest(agent_id="dev-1"), timeout=10)
        wait_until(lambda: state_at(second, "dev-1") == fpb.AGENT_STATE_DRAINING, timeout_s=15)

        os.kill(worker_pid(second), signal.SIGKILL)
        wait_until(lambda: "router worker 1 exited" in router.log_path.read_text(), timeout_s=15)
        # started again at its own address, the agent linked back, and still drained site-wide
        wait_until(lambda: state_at(second, "dev-1") == fpb.AGENT_STATE_DRAINING, timeout_s=60)
        assert state_at(second, LOCAL) == fpb.AGENT_STATE_READY
        assert ask_over_connections(router.address, rows[:16], connections=4) == predicted[:16]

        nats_port = re.search(r"private nats-server on 127.0.0.1:(\d+)", router.log_path.read_text())
        assert nats_port, "the workers' site state: a private nats-server"
        pids = [worker_pid(worker) for worker in workers] + pids_with("-p", nats_port.group(1))
        assert len(pids) == 3
        assert router.stop(timeout=60) == 0
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "a process outlived its router"
    finally:
        cluster.stop_all()
