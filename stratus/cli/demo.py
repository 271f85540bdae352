"""``stratus demo``: a whole fleet on loopback, end to end.

Starts a cloud gateway, a router, two device agents and an edge agent as real processes
on ports chosen at run time; sends the digits held-out split through the router (the
gateway path, as any gRPC client would), through the on-device SDK, and pinned to
``digits-large`` for comparison; then the defects held-out split through the router and
pinned to ``defects-large``; prints per path the share answered on each tier, accuracy
and p50/p99 latency, then the fleet status; and shuts everything down.

The SDK is handed in by ``stratus.cli.fleet_commands`` (it lives in ``edge_agent``, which ``stratus``
does not import).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np

from stratus.cli.fleet_views import ready_agents, status_json, status_table
from stratus.convert import codec
from stratus.convert.parameters import Served
from stratus.devtools.launcher import Launched, launch
from stratus.errors import Unavailable
from stratus.families.repository import ModelRepository
from stratus.serving.channels import grpc_options
from stratus.tiers import Tier
from stratus.tools.datasets import Split, dataset_for, digits_splits
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc


class SdkClient(Protocol):
    def infer(self, model: str, x: Any) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class PathReport:
    name: str
    requests: int
    tiers: dict[str, float]
    accuracy: float
    p50_ms: float
    p99_ms: float
    degraded: int

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "tiers": self.tiers,
            "accuracy": round(self.accuracy, 4),
            "latency_ms": {"p50": round(self.p50_ms, 3), "p99": round(self.p99_ms, 3)},
            "degraded": self.degraded,
        }


def summarize(
    name: str, tiers: Sequence[Tier], correct: Sequence[bool], latency_ms: Sequence[float], degraded: int = 0
) -> PathReport:
    counts = Counter(t.label for t in tiers)
    return PathReport(
        name=name,
        requests=len(tiers),
        tiers={t.label: counts.get(t.label, 0) / max(1, len(tiers)) for t in Tier},
        accuracy=float(np.mean(correct)) if correct else 0.0,
        p50_ms=float(np.percentile(latency_ms, 50)) if latency_ms else 0.0,
        p99_ms=float(np.percentile(latency_ms, 99)) if latency_ms else 0.0,
        degraded=degraded,
    )


@dataclass
class Fleet:
    """The demo's processes; ``stop`` ends them in reverse order and returns exit codes."""

    cloud: Launched
    router: Launched
    agents: list[Launched]

    def stop(self) -> dict[str, int]:
        codes = {a.role: a.stop() for a in self.agents}
        codes[self.router.role] = self.router.stop()
        codes[self.cloud.role] = self.cloud.stop()
        return codes


def launch_agent(
    models: Path, router: str, name: str, log_dir: Path, *flags: str, tier: str = "device"
) -> Launched:
    """One agent process linked to ``router`` (or ``A,B``), with its own extra flags."""
    return launch(
        [
            "agent",
            "--tier",
            tier,
            "--models",
            str(models),
            "--router",
            router,
            "--name",
            name,
            *flags,
            "--log-level",
            "WARNING",
        ],
        role=name,
        log_dir=log_dir,
    )


def start_fleet(
    models: Path, log_dir: Path, *, devices: int = 2, edges: int = 1, router_args: Sequence[str] = ()
) -> Fleet:
    """The started fleet; when any part fails to start, what had started is stopped first."""
    common = ["--log-level", "WARNING"]
    started: list[Launched] = []
    try:
        cloud = launch(
            ["cloud", "--listen", "127.0.0.1:0", "--models", str(models), *common],
            role="cloud",
            log_dir=log_dir,
        )
        started.append(cloud)
        args = ["router", "--listen", "127.0.0.1:0", "--cloud", cloud.address, "--no-advertise", *common]
        router = launch(
            [*args, *router_args],
            role="router",
            log_dir=log_dir,
        )
        started.append(router)
        for tier, count in (("device", devices), ("edge", edges)):
            for index in range(1, count + 1):
                name = f"{tier}-{index}"
                started.append(
                    launch_agent(models, router.address, name, log_dir, "--serve", "127.0.0.1:0", tier=tier)
                )
        wait_for_agents(router.address, devices + edges)
    except BaseException:
        for launched in reversed(started):
            launched.stop()
        raise
    return Fleet(cloud=cloud, router=router, agents=started[2:])


def wait_for_agents(router: str, count: int, timeout_s: float = 30.0) -> fpb.FleetStatus:
    """The router's status once ``count`` agents are ready. A router that is unreachable for
    a moment (just restarted, or a connection this process shares still backing off) is
    asked again until the deadline."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        stub = fpb_grpc.FleetStub(channel)
        while time.monotonic() < deadline:
            try:
                status = stub.Status(fpb.FleetStatusRequest(), timeout=5.0)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            else:
                if ready_agents(status) >= count and status.cloud.state in ("connected", "none"):
                    return status
            time.sleep(0.1)
    raise Unavailable(f"the fleet at {router} did not reach {count} ready agents in {timeout_s:g} s")


async def through_gateway(
    router: str,
    data: Split,
    *,
    model: str = "digits",
    concurrency: int = 8,
    parameters: dict[str, Any] | None = None,
    input_name: str = "input",
) -> PathReport:
    """Each held-out image as its own request, ``concurrency`` in flight, as a client would.
    ``input_name`` is the family's input tensor (``digits``: ``input``)."""
    tiers: list[Tier] = [Tier.DEVICE] * len(data)
    correct = [False] * len(data)
    latency = [0.0] * len(data)
    degraded = 0
    slots = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(router, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def one(index: int) -> None:
            nonlocal degraded
            request = pb.ModelInferRequest(model_name=model, id=str(index))
            codec.encode_request_inputs(request, {input_name: data.x[index : index + 1]})
            for key, value in (parameters or {}).items():
                _set(request, key, value)
            async with slots:
                started = time.perf_counter()
                response = await stub.ModelInfer(request, timeout=30.0)
                latency[index] = (time.perf_counter() - started) * 1000.0
            served = Served.read(response.parameters)
            tiers[index] = served.tier
            degraded += served.degraded
            correct[index] = (
                int(codec.decode_response_outputs(response)["probabilities"].argmax()) == data.y[index]
            )

        await asyncio.gather(*(one(i) for i in range(len(data))))
    return summarize(
        "gateway" if model == "digits" else f"gateway ({model})", tiers, correct, latency, degraded
    )


def _set(request: pb.ModelInferRequest, key: str, value: Any) -> None:
    from stratus.convert.parameters import set_parameter

    set_parameter(request.parameters, key, value)


def through_sdk(client: SdkClient, data: Split) -> PathReport:
    tiers, correct, latency, degraded = [], [], [], 0
    for index in range(len(data)):
        started = time.perf_counter()
        result = client.infer("digits", data.x[index : index + 1])
        latency.append((time.perf_counter() - started) * 1000.0)
        tiers.append(result.tier)
        degraded += bool(result.degraded)
        correct.append(int(result.outputs["probabilities"].argmax()) == data.y[index])
    return summarize("sdk", tiers, correct, latency, degraded)


def format_reports(reports: Sequence[PathReport]) -> str:
    header = f"{'path':<26}{'requests':>9}{'device':>9}{'edge':>9}{'cloud':>9}{'accuracy':>10}{'p50 ms':>9}{'p99 ms':>9}{'degraded':>10}"
    lines = [header, "-" * len(header)]
    for r in reports:
        lines.append(
            f"{r.name:<26}{r.requests:>9}{r.tiers['device']:>9.1%}{r.tiers['edge']:>9.1%}{r.tiers['cloud']:>9.1%}"
            f"{r.accuracy:>10.4f}{r.p50_ms:>9.2f}{r.p99_ms:>9.2f}{r.degraded:>10}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class DemoFamily:
    """A family the demo sends through the fleet: its held-out split, and its input's name."""

    name: str
    input_name: str
    held_out: Split


# Families sent through the fleet after digits (which also takes the SDK path), where the
# repository holds them: classifiers with bundled labels and a ``probabilities`` output.
OTHER_FAMILIES = ("defects",)


def other_families(models: Path) -> list[DemoFamily]:
    families = ModelRepository.load(models).families
    return [
        DemoFamily(name, families[name].inputs[0].name, dataset_for(name).held_out)
        for name in OTHER_FAMILIES
        if name in families
    ]


def _family_paths(router: str, family: DemoFamily) -> list[PathReport]:
    """The cascade, then the same split answered by the family's cloud variant alone."""
    through = [family.name, f"{family.name}-large"]
    return [
        asyncio.run(through_gateway(router, family.held_out, model=model, input_name=family.input_name))
        for model in through
    ]


# Held-out arith prompts the demo sends (each generates a few tokens on a tier or two).
ARITH_PROMPTS = 200


def through_generation(router: str, models: Path, count: int = ARITH_PROMPTS) -> PathReport | None:
    """The generative family's held-out prompts through the router (Open Inference Protocol,
    ``text_input``): graded exactly. The demo runs no vLLM: its cloud gateway generates with
    the large variant itself (OpenVINO GenAI, from its F16 GGUF file)."""
    families = ModelRepository.load(models).families
    if "arith" not in families:
        return None
    from stratus.convert.text import text_array
    from stratus.tools.arith import arith_splits, grade

    tiers, correct, latency, degraded = [], [], [], 0
    with grpc.insecure_channel(router, options=grpc_options()) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for prompt, _ in arith_splits().held_out[:count]:
            request = pb.ModelInferRequest(model_name="arith")
            codec.encode_request_inputs(request, {"text_input": text_array(prompt)})
            started = time.perf_counter()
            response = stub.ModelInfer(request, timeout=30.0)
            latency.append((time.perf_counter() - started) * 1000.0)
            served = Served.read(response.parameters)
            text = codec.decode_response_outputs(response)["text_output"][0]
            tiers.append(served.tier)
            correct.append(grade(prompt, bytes(text).decode()))
            degraded += served.degraded
    return summarize("gateway (arith)", tiers, correct, latency, degraded)


def run_demo(*, models: Path, as_json: bool, sdk_factory: Callable[[str], SdkClient]) -> int:
    data = digits_splits().held_out
    others = other_families(models)
    with tempfile.TemporaryDirectory(prefix="stratus-demo-") as scratch:
        log_dir = Path(scratch)
        if not as_json:
            print(
                "starting a cloud gateway, a router, two device agents and an edge agent on loopback ...",
                flush=True,
            )
        fleet = start_fleet(models, log_dir)
        try:
            reports = [asyncio.run(through_gateway(fleet.router.address, data))]
            client = sdk_factory(fleet.router.address)
            try:
                reports.append(through_sdk(client, data))
            finally:
                client.close()
            reports.append(asyncio.run(through_gateway(fleet.router.address, data, model="digits-large")))
            family_reports = {f.name: _family_paths(fleet.router.address, f) for f in others}
            generated = through_generation(fleet.router.address, models)
            with grpc.insecure_channel(fleet.router.address, options=grpc_options()) as channel:
                status = fpb_grpc.FleetStub(channel).Status(
                    fpb.FleetStatusRequest(include_agents=True), timeout=5.0
                )
        finally:
            codes = fleet.stop()
    if as_json:
        print(
            json.dumps(
                {
                    "paths": {r.name: r.to_json() for r in reports},
                    "families": {
                        name: {"paths": {r.name: r.to_json() for r in paths}}
                        for name, paths in family_reports.items()
                    },
                    "generative": {"arith": generated.to_json()} if generated else {},
                    "fleet": status_json(status),
                    "exit_codes": codes,
                },
                indent=2,
            )
        )
    else:
        print(f"\ndigits, held-out split: {len(data)} requests per path\n")
        print(format_reports(reports))
        for family in others:
            print(f"\n{family.name}, held-out split: {len(family.held_out)} requests per path\n")
            print(format_reports(family_reports[family.name]))
        if generated is not None:
            print(
                f"\narith (generative), held-out prompts: {generated.requests}; the cloud tier is the gateway's own "
                "arith-large (no vLLM in the demo)\n"
            )
            print(format_reports([generated]))
        print("\nfleet status\n")
        print(status_table(status))
        print(f"\nshut down cleanly: {all(code == 0 for code in codes.values())} (exit codes {codes})")
    return 0 if all(code == 0 for code in codes.values()) else 1
