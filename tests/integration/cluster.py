"""Small, purpose-built fleets for fault tests: start processes, always stop them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from stratus.convert import codec
from stratus.convert.parameters import Served, set_parameter
from stratus.devtools.launcher import Launched, launch
from stratus.serving.channels import NO_TLS, TlsSettings, open_sync_channel
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

MODELS = Path(__file__).resolve().parents[2] / "models"
QUIET = ["--log-level", "INFO"]


@dataclass
class Cluster:
    log_dir: Path
    # Every process started, in order: a role started again (a restart) is a new entry,
    # so the old process is still stopped at the end.
    processes: list[Launched] = field(default_factory=list)

    def start(
        self,
        role: str,
        args: list[str],
        *,
        module: str = "stratus.cli",
        env: dict[str, str] | None = None,
        python: list[str] | None = None,
    ) -> Launched:
        launched = launch(args, role=role, log_dir=self.log_dir, module=module, env=env, python=python)
        self.processes.append(launched)
        return launched

    def latest(self, role: str) -> Launched:
        return [p for p in self.processes if p.role == role][-1]

    def cloud(self, *extra: str, role: str = "cloud", env: dict[str, str] | None = None) -> Launched:
        args = ["cloud", "--listen", "127.0.0.1:0", "--models", str(MODELS), *QUIET, *extra]
        return self.start(role, args, env=env)

    def router(
        self, *extra: str, role: str = "router", listen: str = "127.0.0.1:0", env: dict[str, str] | None = None
    ) -> Launched:
        return self.start(role, ["router", "--listen", listen, "--no-advertise", *QUIET, *extra], env=env)

    def agent(
        self,
        name: str,
        router: str,
        *extra: str,
        tier: str = "device",
        env: dict[str, str] | None = None,
        python: list[str] | None = None,
        models: str = str(MODELS),
    ) -> Launched:
        """An agent; ``python`` and ``models`` run it elsewhere (an emulated aarch64 chroot)."""
        return self.start(
            name,
            [
                "agent",
                "--tier",
                tier,
                "--models",
                models,
                "--router",
                router,
                "--name",
                name,
                *QUIET,
                *extra,
            ],
            env=env,
            python=python,
        )

    def stop_all(self) -> None:
        """Stop every process, newest first, even when stopping one of them fails."""
        failures: list[str] = []
        for launched in reversed(self.processes):
            try:
                launched.stop(timeout=10)
            except Exception as exc:
                failures.append(f"{launched.role}: {exc!r}")
        assert not failures, f"could not stop: {failures}"


def fleet_status(router: str, tls: TlsSettings = NO_TLS) -> fpb.FleetStatus:
    with open_sync_channel(router, tls) as channel:
        return fpb_grpc.FleetStub(channel).Status(fpb.FleetStatusRequest(include_agents=True), timeout=5)


def states(router: str, tls: TlsSettings = NO_TLS) -> dict[str, int]:
    return {a.id: a.state for a in fleet_status(router, tls).agents}


def wait_until(predicate, timeout_s: float = 15.0, interval_s: float = 0.05) -> float:  # type: ignore[no-untyped-def]
    """Seconds it took for ``predicate()`` to hold; AssertionError after ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


def ready_count(router: str, tls: TlsSettings = NO_TLS) -> int:
    try:
        return sum(1 for state in states(router, tls).values() if state == fpb.AGENT_STATE_READY)
    except grpc.RpcError:
        return 0


def request(x: np.ndarray, model: str = "digits", **parameters: object) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model)
    codec.encode_request_inputs(message, {"input": x})
    for key, value in parameters.items():
        set_parameter(message.parameters, f"stratus.{key}", value)  # type: ignore[arg-type]
    return message


def infer(
    router: str, x: np.ndarray, *, timeout: float = 10.0, tls: TlsSettings = NO_TLS, **parameters: object
) -> tuple[pb.ModelInferResponse, Served]:
    with open_sync_channel(router, tls) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request(x, **parameters), timeout=timeout
        )
    return response, Served.read(response.parameters)
