"""The on-device SDK: answer in-process, escalate through the router only when needed.

``Client.infer("digits", x)`` runs the device variant in this process (no network hop)
and judges each item of the batch: items whose confidence is below the device threshold
(or ``min_confidence``), and only those, go to the router with ``stratus.min_tier=edge``,
so the fleet continues the climb above the device instead of repeating it; their
answers take their places among the local ones. With the router unreachable the local answer
comes back marked ``degraded``. ``router`` may name several routers (``"A,B"``) or
``"auto"`` (every router zeroconf finds; opt-in, with a CA to verify it): a router that fails a call is skipped for a
while and the escalation goes to the next. ``await client.ainfer(...)`` does the same on the
caller's event loop, with the model run on the bounded executor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from stratus import codec
from stratus.codec import Array
from stratus.discovery import discover_all
from stratus.errors import ConfigError, StratusError
from stratus.local import LocalModels, LocalSettings
from stratus.protocol import RequestOptions, Served
from stratus.repository import FamilySpec, ModelRepository, VariantSpec
from stratus.serving import NO_TLS, TlsSettings, open_channel, open_sync_channel
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

# After a failed attempt to reach the router, answer locally for this long before retrying.
RETRY_ROUTER_AFTER_S = 5.0


@dataclass(frozen=True, kw_only=True)
class InferResult:
    """One answer: ``outputs`` by name, ``confidence`` (the least sure item's), ``tier`` (the
    highest tier that answered an item), ``path`` (the tiers tried, in order), ``item_tiers``
    (the tier of each item), ``degraded`` (an unsure item came back from the device because
    no router answered), and the ``variant`` and ``agent`` of the highest tier's answer."""

    outputs: dict[str, Array]
    confidence: float
    tier: Tier
    path: tuple[Tier, ...]
    timings_ms: dict[Tier, float] = field(default_factory=dict)
    degraded: bool = False
    variant: str = ""
    agent: str = ""
    item_tiers: tuple[Tier, ...] = ()  # the tier that answered each item, in order
    reason: str = ""  # why unsure items stayed where they were answered (stratus.reason)


@dataclass(frozen=True, kw_only=True)
class _Local:
    family: FamilySpec
    variant: VariantSpec
    inputs: dict[str, Array]
    outputs: dict[str, Array]
    confidences: Array  # one per item
    ms: float

    @property
    def confidence(self) -> float:
        return float(self.confidences.min()) if self.confidences.size else 1.0

    def unsure(self, min_confidence: float | None) -> Array:
        """Indices of the items this tier's answer does not settle."""
        threshold = (
            min_confidence if min_confidence is not None else self.family.thresholds.get(self.variant.tier)
        )
        if threshold is None:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self.confidences < threshold)


class Client:
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
        self._routers = _Routers(router, discover_timeout_s=discover_timeout_s, tls=tls)
        self.name = name

    def wait_ready(self, timeout_s: float = 10.0) -> bool:
        """Whether a router answered ready within ``timeout_s`` (zeroconf looked up first with
        ``"auto"``). Without it the first requests may find no router yet and come back
        device-only and degraded; with ``router=None`` there is nothing to wait for."""
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
                        return True
                except grpc.RpcError:
                    continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    # -- synchronous ------------------------------------------------------------------
    def infer(
        self,
        model: str,
        x: Array | Mapping[str, Array],
        *,
        budget_ms: float | None = None,
        min_confidence: float | None = None,
    ) -> InferResult:
        started = time.perf_counter()
        local = self._run_locally(model, x)
        unsure = local.unsure(min_confidence)
        if not unsure.size or self._router is None:
            return self._local_result(local, degraded=False)
        request = _escalation(
            model, local, unsure=unsure, budget_ms=budget_ms, min_confidence=min_confidence, started=started
        )
        for address in self._routers.to_try():
            stub = pb_grpc.GRPCInferenceServiceStub(self._routers.channel(address))
            try:
                response = stub.ModelInfer(
                    request, timeout=_timeout(budget_ms, started), metadata=self._metadata
                )
            except grpc.RpcError:
                self._routers.failed(address)
                continue
            self._routers.answered(address)
            return _merge(local, unsure, response)
        return self._local_result(local, degraded=True)

    # -- asynchronous -----------------------------------------------------------------
    async def ainfer(
        self,
        model: str,
        x: Array | Mapping[str, Array],
        *,
        budget_ms: float | None = None,
        min_confidence: float | None = None,
    ) -> InferResult:
        started = time.perf_counter()
        local = await self._models.executor.run(self._run_locally, model, x)
        unsure = local.unsure(min_confidence)
        if not unsure.size or self._router is None:
            return self._local_result(local, degraded=False)
        request = _escalation(
            model, local, unsure=unsure, budget_ms=budget_ms, min_confidence=min_confidence, started=started
        )
        for address in await self._routers.ato_try():
            stub = pb_grpc.GRPCInferenceServiceStub(self._routers.achannel(address))
            try:
                response = await stub.ModelInfer(
                    request, timeout=_timeout(budget_ms, started), metadata=self._metadata
                )
            except grpc.aio.AioRpcError:
                self._routers.failed(address)
                continue
            self._routers.answered(address)
            return _merge(local, unsure, response)
        return self._local_result(local, degraded=True)

    # -- shared -------------------------------------------------------------------------
    def _run_locally(self, model: str, x: Array | Mapping[str, Array]) -> _Local:
        family, variant = self._models.variant_for(model)
        inputs = dict(x) if isinstance(x, Mapping) else {family.inputs[0].name: x}
        family.check_inputs(inputs)
        started = time.perf_counter()
        outputs = self._models.runners[variant.name].infer(inputs)
        ms = (time.perf_counter() - started) * 1000.0
        scores = self._models.score(family, variant, outputs)
        return _Local(
            family=family, variant=variant, inputs=inputs, outputs=outputs, confidences=scores, ms=ms
        )

    def _local_result(self, local: _Local, *, degraded: bool) -> InferResult:
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
        )

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


class _Routers:
    """The routers a client escalates to: the last that answered first, then the others.

    A router that fails a call goes to the back of the line for RETRY_ROUTER_AFTER_S; the
    call goes on to the next (an inference can be asked again), and only when none answers
    does the client return its own answer marked degraded. ``auto`` finds every router
    with zeroconf.
    """

    def __init__(self, router: str | None, *, discover_timeout_s: float, tls: TlsSettings) -> None:
        self._auto = router == "auto"
        self._addresses = (
            [] if router in (None, "auto") else [a.strip() for a in router.split(",") if a.strip()]
        )
        self._discover_timeout_s = discover_timeout_s
        self._tls = tls
        self._skip_until: dict[str, float] = {}
        self._looked_until = 0.0
        self._channels: dict[str, grpc.Channel] = {}
        self._achannels: dict[str, grpc.aio.Channel] = {}

    def _ordered(self) -> list[str]:
        """Routers that have not failed lately first, then those that have, oldest failure first:
        a recent failure moves a router back, it never stops it from being tried at all."""
        now = time.monotonic()
        fresh = [a for a in self._addresses if self._skip_until.get(a, 0.0) <= now]
        stale = sorted((a for a in self._addresses if a not in fresh), key=lambda a: self._skip_until[a])
        return fresh + stale

    def to_try(self) -> list[str]:
        if self._auto and not self._ordered() and time.monotonic() >= self._looked_until:
            self._found(asyncio.run(self._discover()))
        return self._ordered()

    async def ato_try(self) -> list[str]:
        if self._auto and not self._ordered() and time.monotonic() >= self._looked_until:
            self._found(await self._discover())
        return self._ordered()

    async def _discover(self) -> list[str]:
        try:
            return await discover_all(timeout_s=self._discover_timeout_s)
        except StratusError:
            return []

    def _found(self, addresses: list[str]) -> None:
        self._looked_until = time.monotonic() + RETRY_ROUTER_AFTER_S
        self._addresses = addresses
        self._skip_until.clear()

    def look_again(self) -> None:
        """With ``auto`` and no router found yet, browse again at the next call."""
        if self._auto and not self._addresses:
            self._looked_until = 0.0

    def failed(self, address: str) -> None:
        self._skip_until[address] = time.monotonic() + RETRY_ROUTER_AFTER_S

    def answered(self, address: str) -> None:
        if self._addresses and self._addresses[0] != address:
            self._addresses.remove(address)
            self._addresses.insert(0, address)

    def channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = open_sync_channel(address, self._tls)
        return self._channels[address]

    def achannel(self, address: str) -> grpc.aio.Channel:
        if address not in self._achannels:
            self._achannels[address] = open_channel(address, self._tls)
        return self._achannels[address]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    async def aclose(self) -> None:
        for channel in self._achannels.values():
            await channel.close()
        self._achannels.clear()


def _escalation(
    model: str,
    local: _Local,
    *,
    unsure: Array,
    budget_ms: float | None,
    min_confidence: float | None,
    started: float,
) -> pb.ModelInferRequest:
    """The unsure items only, for the tiers above this one."""
    request = pb.ModelInferRequest(model_name=model)
    codec.encode_request_inputs(request, {name: array[unsure] for name, array in local.inputs.items()})
    remaining = None if budget_ms is None else max(0.1, budget_ms - (time.perf_counter() - started) * 1000.0)
    RequestOptions(
        budget_ms=remaining,
        min_confidence=min_confidence,
        min_tier=Tier(min(local.variant.tier + 1, Tier.CLOUD)),
    ).write(request.parameters)
    return request


def _timeout(budget_ms: float | None, started: float) -> float:
    if budget_ms is None:
        return 30.0
    return max(0.001, budget_ms / 1000.0 - (time.perf_counter() - started))


def _merge(local: _Local, unsure: Array, response: pb.ModelInferResponse) -> InferResult:
    """The router's answers for the unsure items, each in its place among the local ones."""
    served = Served.read(response.parameters)
    remote = codec.decode_response_outputs(response)
    outputs = {}
    for name, array in local.outputs.items():
        merged = array.copy()
        merged[unsure] = remote[name]
        outputs[name] = merged
    tiers = [local.variant.tier] * len(local.confidences)
    remote_tiers = served.item_tiers or (served.tier,) * len(unsure)
    for index, tier in zip(unsure.tolist(), remote_tiers, strict=True):
        tiers[index] = tier
    settled = np.delete(local.confidences, unsure)
    timings = {local.variant.tier: local.ms, **(served.timings_ms or {})}
    return InferResult(
        outputs=outputs,
        confidence=min(served.confidence, float(settled.min()) if settled.size else 1.0),
        tier=max(tiers),
        path=(local.variant.tier, *served.path),
        timings_ms=timings,
        degraded=served.degraded,
        variant=served.variant,
        agent=served.agent,
        item_tiers=tuple(tiers),
        reason=served.reason,
    )
