"""The on-device SDK: answer in-process, escalate through the router only when needed.

``Client.infer("digits", x)`` runs the device variant in this process (no network hop)
and judges each item of the batch: items whose confidence is below the device threshold
(or ``min_confidence``), and only those, go to the router with ``stratus.min_tier=edge``,
so the fleet continues the climb above the device instead of repeating it; their
answers take their places among the local ones. With the router unreachable the local answer
comes back marked ``degraded``. ``max_tier`` and ``min_tier`` mean what the router's
``stratus.max_tier`` and ``stratus.min_tier`` do: ``max_tier="device"`` never leaves this
process (unsure items stay, with ``reason`` saying so), and a ``min_tier`` above the device skips
the local model and asks the router for the whole batch. ``router`` may name several routers
(``"A,B"``) or ``"auto"`` (every router zeroconf finds; opt-in, with a CA to verify it): a router
that fails a call is skipped for a while and the escalation goes to the next. ``await
client.ainfer(...)`` does the same on the caller's event loop, with the model run on the bounded
executor.

The local variant follows the router: on :meth:`Client.wait_ready` and then every
``FOLLOW_EVERY_S`` at the next call, the client reads the line the router serves each family's
device tier with (``stratus.current.device`` in its ModelConfig: a promoted rollout's candidate,
else the agents' current variant) and answers with that line too where its models folder has it;
where it has not, it keeps its own and logs why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import grpc

from edge_agent.sdk_calls import (
    Call,
    Failed,
    InferResult,
    LocalRun,
    asend,
    escalation,
    merged_answer,
    remote_answer,
    send,
)
from edge_agent.sdk_corrections import read_corrections
from edge_agent.sdk_follow import RouterFollower
from edge_agent.sdk_routers import Routers
from stratus.convert.parameters import RequestOptions, held_reason
from stratus.datatypes import Array
from stratus.errors import ConfigError
from stratus.execution.loading import LocalSettings
from stratus.execution.local_models import LocalModels
from stratus.execution.running import score
from stratus.families.repository import ModelRepository
from stratus.serving.channels import NO_TLS, TlsSettings
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

__all__ = ["Client", "InferResult"]

log = logging.getLogger("stratus.sdk")

TierArg = Tier | str | None


class Client:
    """Device variants in this process, and the routers to send what they are unsure of.

    Each family is answered here with the line the router serves its device tier with
    (:meth:`follow_router`: a promoted rollout's candidate, where this models folder holds
    it; otherwise the folder's own current variant). A rollout still in progress is the
    router's alone: its share never reaches the SDK."""

    def __init__(
        self,
        models: Path | str,
        router: str | None,
        *,
        variants: list[str] | None = None,
        concurrency: int = 1,
        cache_dir: Path | None = None,
        discover_timeout_s: float = 2.0,
        name: str = "sdk",
        tls: TlsSettings = NO_TLS,
        client_token: str = "",
        insecure: bool = False,
        precision: str | None = None,
    ) -> None:
        """Load the device variants of ``models`` (a models folder) in this process.

        ``router``: ``HOST:PORT[,...]``, ``"auto"`` (zeroconf: opt-in, and only with
        ``tls.ca`` to verify the router, or ``insecure``) or None (never escalate).
        ``client_token``: the router's client token, where it asks for one. ``precision``:
        ``"fp32"``, ``"fp16"`` or ``"int8"`` instead of the fastest this CPU runs within the
        family's tolerance (``STRATUS_CPU_FLAGS`` stands in for the CPU's flags, as for agents).
        Call :meth:`wait_ready` before the first request that must be able to escalate."""
        if router == "auto" and tls.ca is None and not insecure:
            raise ConfigError(
                'router="auto" would send inputs to whatever advertises _stratus._tcp: give '
                "tls=TlsSettings(ca=...) so the router's certificate is verified, or insecure=True"
            )
        self._tls = tls
        self._metadata = (("authorization", f"Bearer {client_token}"),) if client_token else ()
        settings = LocalSettings(
            tier=None if variants else Tier.DEVICE,
            variants=variants,
            concurrency=concurrency,
            executor_name="stratus-sdk-infer",
            cache_dir=cache_dir or LocalSettings().cache_dir,
            precision=precision,
        )
        self._models = LocalModels(ModelRepository.load(models), settings)
        self._router = router
        self._routers = Routers(router, discover_timeout_s=discover_timeout_s, tls=tls)
        self.name = name
        self._follower = RouterFollower(self._models, self._routers, self._metadata, enabled=router is not None)

    def wait_ready(self, timeout_s: float = 10.0) -> bool:
        """Whether a router answered ready within ``timeout_s`` (zeroconf looked up first with
        ``"auto"``); once one has, the local variants follow it (:meth:`follow_router`).
        Without it the first requests may find no router yet and come back device-only and
        degraded; with ``router=None`` there is nothing to wait for."""
        if self._router is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            self._routers.look_again()
            for address in self._routers.to_try():
                stub = pb_grpc.GRPCInferenceServiceStub(self._routers.channel(address))
                try:
                    left = max(0.1, deadline - time.monotonic())
                    if stub.ServerReady(
                        pb.ServerReadyRequest(), timeout=min(2.0, left), metadata=self._metadata
                    ).ready:
                        self._routers.answered(address)
                        self.follow_router()
                        return True
                except grpc.RpcError:
                    continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    # -- following the router's current variants (edge_agent/sdk_follow.py) ----------
    def follow_router(self) -> dict[str, str]:
        """Serve each family here with the line the router serves its tier with, where this
        models folder has it (see :class:`~edge_agent.sdk_follow.RouterFollower`); returns the
        lines now current here, by family."""
        return self._follower.follow()

    async def afollow_router(self) -> dict[str, str]:
        """:meth:`follow_router` on the caller's event loop."""
        return await self._follower.afollow()

    def current_lines(self) -> dict[str, str]:
        """The line (FP32 variant name) answering each family here now."""
        return self._follower.current_lines()

    # -- synchronous ------------------------------------------------------------------
    def infer(
        self,
        model: str,
        x: Array | Mapping[str, Array],
        *,
        budget_ms: float | None = None,
        min_confidence: float | None = None,
        max_tier: TierArg = None,
        min_tier: TierArg = None,
    ) -> InferResult:
        """Answer here, and send the unsure items up; ``max_tier`` and ``min_tier`` (a Tier or
        "device", "edge", "cloud") bound the tiers as the router's parameters of those names do."""
        if self._follower.due():
            self._follower.follow()
        call = self._call(
            model, x, budget_ms=budget_ms, min_confidence=min_confidence, max_tier=max_tier, min_tier=min_tier
        )
        if not call.local:
            return remote_answer(call, send(self._routers, self._metadata, call, call.request()))
        local = self._run_locally(call)
        unsure = local.unsure(call.options.min_confidence)
        settled = self._settled(call, local, unsure)
        if settled is not None:
            return settled
        response = send(self._routers, self._metadata, call, escalation(call, local, unsure=unsure))
        if isinstance(response, Failed):
            return self._local_result(local, degraded=True, reason=response.reason(local, unsure))
        return merged_answer(local, unsure, response)

    # -- asynchronous -----------------------------------------------------------------
    async def ainfer(
        self,
        model: str,
        x: Array | Mapping[str, Array],
        *,
        budget_ms: float | None = None,
        min_confidence: float | None = None,
        max_tier: TierArg = None,
        min_tier: TierArg = None,
    ) -> InferResult:
        """:meth:`infer` on the caller's event loop (the model runs on the bounded executor)."""
        if self._follower.due():
            await self._follower.afollow()
        call = self._call(
            model, x, budget_ms=budget_ms, min_confidence=min_confidence, max_tier=max_tier, min_tier=min_tier
        )
        if not call.local:
            return remote_answer(call, await asend(self._routers, self._metadata, call, call.request()))
        local = await self._models.executor.run(self._run_locally, call)
        unsure = local.unsure(call.options.min_confidence)
        settled = self._settled(call, local, unsure)
        if settled is not None:
            return settled
        response = await asend(self._routers, self._metadata, call, escalation(call, local, unsure=unsure))
        if isinstance(response, Failed):
            return self._local_result(local, degraded=True, reason=response.reason(local, unsure))
        return merged_answer(local, unsure, response)

    # -- shared -------------------------------------------------------------------------
    def _call(
        self,
        model: str,
        x: Array | Mapping[str, Array],
        *,
        budget_ms: float | None,
        min_confidence: float | None,
        max_tier: TierArg,
        min_tier: TierArg,
    ) -> Call:
        """The call checked before any hop: its options, and its inputs against the family."""
        options = RequestOptions(
            budget_ms=budget_ms,
            min_confidence=min_confidence,
            max_tier=_tier(max_tier, Tier.CLOUD),
            min_tier=_tier(min_tier, Tier.DEVICE),
        )
        family, variant = self._models.variant_for(model)
        inputs = dict(x) if isinstance(x, Mapping) else {family.inputs[0].name: x}
        family.check_inputs(inputs)
        return Call(
            model=model, family=family, variant=variant, inputs=inputs, options=options, started=time.perf_counter()
        )

    def _run_locally(self, call: Call) -> LocalRun:
        started = time.perf_counter()
        outputs = self._models.runners[call.variant.name].infer(call.inputs)
        ms = (time.perf_counter() - started) * 1000.0
        scores = score(call.family, call.variant, outputs)
        return LocalRun(
            family=call.family, variant=call.variant, inputs=call.inputs, outputs=outputs, confidences=scores, ms=ms,
            pushed=self._follower.threshold(call.family.name),
        )  # fmt: skip

    def _settled(self, call: Call, local: LocalRun, unsure: Array) -> InferResult | None:
        """The local answer where nothing climbs: every item sure, no router, or the caller's
        ``max_tier`` at this tier (then ``reason`` says how many items it kept, as the router's)."""
        max_tier = call.options.max_tier
        if unsure.size and max_tier <= local.variant.tier:
            reason = held_reason(max_tier, int(unsure.size), local.variant.tier)
            return self._local_result(local, degraded=False, reason=reason)
        if not unsure.size or self._router is None:
            return self._local_result(local, degraded=False)
        return None

    def _local_result(self, local: LocalRun, *, degraded: bool, reason: str = "") -> InferResult:
        tier = local.variant.tier
        return InferResult(
            outputs=local.outputs,
            confidence=local.confidence,
            tier=tier,
            path=(tier,),
            timings_ms={tier: local.ms},
            degraded=degraded,
            variant=local.variant.name,
            agent=self.name,
            item_tiers=(tier,) * len(local.confidences),
            reason=reason,
        )

    def corrections(
        self, *, family: str | None = None, since_unix: float = 0.0, follow: bool = True
    ) -> AsyncIterator[fpb.Correction]:
        """The provisional answers the cloud later disagreed with, from the routers this client
        knows (see :func:`~edge_agent.sdk_corrections.read_corrections`)."""
        return read_corrections(self._routers, self._metadata, family=family, since_unix=since_unix, follow=follow)

    def close(self) -> None:
        self._routers.close()
        self._models.close()

    async def aclose(self) -> None:
        await self._routers.aclose()
        self.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tier(value: TierArg, default: Tier) -> Tier:
    if value is None:
        return default
    return value if isinstance(value, Tier) else Tier.parse(value)


