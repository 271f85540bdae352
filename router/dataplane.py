"""The router's data plane: the tiered cascade behind the inference service.

A request naming a family starts on the lowest tier that can answer inside its budget
and climbs while the answer's confidence is below that tier's threshold and a higher
tier still fits the remaining budget. A request naming a variant runs exactly there. A
failed or lost agent means retry elsewhere on the same tier or climb; when nothing above
can answer in time, the best answer so far is returned marked ``stratus.degraded``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from router.cloud import CloudLink
from router.policy import Attempt, CloudView, FleetSnapshot, NoTarget, Target, accepts, choose, top_tier
from router.registry import FleetRegistry
from stratus import codec
from stratus.errors import DeadlineExceeded, InvalidInput, NotFound, Overloaded, StratusError, Unavailable
from stratus.local import model_config
from stratus.protocol import CONFIDENCE, PREFIX, VARIANT, RequestOptions, Served, parameter_value
from stratus.repository import FamilySpec, TensorSpec
from stratus.serving import DataPlane
from stratus.status import error_from_status
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

log = logging.getLogger("stratus.router")

# Errors after which another agent (or tier) may still succeed, within what budget is left.
_RETRYABLE = (Unavailable, Overloaded, DeadlineExceeded)


@dataclass(frozen=True, kw_only=True)
class Answer:
    response: pb.ModelInferResponse
    tier: Tier
    agent: str
    variant: str
    confidence: float
    elapsed_ms: float


class RouterDataPlane(DataPlane):
    def __init__(
        self,
        registry: FleetRegistry,
        cloud: CloudLink | None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        fail_without_cloud: bool = False,
        max_requests: int = 4096,
    ) -> None:
        self.max_requests = max_requests
        self.active = 0
        self.registry = registry
        self.cloud = cloud
        self.fail_without_cloud = fail_without_cloud
        self._rng = rng or random.Random()
        self._clock = clock
        self._specs: dict[str, tuple[fpb.FamilyInfo, FamilySpec]] = {}

    # -- health and metadata ---------------------------------------------------------
    def ready(self) -> bool:
        """Ready while something can serve: a ready agent, or a cloud that takes calls."""
        return self.registry.index.any_ready() or self._cloud_takes_calls()

    def model_ready(self, name: str) -> bool:
        served_by_cloud = (
            self._cloud_takes_calls() and self.cloud is not None and self.cloud.models.get(name, False)
        )
        return self.registry.index.serves(name) or served_by_cloud

    def _cloud_takes_calls(self) -> bool:
        return self.cloud is not None and self.cloud.available

    def model_names(self) -> list[str]:
        names = {*self.registry.families, *self.registry.index.models()}
        if self.cloud is not None:
            names |= {name for name, ok in self.cloud.models.items() if ok}
        return sorted(names)

    def _family_of(self, name: str) -> tuple[str, str | None]:
        """(family, pinned variant or None); NotFound when no agent nor the cloud knows it."""
        if name in self.registry.families:
            return name, None
        family = self.registry.index.family_of(name)
        if family is not None:
            return family, name
        if self.cloud is not None and self.cloud.models.get(name):
            return name, None
        known = sorted({*self.registry.families, *self.registry.index.models()})
        raise NotFound(f"unknown model '{name}'; the fleet serves {known}")

    def _spec(self, family: str) -> FamilySpec | None:
        """The family as agents described it; rebuilt only when an agent's Hello changes it."""
        info = self.registry.family(family)
        if info is None:
            return None
        cached = self._specs.get(family)
        if cached is None or cached[0] is not info:
            cached = (info, family_spec(info))
            self._specs[family] = cached
        return cached[1]

    def model_metadata(self, name: str) -> pb.ModelMetadataResponse:
        family, _ = self._family_of(name)
        info = self.registry.family(family)
        variants = self.registry.index.variants_of(family)
        response = pb.ModelMetadataResponse(name=name, versions=variants, platform="stratus")
        if info is not None:
            response.inputs.extend(info.inputs)
            response.outputs.extend(info.outputs)
        return response

    def model_config(self, name: str) -> pb.ModelConfig:
        family, _ = self._family_of(name)
        spec = self._spec(family)
        if spec is None:
            return pb.ModelConfig(name=name, platform="stratus", backend="stratus")
        return model_config(spec, name, "stratus")

    # -- inference ----------------------------------------------------------------------
    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        """Admit (or refuse, past ``max_requests``), check, then climb the tiers."""
        if self.active >= self.max_requests:
            raise Overloaded(f"router request queue is full: {self.max_requests} requests in flight")
        self.active += 1
        try:
            return await self._infer(request, timeout_s)
        finally:
            self.active -= 1

    async def _infer(self, request: pb.ModelInferRequest, timeout_s: float | None) -> pb.ModelInferResponse:
        started = self._clock()
        options = RequestOptions.from_parameters(request.parameters)
        family, pinned = self._family_of(request.model_name)
        self._check_inputs(request, family)
        budget_ms = _budget(options.budget_ms, timeout_s)
        cascade = _Cascade(
            self, request, family=family, pinned=pinned, options=options, budget_ms=budget_ms, started=started
        )
        return await cascade.run()

    def _check_inputs(self, request: pb.ModelInferRequest, family: str) -> None:
        spec = self._spec(family)
        inputs = codec.decode_request_inputs(request)
        if spec is not None:
            spec.check_inputs(inputs)
            known = {o.name for o in spec.outputs}
            for output in request.outputs:
                if output.name not in known:
                    raise InvalidInput(
                        f"model '{family}' has no output '{output.name}'; it gives {sorted(known)}"
                    )
        if not inputs:
            raise InvalidInput(f"request for '{request.model_name}' has no inputs")

    def snapshot(self, model: str) -> FleetSnapshot:
        cloud = None
        if self.cloud is not None:
            cloud = CloudView(
                available=self.cloud.available,
                serves=self.cloud.models.get(model, False),
                predicted_ms=self.cloud.latency.mean_ms or 5.0,
            )
        return self.registry.snapshot(model, cloud)

    async def dispatch(
        self, target: Target, request: pb.ModelInferRequest, remaining_ms: float | None
    ) -> Answer:
        started = self._clock()
        if target.agent_id is None:
            assert self.cloud is not None
            response = await self.cloud.infer(
                request, timeout_s=remaining_ms / 1000.0 if remaining_ms else None
            )
            params = response.parameters
            confidence = parameter_value(params[CONFIDENCE]) if CONFIDENCE in params else 1.0
            variant = parameter_value(params[VARIANT]) if VARIANT in params else request.model_name
            return Answer(
                response=response,
                tier=Tier.CLOUD,
                agent=f"cloud@{self.cloud.address}",
                variant=str(variant),
                confidence=float(confidence or 0.0),
                elapsed_ms=(self._clock() - started) * 1000.0,
            )
        handle = self.registry.agents[target.agent_id]
        result = await self.registry.submit(
            handle, request, variant=request.model_name, budget_ms=remaining_ms
        )
        if result.WhichOneof("outcome") == "error":
            raise error_from_status(_status(result.error.code), f"agent {handle.id}: {result.error.message}")
        return Answer(
            response=result.response,
            tier=handle.tier,
            agent=handle.id,
            variant=result.variant,
            confidence=result.confidence,
            elapsed_ms=(self._clock() - started) * 1000.0,
        )


class _Cascade:
    """One request's climb through the tiers."""

    def __init__(
        self,
        plane: RouterDataPlane,
        request: pb.ModelInferRequest,
        *,
        family: str,
        pinned: str | None,
        options: RequestOptions,
        budget_ms: float | None,
        started: float,
    ) -> None:
        self.plane = plane
        self.request = request
        self.family = family
        self.pinned = pinned
        self.options = options
        self.budget_ms = budget_ms
        self.started = started
        self.path: list[Tier] = []
        self.timings: dict[Tier, float] = {}
        self.best: Answer | None = None
        self.exclude: set[str] = set()
        self.above: Tier | None = None
        self.problem: StratusError | None = None
        self.asked_for = request.model_name

    def remaining_ms(self) -> float | None:
        if self.budget_ms is None:
            return None
        return self.budget_ms - (self.plane._clock() - self.started) * 1000.0

    async def run(self) -> pb.ModelInferResponse:
        model = self.pinned or self.family
        self.request.model_name = model  # what agents and the cloud are asked to run
        thresholds = self.plane.registry.thresholds(self.family)
        while (remaining := self.remaining_ms()) is None or remaining > 0:
            snapshot = self.plane.snapshot(model)
            attempt = Attempt(
                model=model,
                remaining_ms=remaining,
                min_tier=self.options.min_tier,
                max_tier=self.options.max_tier,
                above=self.above,
                exclude=frozenset(self.exclude),
            )
            target = choose(attempt, snapshot, self.plane._rng)
            if isinstance(target, NoTarget):
                # A failure met on the way up explains more than "nothing is left to try".
                kind = Overloaded if target.full else DeadlineExceeded if target.too_slow else Unavailable
                if self.problem is None:
                    self.problem = kind(target.reason)
                break
            answer = await self._try(target, remaining)
            if answer is None:
                continue
            self.path.append(answer.tier)
            self.timings[answer.tier] = answer.elapsed_ms
            self.best = answer
            top = top_tier(snapshot, self.options.max_tier)
            final = self.pinned is not None or top is None or answer.tier >= top
            if final or accepts(
                answer.confidence,
                answer.tier,
                thresholds=thresholds,
                min_confidence=self.options.min_confidence,
            ):
                return self._respond(answer, degraded=False)
            self.above = answer.tier
        if self.best is not None:
            if self.plane.fail_without_cloud and self.plane.cloud is not None and self._needed_cloud():
                raise Unavailable(
                    f"the cloud is unavailable ({self.plane.cloud.status}) and the router runs with "
                    f"--on-cloud-failure fail; best lower-tier confidence was {self.best.confidence:.3f}"
                )
            return self._respond(self.best, degraded=True)
        if self.problem is None:
            self.problem = DeadlineExceeded(
                f"budget of {self.budget_ms:.1f} ms ran out before any tier answered"
            )
        raise self.problem

    def _needed_cloud(self) -> bool:
        """The climb stopped below a cloud that serves the model and was not refused by max_tier."""
        assert self.plane.cloud is not None
        cloud_serves = self.plane.cloud.models.get(self.pinned or self.family, False)
        return cloud_serves and self.options.max_tier >= Tier.CLOUD and Tier.CLOUD not in self.path

    async def _try(self, target: Target, remaining: float | None) -> Answer | None:
        # Keep a little of the budget for the way back, so a late tier times out here
        # and the best answer so far still reaches the client before its deadline.
        allowed = None if remaining is None else remaining - min(RETURN_MARGIN_MS, remaining * 0.1)
        try:
            return await self.plane.dispatch(target, self.request, allowed)
        except _RETRYABLE as exc:
            log.info("%s failed for %s: %s", target.agent_id or "cloud", self.request.id, exc)
            self.exclude.add(target.agent_id or "cloud")
            self.problem = exc
            return None

    def _respond(self, answer: Answer, *, degraded: bool) -> pb.ModelInferResponse:
        response = answer.response
        for key in [k for k in response.parameters if k.startswith(PREFIX)]:
            del response.parameters[key]
        response.model_name = self.asked_for
        response.id = self.request.id
        Served(
            tier=answer.tier,
            agent=answer.agent,
            variant=answer.variant,
            confidence=answer.confidence,
            path=self.path,
            degraded=degraded,
            timings_ms=self.timings,
        ).write(response.parameters)
        return response


# A request with neither a budget nor a deadline still ends: nothing waits forever on a
# peer that stopped answering without dropping its link.
DEFAULT_BUDGET_MS = 30_000.0
# At most this much of a request's remaining budget is kept back for answering the client.
RETURN_MARGIN_MS = 5.0


def _budget(budget_ms: float | None, timeout_s: float | None) -> float:
    """The tighter of the client's ``stratus.budget_ms`` and its gRPC deadline."""
    limits = [b for b in (budget_ms, timeout_s * 1000.0 if timeout_s is not None else None) if b is not None]
    return min(limits) if limits else DEFAULT_BUDGET_MS


def _status(code: int) -> grpc.StatusCode:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN


def family_spec(info: fpb.FamilyInfo) -> FamilySpec:
    """A FamilySpec rebuilt from what an agent said, for input checks and metadata."""
    from pathlib import Path

    from stratus.confidence import ConfidenceMethod
    from stratus.repository import ConfidenceSpec

    def specs(items: object) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(name=t.name, datatype=t.datatype, shape=tuple(t.shape)) for t in items)  # type: ignore[attr-defined]

    outputs = specs(info.outputs)
    return FamilySpec(
        name=info.name,
        description="",
        inputs=specs(info.inputs),
        outputs=outputs,
        confidence=ConfidenceSpec(
            output=outputs[0].name if outputs else "",
            method=ConfidenceMethod.MAX_SOFTMAX,
            apply_softmax=False,
        ),
        thresholds={Tier.parse(k): v for k, v in info.thresholds.items()},
        variants=(),
        source=Path("<agent>"),
    )
