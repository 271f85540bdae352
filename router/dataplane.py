"""The router's data plane: the tiered cascade behind the inference service.

A request naming a family starts on the lowest tier that can answer inside its budget
and climbs while the answer's confidence is below that tier's threshold and a higher
tier still fits the remaining budget. A request naming a variant runs exactly there. A
failed or lost agent means retry elsewhere on the same tier or climb; when nothing above
can answer in time, the best answer so far is returned marked ``stratus.degraded``.

This module admits requests (or refuses them past ``max_requests``), resolves the names they
use and answers metadata. The climb's rules are :mod:`router.policy.climb`'s; the cascades
in :mod:`router.cascade` perform them, through this plane as their ``CascadeContext``. What
only a generative request needs (its route, its OIP form read as text, what its generation
tells the observer) is :mod:`router.cascade.text_requests`'.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from router.backends.base import Backend
from router.backends.cloud import gateway_backends
from router.cascade.classify import ClassifyCascade
from router.cascade.common import Job, pinned_options, request_budget
from router.cascade.generate import Generation, GenerationCascade, Sink, generation_values
from router.cascade.text_requests import (
    count_generation,
    generative_route,
    text_request_of,
    timing_first_text,
)
from router.catalog import Catalog, Route
from router.cloud.pool import CloudTier
from router.fleet.registry import FleetRegistry
from router.metadata import config_of, metadata_of
from router.observer import observer_for
from router.policy import FleetSnapshot
from router.rollout.plans import Rollouts
from stratus.convert.inference import InferRequest, InferResult, TextRequest
from stratus.convert.text import chunk_result, prompt_request, text_result
from stratus.errors import NotFound, Overloaded, StratusError
from stratus.families.description import FamilyDescription
from stratus.families.generation import FINAL, Chunk
from stratus.families.sampling import check_max_tokens
from stratus.obs.metrics import UNKNOWN, RouterMetrics
from stratus.sched.streams import OnItem, relayed
from stratus.serving.servicer import DataPlane
from stratus.wire import inference_pb2 as pb

if TYPE_CHECKING:
    from router.audit.auditor import Auditor
    from router.offline import Offline

log = logging.getLogger("stratus.router")


class RouterDataPlane(DataPlane):
    def __init__(
        self,
        registry: FleetRegistry,
        cloud: CloudTier | None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        fail_without_cloud: bool = False,
        max_requests: int = 4096,
        metrics: RouterMetrics | None = None,
        rollouts: Rollouts | None = None,
        audits: Auditor | None = None,
        offline: Offline | None = None,
    ) -> None:
        self.observer = observer_for(metrics)
        self.offline = offline  # deferred requests, corrections, decision records (router/offline)  # every metric the request path records
        self.audits = audits  # samples settled answers for the top tier to check (router/audit/auditor.py)
        self.rollouts = rollouts or Rollouts(router_id="router")
        self._shadows: set[asyncio.Task[None]] = set()
        self.stopping = False  # set on SIGTERM: not ready, finishing what is in flight
        self.warned_short: set[str] = set()  # families whose unsure answers had nowhere higher to go
        self.max_requests = max_requests
        self.active = 0
        self.admitted = 0  # inference calls taken, ever: a stopping router watches it fall quiet
        self.registry = registry
        self.catalog = Catalog(registry, lambda: self.cloud)
        registry.cloud_serves = self.catalog.cloud_serves  # an agent's patience holds where the cloud is a way on
        self.cloud = cloud  # the cloud link or pool, if the router has one
        self.fail_without_cloud = fail_without_cloud
        self.rng = rng or random.Random()
        self._clock = clock

    # -- health and metadata ---------------------------------------------------------
    def ready(self) -> bool:
        """Ready while something can serve (a ready agent, or a cloud that takes calls) and
        the router is not stopping."""
        return not self.stopping and (self.registry.index.any_ready() or self._cloud_takes_calls())

    def model_ready(self, name: str) -> bool:
        served_by_cloud = self._cloud_takes_calls() and self.cloud_serves(name)
        return self.registry.index.serves(name) or served_by_cloud

    def escalates(self, model: str) -> bool:
        return self.catalog.escalates(model)

    def cloud_serves(self, model: str) -> bool:
        return self.catalog.cloud_serves(model)

    def _cloud_takes_calls(self) -> bool:
        return self.cloud is not None and self.cloud.available

    def model_names(self) -> list[str]:
        """Every name a request may use: families, each variant an agent serves, and each
        model the cloud was found to serve (listed while it is down too, as UNAVAILABLE)."""
        families, variants = self.catalog.names()
        return sorted({*families, *variants})

    def knows(self, name: str) -> bool:
        return self.catalog.knows(name)

    def model_metadata(self, name: str) -> pb.ModelMetadataResponse:
        return metadata_of(self.catalog, name)

    def model_config(self, name: str) -> pb.ModelConfig:
        return config_of(self.catalog, self.rollouts, name)

    # -- inference ----------------------------------------------------------------------
    def generative(self, name: str) -> FamilyDescription | None:
        """The family's description when ``name`` is a generative family (or one of its variants)."""
        return self.catalog.generative(name)

    async def generate_text(
        self, request: TextRequest, *, timeout_s: float | None, sink: Sink | None = None, route: Route | None = None
    ) -> Generation:
        """A generative request through the tiers; what the client may see goes to ``sink``.
        ``route``: the request's name, where the caller has resolved it already."""
        started = self._clock()
        route = route or generative_route(self.catalog, request.model_name)
        info = route.generative
        assert info is not None  # a generative route's
        family, pinned, label = route.family, route.pinned, route.label
        params, options = request.params, request.options
        check_max_tokens(params.max_tokens, info.max_tokens, family)
        # The tiers get the checked prompt, settings and conversation alone, never the client's
        # message (whatever else it carried would travel on every agent's link).
        checked = prompt_request(pinned or family, request.id, request.prompt, params, request.messages)
        if pinned is not None:  # a pinned variant runs exactly there, on its own tier only
            options = pinned_options(options, self.registry.index.tiers(pinned))
        if sink is not None:
            sink = timing_first_text(sink, self.observer, self._clock, label, started)
        if self.active >= self.max_requests:
            raise Overloaded(f"router request queue is full: {self.max_requests} requests in flight")
        self.active += 1
        self.admitted += 1
        try:
            budget = request_budget(options.budget_ms, timeout_s)
            stops = params.stopping_also_at(info.stop).stop
            cascade = GenerationCascade(
                self, info, checked, options, budget, started, sink, stops=stops, label=label
            )
            result = await cascade.run()
        except StratusError as exc:
            self._count_refusal(label, exc)
            raise
        finally:
            self.active -= 1
        if self.audits is not None:  # sampled once the answer is on its way
            asyncio.get_running_loop().call_soon(
                self.audits.generated, info, checked, result, cascade.climbed
            )
        self._count_answer(label, result.tier.label, result.degraded, started)
        count_generation(self.observer, label, result)
        return result

    async def _infer_text(self, request: InferRequest, route: Route, timeout_s: float | None) -> InferResult:
        asked = text_request_of(request, route)
        result = await self.generate_text(asked, timeout_s=timeout_s, route=route)
        answer = text_result(asked, result.text)
        answer.parameters.update(generation_values(result))
        return answer

    async def generate(self, request: InferRequest, *, timeout_s: float | None) -> AsyncIterator[InferResult]:
        """Chunks as the client may see them (the final tier's as they come), then the end."""
        route = generative_route(self.catalog, request.model_name)
        asked = text_request_of(request, route)

        async def produce(sink: OnItem[Chunk]) -> Generation:
            return await self.generate_text(asked, timeout_s=timeout_s, sink=sink, route=route)

        async with relayed(produce) as relay:
            async for chunk in relay.items():
                piece = chunk_result(asked, chunk)
                piece.parameters[FINAL] = False
                yield piece
            result = relay.result()
        final = text_result(asked, "")
        final.parameters.update(generation_values(result))
        final.parameters[FINAL] = True
        yield final

    async def infer(self, request: InferRequest, *, timeout_s: float | None) -> InferResult:
        """Resolve the name once, admit (or refuse, past ``max_requests``), check, then climb the tiers."""
        started = self._clock()
        try:
            route = self.catalog.route(request.model_name)
        except NotFound as exc:
            self._count_refusal(UNKNOWN, exc)
            raise
        if route.generative is not None:
            return await self._infer_text(request, route, timeout_s)
        family = route.label
        try:
            if self.active >= self.max_requests:
                raise Overloaded(f"router request queue is full: {self.max_requests} requests in flight")
            self.active += 1
            self.admitted += 1
            try:
                cascade = ClassifyCascade(self, self._job(request, route, timeout_s, started))
                result = await cascade.run()
            finally:
                self.active -= 1
        except StratusError as exc:
            self._count_refusal(family, exc)
            raise
        if self.audits is not None:  # sampled once the answer is on its way
            asyncio.get_running_loop().call_soon(self.audits.classified, cascade)
        if self.offline is not None:
            self.offline.log_decision(provisional=cascade.provisional, record=cascade.decision)
        self._count_answer(family, cascade.tier_label, cascade.degraded, started)
        return result

    def _count_refusal(self, family: str, exc: StratusError) -> None:
        self.observer.refused(family, exc)

    def _count_answer(self, family: str, tier: str, degraded: bool, started: float) -> None:
        self.observer.answered(family, tier, degraded=degraded, seconds=self._clock() - started)

    def _job(self, request: InferRequest, route: Route, timeout_s: float | None, started: float) -> Job:
        """Check everything a request says against the family's description, without decoding."""
        options = request.options()
        spec = route.classifier
        inputs, outputs = (spec.inputs, spec.outputs) if spec is not None else (None, None)
        checked = request.checked(route.family, inputs, outputs)
        datatypes = [o.datatype for o in checked.wanted(spec.outputs)] if spec is not None else ["FP32"]
        return Job(
            id=request.id,
            asked_for=request.model_name,
            family=route.family,
            pinned=route.pinned,
            label=route.label,
            options=options,
            inputs=checked.inputs,
            outputs=checked.outputs,
            raw=request.answer_raw(datatypes),
            budget_ms=request_budget(options.budget_ms, timeout_s),
            started=started,
        )

    def snapshot(self, model: str) -> FleetSnapshot[Backend]:
        """The targets for ``model``: its agents, and the cloud's gateways that serve it (up
        or down) where its items may go there."""
        gateways = gateway_backends(self.cloud, model) if self.cloud_serves(model) else ()
        return self.registry.snapshot(model, gateways)

    def now(self) -> float:
        return self._clock()

    def background(self, work: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Run ``work`` beside the requests (a shadow), at most MAX_SHADOWS at once."""
        if len(self._shadows) >= MAX_SHADOWS:
            return False
        task = asyncio.create_task(work(), name="stratus-shadow")
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)
        return True


# Shadow requests in flight at once, at most: mirroring must never crowd out real work.
MAX_SHADOWS = 64

