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

import asyncio
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
    escalation,
    merged_answer,
    remote_answer,
)
from edge_agent.sdk_routers import Routers, status_of
from stratus.convert.parameters import CONFIG_CURRENT, CONFIG_THRESHOLD, RequestOptions, held_reason
from stratus.datatypes import Array
from stratus.errors import ConfigError
from stratus.execution.loading import LocalSettings
from stratus.execution.models import LocalModels
from stratus.execution.running import score
from stratus.families.confidence import threshold_problem
from stratus.families.repository import ModelRepository
from stratus.serving.channels import NO_TLS, TlsSettings
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import fleet_pb2_grpc as fpb_grpc
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

__all__ = ["Client", "InferResult"]

log = logging.getLogger("stratus.sdk")

# How often the local variants are checked against what the router serves (at the next call).
FOLLOW_EVERY_S = 30.0
# The longest a check may wait for a router's answer (it runs inside a call when due).
FOLLOW_TIMEOUT_S = 1.0
TierArg = Tier | str | None
MAX_SEEN = 10_000  # corrections remembered to give none twice after moving to another router
_UNREACHED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


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
        self._follow_at = 0.0  # when the local variants are next checked against the router's
        self._missing: dict[str, str] = {}  # family -> a line the router serves that is not here
        self._thresholds: dict[str, float] = {}  # family -> the router's threshold for its tier here

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

    # -- following the router's current variants -------------------------------------
    def follow_router(self) -> dict[str, str]:
        """Serve each family here with the line the router serves its tier with by default
        (a promoted rollout's candidate, else its agents' current variant), where this
        models folder has that line; returns the lines now current here, by family.

        Called by :meth:`wait_ready`, and by a call when the last look is ``FOLLOW_EVERY_S``
        old; a router that does not say (or none reachable) changes nothing."""
        self._follow_at = time.monotonic() + FOLLOW_EVERY_S
        for family in self._families():
            for address in self._routers.fresh():
                stub = pb_grpc.GRPCInferenceServiceStub(self._routers.channel(address))
                try:
                    config = stub.ModelConfig(
                        pb.ModelConfigRequest(name=family), timeout=FOLLOW_TIMEOUT_S, metadata=self._metadata
                    ).config
                except grpc.RpcError as exc:
                    self._unanswered(address, exc)
                    continue
                self._follow(config, family=family)
                break
        return self.current_lines()

    async def afollow_router(self) -> dict[str, str]:
        """:meth:`follow_router` on the caller's event loop."""
        self._follow_at = time.monotonic() + FOLLOW_EVERY_S
        for family in self._families():
            for address in self._routers.fresh():
                stub = pb_grpc.GRPCInferenceServiceStub(self._routers.achannel(address))
                try:
                    answer = await stub.ModelConfig(
                        pb.ModelConfigRequest(name=family), timeout=FOLLOW_TIMEOUT_S, metadata=self._metadata
                    )
                except grpc.aio.AioRpcError as exc:
                    self._unanswered(address, exc)
                    continue
                self._follow(answer.config, family=family)
                break
        return self.current_lines()

    def current_lines(self) -> dict[str, str]:
        """The line (FP32 variant name) answering each family here now."""
        lines = {}
        for family in self._families():
            variant = self._models.variant_for(family)[1]
            lines[family] = variant.parent or variant.name
        return lines

    def _families(self) -> list[str]:
        """The families answered here (those with a current variant loaded)."""
        models = self._models
        return sorted({models.variants[name].family for name in models.current})

    def _unanswered(self, address: str, exc: grpc.RpcError) -> None:
        """A router that cannot be reached is skipped for a while (the next family's look
        and the next escalation go elsewhere); one that answered an error was reached."""
        if status_of(exc)[0] in _UNREACHED:
            self._routers.failed(address)

    def _follow(self, config: pb.ModelConfig, *, family: str) -> None:
        tier = self._models.variant_for(family)[1].tier
        self._follow_threshold(config, family=family, tier=tier)
        wanted = config.parameters.get(CONFIG_CURRENT + tier.label)
        if wanted is None or not wanted.string_value or wanted.string_value == self.current_lines()[family]:
            return
        line = wanted.string_value
        if self._models.follow(family, tier, line):
            log.info("%s: answering with %s here, as the router serves the %s tier", family, line, tier.label)
        elif self._missing.get(family) != line:  # said once per line
            self._missing[family] = line
            log.warning(
                "%s: the router serves the %s tier with %s, which %s does not hold: answering with %s here",
                family, tier.label, line, self._models.repository.root, self.current_lines()[family],
            )  # fmt: skip

    def _follow_threshold(self, config: pb.ModelConfig, *, family: str, tier: Tier) -> None:
        """Judge this tier's answers by the threshold the router uses for it (a fleet-wide push
        wins over this folder's family.toml), where the router says one."""
        said = config.parameters.get(CONFIG_THRESHOLD + tier.label)
        try:
            value = float(said.string_value) if said is not None else None
        except ValueError:
            value = None
        if value is None or threshold_problem(value) is not None:  # PASS_ALL is one: every answer climbs
            self._thresholds.pop(family, None)
            return
        if self._thresholds.get(family) != value:
            log.info("%s: judging %s answers here by the router's threshold %g", family, tier.label, value)
        self._thresholds[family] = value

    def _follow_due(self) -> bool:
        return self._router is not None and time.monotonic() >= self._follow_at

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
        if self._follow_due():
            self.follow_router()
        call = self._call(
            model, x, budget_ms=budget_ms, min_confidence=min_confidence, max_tier=max_tier, min_tier=min_tier
        )
        if not call.local:
            return remote_answer(call, self._send(call, call.request()))
        local = self._run_locally(call)
        unsure = local.unsure(call.options.min_confidence)
        settled = self._settled(call, local, unsure)
        if settled is not None:
            return settled
        response = self._send(call, escalation(call, local, unsure=unsure))
        if isinstance(response, Failed):
            return self._local_result(local, degraded=True, reason=response.reason(local, unsure))
        return merged_answer(local, unsure, response)

    def _send(self, call: Call, request: pb.ModelInferRequest) -> pb.ModelInferResponse | Failed:
        """The first router's answer, trying each in turn; what went wrong where none answered."""
        failed = Failed(self._router)
        for address in self._routers.to_try():
            stub = pb_grpc.GRPCInferenceServiceStub(self._routers.channel(address))
            try:
                response: pb.ModelInferResponse = stub.ModelInfer(
                    request, timeout=call.timeout_s(), metadata=self._metadata
                )
            except grpc.RpcError as exc:
                self._routers.failed(address)
                failed.add(address, exc)
                continue
            self._routers.answered(address)
            return response
        return failed

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
        if self._follow_due():
            await self.afollow_router()
        call = self._call(
            model, x, budget_ms=budget_ms, min_confidence=min_confidence, max_tier=max_tier, min_tier=min_tier
        )
        if not call.local:
            return remote_answer(call, await self._asend(call, call.request()))
        local = await self._models.executor.run(self._run_locally, call)
        unsure = local.unsure(call.options.min_confidence)
        settled = self._settled(call, local, unsure)
        if settled is not None:
            return settled
        response = await self._asend(call, escalation(call, local, unsure=unsure))
        if isinstance(response, Failed):
            return self._local_result(local, degraded=True, reason=response.reason(local, unsure))
        return merged_answer(local, unsure, response)

    async def _asend(self, call: Call, request: pb.ModelInferRequest) -> pb.ModelInferResponse | Failed:
        failed = Failed(self._router)
        for address in await self._routers.ato_try():
            stub = pb_grpc.GRPCInferenceServiceStub(self._routers.achannel(address))
            try:
                response: pb.ModelInferResponse = await stub.ModelInfer(
                    request, timeout=call.timeout_s(), metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                self._routers.failed(address)
                failed.add(address, exc)
                continue
            self._routers.answered(address)
            return response
        return failed

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
            pushed=self._thresholds.get(call.family.name),
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

    async def corrections(
        self, *, family: str | None = None, since_unix: float = 0.0, follow: bool = True
    ) -> AsyncIterator[fpb.Correction]:
        """The provisional answers the cloud later disagreed with (``stratus.provisional`` answers
        name their ``stratus.request_id``; each correction names it and the item): those judged
        since ``since_unix``, then, with ``follow``, each new one as the router makes it. A router
        lost midway is left for the next one the SDK knows, from the last correction seen on
        (none is given twice). Corrections are kept by the router that answered provisionally."""
        seen: set[tuple[str, int, float]] = set()
        since = since_unix
        while True:
            addresses = await self._routers.ato_try()
            if not addresses:
                raise ConfigError("no router to read corrections from (the SDK was made with router=None)")
            for address in addresses:
                stub = fpb_grpc.FleetStub(self._routers.achannel(address))
                request = fpb.CorrectionsRequest(family=family or "", since_unix=since, follow=follow)
                try:
                    async for correction in stub.Corrections(request, metadata=self._metadata or None):
                        key = (correction.request_id, correction.item, correction.judged_unix)
                        if key not in seen:
                            seen.add(key)
                            since = max(since, correction.judged_unix)
                            if len(seen) > MAX_SEEN:  # only those at the boundary can come again
                                seen = {k for k in seen if k[2] >= since}
                            yield correction
                    if not follow:
                        return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in _UNREACHED:
                        raise
                    self._routers.failed(address)
            await asyncio.sleep(FOLLOW_TIMEOUT_S)

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


