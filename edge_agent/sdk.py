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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from stratus import codec
from stratus.channels import NO_TLS, TlsSettings, open_channel, open_sync_channel
from stratus.codec import Array
from stratus.discovery import discover_all
from stratus.errors import ConfigError, StratusError, Unavailable
from stratus.family_spec import FamilySpec, VariantSpec
from stratus.local import LocalModels
from stratus.local_loading import LocalSettings
from stratus.protocol import CONFIG_CURRENT, RequestOptions, Served, held_reason
from stratus.repository import ModelRepository
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb
from stratus.wire import inference_pb2_grpc as pb_grpc

log = logging.getLogger("stratus.sdk")

# After a failed attempt to reach the router, answer locally for this long before retrying.
RETRY_ROUTER_AFTER_S = 5.0
# How often the local variants are checked against what the router serves (at the next call).
FOLLOW_EVERY_S = 30.0
# The longest a check may wait for a router's answer (it runs inside a call when due).
FOLLOW_TIMEOUT_S = 1.0
TierArg = Tier | str | None
_UNREACHED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


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
        self._routers = _Routers(router, discover_timeout_s=discover_timeout_s, tls=tls)
        self.name = name
        self._follow_at = 0.0  # when the local variants are next checked against the router's
        self._missing: dict[str, str] = {}  # family -> a line the router serves that is not here

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
        if _status(exc)[0] in _UNREACHED:
            self._routers.failed(address)

    def _follow(self, config: pb.ModelConfig, *, family: str) -> None:
        tier = self._models.variant_for(family)[1].tier
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
            return _remote(call, self._send(call, call.request()))
        local = self._run_locally(call)
        unsure = local.unsure(call.options.min_confidence)
        settled = self._settled(call, local, unsure)
        if settled is not None:
            return settled
        response = self._send(call, _escalation(call, local, unsure=unsure))
        if isinstance(response, _Failed):
            return self._local_result(local, degraded=True)
        return _merge(local, unsure, response)

    def _send(self, call: _Call, request: pb.ModelInferRequest) -> pb.ModelInferResponse | _Failed:
        """The first router's answer, trying each in turn; what went wrong where none answered."""
        failed = _Failed(self._router)
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
            return _remote(call, await self._asend(call, call.request()))
        local = await self._models.executor.run(self._run_locally, call)
        unsure = local.unsure(call.options.min_confidence)
        settled = self._settled(call, local, unsure)
        if settled is not None:
            return settled
        response = await self._asend(call, _escalation(call, local, unsure=unsure))
        if isinstance(response, _Failed):
            return self._local_result(local, degraded=True)
        return _merge(local, unsure, response)

    async def _asend(self, call: _Call, request: pb.ModelInferRequest) -> pb.ModelInferResponse | _Failed:
        failed = _Failed(self._router)
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
    ) -> _Call:
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
        return _Call(
            model=model, family=family, variant=variant, inputs=inputs, options=options, started=time.perf_counter()
        )

    def _run_locally(self, call: _Call) -> _Local:
        started = time.perf_counter()
        outputs = self._models.runners[call.variant.name].infer(call.inputs)
        ms = (time.perf_counter() - started) * 1000.0
        scores = self._models.score(call.family, call.variant, outputs)
        return _Local(
            family=call.family, variant=call.variant, inputs=call.inputs, outputs=outputs, confidences=scores, ms=ms
        )

    def _settled(self, call: _Call, local: _Local, unsure: Array) -> InferResult | None:
        """The local answer where nothing climbs: every item sure, no router, or the caller's
        ``max_tier`` at this tier (then ``reason`` says how many items it kept, as the router's)."""
        max_tier = call.options.max_tier
        if unsure.size and max_tier <= local.variant.tier:
            reason = held_reason(max_tier, int(unsure.size), local.variant.tier)
            return self._local_result(local, degraded=False, reason=reason)
        if not unsure.size or self._router is None:
            return self._local_result(local, degraded=False)
        return None

    def _local_result(self, local: _Local, *, degraded: bool, reason: str = "") -> InferResult:
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

    def fresh(self) -> list[str]:
        """Routers known now that have not failed lately (no look-up, no waiting)."""
        now = time.monotonic()
        return [a for a in self._addresses if self._skip_until.get(a, 0.0) <= now]

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


@dataclass(frozen=True, kw_only=True)
class _Call:
    """One call, checked: the local variant that would answer, the inputs and the options."""

    model: str
    family: FamilySpec
    variant: VariantSpec
    inputs: dict[str, Array]
    options: RequestOptions
    started: float

    @property
    def local(self) -> bool:
        """Whether the caller's tiers allow the local variant's (a min_tier above it skips it)."""
        return self.options.min_tier <= self.variant.tier <= self.options.max_tier

    def remaining_ms(self) -> float | None:
        budget = self.options.budget_ms
        return None if budget is None else max(0.1, budget - (time.perf_counter() - self.started) * 1000.0)

    def timeout_s(self) -> float:
        remaining = self.remaining_ms()
        return 30.0 if remaining is None else max(0.001, remaining / 1000.0)

    def request(self, rows: Array | None = None, *, min_tier: Tier | None = None) -> pb.ModelInferRequest:
        """The call for the router: every item (or ``rows``), with what is left of its budget."""
        request = pb.ModelInferRequest(model_name=self.model)
        inputs = self.inputs if rows is None else {name: array[rows] for name, array in self.inputs.items()}
        codec.encode_request_inputs(request, inputs)
        options = self.options
        RequestOptions(
            budget_ms=self.remaining_ms(),
            min_confidence=options.min_confidence,
            max_tier=options.max_tier,
            min_tier=max(options.min_tier, min_tier or Tier.DEVICE),
        ).write(request.parameters)
        return request


class _Failed:
    """Why no router answered a call: each one's error, for the caller when nothing else can answer."""

    def __init__(self, router: str | None) -> None:
        self.router = router
        self.errors: list[str] = []

    def add(self, address: str, exc: grpc.RpcError) -> None:
        code, details = _status(exc)
        self.errors.append(f"{address}: {code.name if code is not None else type(exc).__name__}: {details}")

    def error(self, call: _Call) -> Unavailable:
        skipped = f"min_tier={call.options.min_tier.label} skips the {call.variant.tier.label} model here"
        if call.options.max_tier < call.variant.tier:
            skipped = f"max_tier={call.options.max_tier.label} is below the {call.variant.tier.label} model here"
        if self.router is None:
            return Unavailable(f"{skipped}, and this client has no router")
        return Unavailable(f"{skipped}, and no router answered ({'; '.join(self.errors) or 'none found'})")


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    """A failed call's code and details: the synchronous and the asyncio errors both have them
    (as methods), though only the first is typed a ``grpc.Call``."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    return (code() if callable(code) else None), (str(details()) if callable(details) else str(exc))


def _tier(value: TierArg, default: Tier) -> Tier:
    if value is None:
        return default
    return value if isinstance(value, Tier) else Tier.parse(value)


def _escalation(call: _Call, local: _Local, *, unsure: Array) -> pb.ModelInferRequest:
    """The unsure items only, for the tiers above this one."""
    return call.request(unsure, min_tier=Tier(min(local.variant.tier + 1, Tier.CLOUD)))


def _remote(call: _Call, response: pb.ModelInferResponse | _Failed) -> InferResult:
    """The router's answer for the whole call (the local model skipped); Unavailable when none came."""
    if isinstance(response, _Failed):
        raise response.error(call)
    served = Served.read(response.parameters)
    return InferResult(
        outputs=codec.decode_response_outputs(response),
        confidence=served.confidence,
        tier=served.tier,
        path=tuple(served.path),
        timings_ms=dict(served.timings_ms or {}),
        degraded=served.degraded,
        variant=served.variant,
        agent=served.agent,
        item_tiers=tuple(served.item_tiers),
        reason=served.reason,
    )


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
