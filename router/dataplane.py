"""The router's data plane: the tiered cascade behind the inference service.

A request naming a family starts on the lowest tier that can answer inside its budget
and climbs while the answer's confidence is below that tier's threshold and a higher
tier still fits the remaining budget. A request naming a variant runs exactly there. A
failed or lost agent means retry elsewhere on the same tier or climb; when nothing above
can answer in time, the best answer so far is returned marked ``stratus.degraded``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.cloud_models import family_of
from router.cloud_pool import CloudTier
from router.generate import Generation, GenerationCascade, Sink
from router.index import line_key
from router.policy import Attempt, CloudView, FleetSnapshot, NoTarget, Target, choose, settled, top_tier
from router.registry import FleetRegistry
from router.rollout import PROMOTED, Plan, Rollouts
from router.rollout_judge import top1
from stratus.errors import DeadlineExceeded, NotFound, Overloaded, StratusError, Unavailable
from stratus.family_spec import FamilySpec, TensorSpec
from stratus.generation import FINAL, FINISH_REASON, Chunk
from stratus.local_dataplane import model_config
from stratus.metrics import UNKNOWN, RouterMetrics
from stratus.protocol import (
    COMPUTE_MS,
    CONFIDENCE,
    CONFIG_CURRENT,
    CONFIG_VARIANTS,
    MODEL_VERSION,
    PRECISION,
    QUEUE_MS,
    VARIANT,
    RequestOptions,
    Served,
    held_reason,
    parameter_value,
    reported_ms,
    set_parameter,
)
from stratus.serving import DataPlane
from stratus.status import status_code
from stratus.tensors import Tensors, answer_raw, check_inputs, check_request_metadata, requested_outputs
from stratus.text_wire import (
    chunk_response,
    generative_config,
    generative_metadata,
    text_response,
    write_usage,
)
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

if TYPE_CHECKING:
    from router.audit import Auditor

log = logging.getLogger("stratus.router")

# Errors after which another agent (or tier) may still succeed, within what budget is left.
_RETRYABLE = (Unavailable, Overloaded, DeadlineExceeded)


@dataclass(frozen=True, kw_only=True)
class Answer:
    """One tier's answer for the items it was sent."""

    tier: Tier
    agent: str
    variant: str
    outputs: Tensors
    confidences: tuple[float, ...]
    elapsed_ms: float
    precision: str = ""  # of the variant that answered, where it is known
    queue_ms: float = 0.0  # of elapsed_ms, waiting for a slot (where the tier said so)
    compute_ms: float = 0.0  # ... and running in a runtime


@dataclass(frozen=True, kw_only=True)
class Job:
    """One client request, checked and converted once at the boundary."""

    id: str
    asked_for: str  # the model name the client used
    family: str
    pinned: str | None
    label: str  # the family its metrics count it under (a variant only the cloud serves: its family's)
    options: RequestOptions
    inputs: Tensors
    outputs: tuple[str, ...]  # requested outputs; empty: all
    raw: bool  # answer with raw buffers (else typed contents, as the client sent)
    budget_ms: float
    started: float

    @property
    def model(self) -> str:
        """What agents and the cloud are asked to run."""
        return self.pinned or self.family


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
    ) -> None:
        self.metrics = metrics
        self.audits = audits  # samples settled answers for the top tier to check (router/audit.py)
        self.rollouts = rollouts or Rollouts(router_id="router")
        self._shadows: set[asyncio.Task[None]] = set()
        self.stopping = False  # set on SIGTERM: not ready, finishing what is in flight
        self.warned_short: set[str] = set()  # families whose unsure answers had nowhere higher to go
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
        """Ready while something can serve (a ready agent, or a cloud that takes calls) and
        the router is not stopping."""
        return not self.stopping and (self.registry.index.any_ready() or self._cloud_takes_calls())

    def model_ready(self, name: str) -> bool:
        served_by_cloud = (
            self._cloud_takes_calls() and self.cloud is not None and self.cloud.models.get(name, False)
        )
        return self.registry.index.serves(name) or served_by_cloud

    def _cloud_takes_calls(self) -> bool:
        return self.cloud is not None and self.cloud.available

    def model_names(self) -> list[str]:
        """Every name a request may use: families, each variant an agent serves, and each
        model the cloud was found to serve (listed while it is down too, as UNAVAILABLE)."""
        families, variants = self._names()
        return sorted({*families, *variants})

    def knows(self, name: str) -> bool:
        return self._resolve(name) is not None

    def _names(self) -> tuple[list[str], list[str]]:
        """(families, every other name that works), each sorted: what NOT_FOUND lists."""
        families = set(self.registry.families)
        others = set(self.registry.index.models())
        if self.cloud is not None:
            others |= {name for name, ok in self.cloud.models.items() if ok}
        return sorted(families), sorted(others - families)

    def _resolve(self, name: str) -> tuple[str, str | None] | None:
        """(family, pinned variant or None), or None when no agent nor the cloud knows ``name``.
        A model only the cloud serves is a family of its own here (the cloud is its one tier)."""
        if name in self.registry.families:
            return name, None
        family = self.registry.index.family_of(name)
        if family is not None:
            return family, name
        if self.cloud is not None and self.cloud.models.get(name):
            return name, None
        return None

    def _family_of(self, name: str) -> tuple[str, str | None]:
        """As :meth:`_resolve`; NotFound listing every name that works (families first)."""
        resolved = self._resolve(name)
        if resolved is None:
            families, variants = self._names()
            raise NotFound(f"unknown model {name[:128]!r}; the fleet serves {listing([*families, *variants])}")
        return resolved

    def _description(self, family: str) -> fpb.FamilyInfo | None:
        """What describes ``family`` (as :meth:`_resolve` names it): its agents' description,
        else, for a model only the cloud serves, the cloud's own metadata of it."""
        info = self.registry.family(family)
        if info is None and self.cloud is not None:
            info = self.cloud.described.get(family)
        return info

    def _spec(self, family: str) -> FamilySpec | None:
        """The family's description as a spec; rebuilt only when that description changes."""
        info = self._description(family)
        if info is None:
            return None
        cached = self._specs.get(family)
        if cached is None or cached[0] is not info:
            cached = (info, family_spec(info))
            self._specs[family] = cached
        return cached[1]

    def model_metadata(self, name: str) -> pb.ModelMetadataResponse:
        """The family's tensors (a variant's are its family's); a model only the cloud serves,
        the cloud's own. One version, as on every Stratus server: variants are models."""
        family, _ = self._family_of(name)
        info = self._description(family)
        if info is not None and info.kind == "generative" and family in self.registry.families:
            return generative_metadata(name, "stratus")  # the layout its ModelConfig says
        response = pb.ModelMetadataResponse(name=name, versions=[MODEL_VERSION], platform="stratus")
        if info is not None:
            response.inputs.extend(info.inputs)
            response.outputs.extend(info.outputs)
        return response

    def model_config(self, name: str) -> pb.ModelConfig:
        """Triton's config from the same description as the metadata; a family's also says
        which variants may be pinned and which line each tier serves it with by default."""
        family, pinned = self._family_of(name)
        generative = self.generative(family)
        spec = self._spec(family)
        if generative is not None:  # with the max_tokens a request may ask for, as the cloud says it
            config = generative_config(name, "stratus", generative.max_tokens)
        elif spec is not None:
            config = model_config(spec, name, "stratus")
        else:
            config = pb.ModelConfig(name=name, platform="stratus", backend="stratus")
        if pinned is None and family_of(family, self.registry.families) in (None, family):
            self._describe_lines(config, family)  # a family, not a variant only the cloud serves
        return config

    def _describe_lines(self, config: pb.ModelConfig, family: str) -> None:
        variants = self.registry.index.variants_of(family)
        if self.cloud is not None:
            cloud = [n for n in self.cloud.models if n != family and family_of(n, [family]) == family]
            variants = sorted({*variants, *cloud})
        if variants:
            config.parameters[CONFIG_VARIANTS].string_value = ",".join(variants)
        for tier, line in self.current_lines(family).items():
            config.parameters[CONFIG_CURRENT + tier.label].string_value = line

    def current_lines(self, family: str) -> dict[Tier, str]:
        """The line each agents' tier serves ``family`` with by default: a promoted rollout's
        candidate, else the current variant of a ready agent there (its FP32 name)."""
        lines: dict[Tier, str] = {}
        for tier, pool in self.registry.index.pools(family).items():
            if pool:
                agent = pool[0]
                variant = agent.variant_for(family)
                info = agent.variants.get(variant)
                lines[tier] = info.line if info is not None and info.line else variant
        for plan in self.rollouts.plans():
            if plan.family == family and plan.state == PROMOTED:
                lines[plan.tier] = plan.candidate
        return lines

    # -- inference ----------------------------------------------------------------------
    def generative(self, name: str) -> fpb.FamilyInfo | None:
        """The family's description when ``name`` is a generative family (or one of its variants)."""
        try:
            family, _ = self._family_of(name)
        except NotFound:
            return None
        info = self.registry.family(family)
        if info is None and self.cloud is not None:
            info = self.cloud.generative.get(family)  # served by the cloud alone
        return info if info is not None and info.kind == "generative" else None

    async def generate_text(
        self, request: pb.ModelInferRequest, *, timeout_s: float | None, sink: Sink | None = None
    ) -> Generation:
        """A generative request through the tiers; what the client may see goes to ``sink``."""
        from stratus.text_wire import prompt_request, read_generation

        started = self._clock()
        info = self.generative(request.model_name)
        if info is None:
            raise NotFound(f"'{request.model_name}' is not a generative model this fleet serves")
        family, pinned = self._family_of(request.model_name)
        options = RequestOptions.from_parameters(request.parameters)
        # Checked before any tier sees it; the tiers get the checked prompt and settings alone,
        # never the client's message (whatever else it carried would travel on every agent's link).
        prompt, params = read_generation(request, family, info.max_tokens or 1)
        checked = prompt_request(pinned or family, request.id, prompt, params)
        if pinned is not None:  # a pinned variant runs exactly there, on its own tier only
            options = _pinned_options(options, self.registry.index.tiers(pinned))
        label = self._family_label(request.model_name)
        if sink is not None and self.metrics is not None:
            sink = self._timing_first_text(sink, label, started)
        if self.active >= self.max_requests:
            raise Overloaded(f"router request queue is full: {self.max_requests} requests in flight")
        self.active += 1
        try:
            budget = _budget(options.budget_ms, timeout_s)
            stops = params.stopping_also_at(info.stop).stop
            cascade = GenerationCascade(self, info, checked, options, budget, started, sink, stops=stops)
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
        self._count_generation(label, result)
        return result

    def _timing_first_text(self, sink: Sink, family: str, started: float) -> Sink:
        """``sink``, noting when the first text reaches it."""
        seen = False

        async def timed(chunk: Chunk) -> None:
            nonlocal seen
            if not seen and chunk.text and self.metrics is not None:
                seen = True
                self.metrics.first_text.labels(family).observe(self._clock() - started)
            await sink(chunk)

        return timed

    def _count_generation(self, family: str, result: Generation) -> None:
        """Tokens each tier made, answered or discarded; escalations and each tier's time."""
        if self.metrics is None:
            return
        for tier, made in result.generated.items():
            answered = len(result.tokens) if tier is result.tier else 0
            for fate, count in (("answered", answered), ("discarded", made - answered)):
                if count > 0:
                    self.metrics.generated_tokens.labels(family, tier.label, fate).inc(count)
        for lower, higher in itertools.pairwise(result.path):
            self.metrics.escalations.labels(family, lower.label, higher.label, "unsure").inc()
        for tier, ms in result.timings_ms.items():
            self.metrics.tier_duration.labels(family, tier.label).observe(ms / 1000.0)

    async def _infer_text(
        self, request: pb.ModelInferRequest, timeout_s: float | None
    ) -> pb.ModelInferResponse:
        result = await self.generate_text(request, timeout_s=timeout_s)
        response = text_response(request, result.text)
        write_generation(response, result)
        return response

    async def generate(
        self, request: pb.ModelInferRequest, *, timeout_s: float | None
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """Chunks as the client may see them (the final tier's as they come), then the end."""
        chunks: asyncio.Queue[Chunk | None] = asyncio.Queue()

        async def sink(chunk: Chunk) -> None:
            chunks.put_nowait(chunk)

        task = asyncio.create_task(self.generate_text(request, timeout_s=timeout_s, sink=sink))
        task.add_done_callback(lambda _: chunks.put_nowait(None))
        try:
            while (chunk := await chunks.get()) is not None:
                response = chunk_response(request, chunk)
                set_parameter(response.parameters, FINAL, False)
                yield response
            result = await task
        finally:
            task.cancel()
        final = text_response(request, "")
        write_generation(final, result)
        set_parameter(final.parameters, FINAL, True)
        yield final

    async def infer(self, request: pb.ModelInferRequest, *, timeout_s: float | None) -> pb.ModelInferResponse:
        """Admit (or refuse, past ``max_requests``), check, then climb the tiers."""
        if self.generative(request.model_name) is not None:
            return await self._infer_text(request, timeout_s)
        started = self._clock()
        family = self._family_label(request.model_name)
        try:
            if self.active >= self.max_requests:
                raise Overloaded(f"router request queue is full: {self.max_requests} requests in flight")
            self.active += 1
            try:
                cascade = _Cascade(self, self._job(request, timeout_s))
                response = await cascade.run()
            finally:
                self.active -= 1
        except StratusError as exc:
            self._count_refusal(family, exc)
            raise
        if self.audits is not None:  # sampled once the answer is on its way
            asyncio.get_running_loop().call_soon(self.audits.classified, cascade)
        self._count_answer(family, cascade.tier_label, cascade.degraded, started)
        return response

    def _count_refusal(self, family: str, exc: StratusError) -> None:
        if self.metrics is not None:
            reason = status_code(exc).name.lower()
            self.metrics.requests.labels(family, "none", reason).inc()
            self.metrics.refusals.labels(reason).inc()

    def _count_answer(self, family: str, tier: str, degraded: bool, started: float) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(family, tier, "degraded" if degraded else "ok").inc()
            self.metrics.duration.labels(family).observe(self._clock() - started)

    def _family_label(self, name: str) -> str:
        """The family a request names, or "unknown": metric labels stay a bounded set. A
        variant counts under its family, whether agents serve it or only the cloud does
        (``digits-large``: "digits"), never as a family of its own."""
        try:
            family, _ = self._family_of(name)
        except NotFound:
            return UNKNOWN
        if family in self.registry.families or self.cloud is None:
            return family
        return family_of(family, self.registry.families, self.cloud.named) or family

    def _job(self, request: pb.ModelInferRequest, timeout_s: float | None) -> Job:
        """Check everything a request says against the family's description, without decoding."""
        started = self._clock()
        options = RequestOptions.from_parameters(request.parameters)
        family, pinned = self._family_of(request.model_name)
        spec = self._spec(family)
        if spec is not None:
            check_request_metadata(family, spec.inputs, request)
        inputs = Tensors.from_request(request)
        outputs: list[str] = [o.name for o in request.outputs]
        datatypes = ["FP32"]
        if spec is not None:
            check_inputs(family, spec.inputs, inputs)
            outputs = requested_outputs(request, family, [o.name for o in spec.outputs])
            datatypes = [o.datatype for o in spec.outputs if o.name in outputs]
        return Job(
            id=request.id,
            asked_for=request.model_name,
            family=family,
            pinned=pinned,
            label=self._family_label(request.model_name),
            options=options,
            inputs=inputs,
            outputs=tuple(outputs) if request.outputs else (),
            raw=answer_raw(request, datatypes),
            budget_ms=_budget(options.budget_ms, timeout_s),
            started=started,
        )

    def snapshot(self, model: str) -> FleetSnapshot:
        cloud = None
        if self.cloud is not None:
            cloud = CloudView(
                available=self.cloud.available,
                serves=self.cloud.models.get(model, False),
                predicted_ms=self.cloud.predicted_ms,
            )
        return self.registry.snapshot(model, cloud)

    async def dispatch(
        self, target: Target, job: Job, items: Tensors, remaining_ms: float, *, model: str | None = None
    ) -> Answer:
        """Send items to the chosen agent or to the cloud; the answer holds one row per item.

        ``model`` is what the agent is asked for when it is not the job's own (a rollout's
        line key)."""
        started = self._clock()
        if target.agent_id is None:
            return await self._ask_cloud(job, items, remaining_ms, started)
        handle = self.registry.agents[target.agent_id]
        part = await self.registry.submit(
            handle, items, variant=model or job.model, outputs=job.outputs, budget_ms=remaining_ms
        )
        return Answer(
            tier=target.tier,
            agent=handle.id,
            variant=part.variant,
            outputs=part.outputs,
            confidences=part.confidences,
            elapsed_ms=(self._clock() - started) * 1000.0,
            precision=handle.precision_of(part.variant),
            queue_ms=part.queue_ms,
            compute_ms=part.service_ms,
        )

    # -- gray release ----------------------------------------------------------------------
    def candidate_target(self, plan: Plan, attempt: Attempt) -> Target | None:
        """An agent of the rollout's tier that serves its candidate and can take the items."""
        key = line_key(plan.candidate)
        narrowed = Attempt(
            model=key,
            remaining_ms=attempt.remaining_ms,
            items=attempt.items,
            min_tier=plan.tier,
            max_tier=plan.tier,
            exclude=attempt.exclude,
        )
        target = choose(narrowed, self.snapshot(key), self._rng)
        return None if isinstance(target, NoTarget) else target

    def record_arm(
        self, plan: Plan, *, candidate: bool, answer: Answer | None, accepted: Sequence[bool], items: int
    ) -> None:
        latency = answer.elapsed_ms if answer is not None else 0.0
        unsure = sum(1 for ok in accepted if not ok)
        self.rollouts.record(
            plan, candidate=candidate, ok=answer is not None, latency_ms=latency, items=items, unsure=unsure
        )
        if self.metrics is not None:
            arm = "candidate" if candidate else "current"
            outcome = "ok" if answer is not None else "error"
            self.metrics.rollout_requests.labels(plan.family, plan.tier.label, arm, outcome).inc()

    def shadow(self, plan: Plan, job: Job, attempt: Attempt, items: Tensors, answer: Answer) -> None:
        """Mirror items the current variant answered to the candidate, in the background;
        its answers are only compared (top-1 agreement), never returned."""
        target = self.candidate_target(plan, attempt)
        if target is None or len(self._shadows) >= MAX_SHADOWS:
            return

        async def mirror() -> None:
            try:
                budget_ms = attempt.remaining_ms or DEFAULT_BUDGET_MS
                mirrored = await self.dispatch(target, job, items, budget_ms, model=line_key(plan.candidate))
            except StratusError:
                return
            mine, theirs = top1(answer.outputs), top1(mirrored.outputs)
            if mine is not None and theirs is not None and mine.shape == theirs.shape:
                self.rollouts.record_shadow(plan, int((mine == theirs).sum()), len(mine))

        task = asyncio.create_task(mirror(), name="stratus-shadow")
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _ask_cloud(self, job: Job, items: Tensors, remaining_ms: float, started: float) -> Answer:
        assert self.cloud is not None
        request = pb.ModelInferRequest(model_name=job.model, id=job.id)
        request.outputs.extend(pb.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in job.outputs)
        items.write_request(request)
        response = await self.cloud.infer(request, timeout_s=remaining_ms / 1000.0)
        params = response.parameters
        confidence = parameter_value(params[CONFIDENCE]) if CONFIDENCE in params else 1.0
        variant = parameter_value(params[VARIANT]) if VARIANT in params else job.model
        precision = parameter_value(params[PRECISION]) if PRECISION in params else ""
        outputs = Tensors.from_response(response)
        if outputs.items != items.items:
            raise Unavailable(f"the cloud answered {outputs.items} items for {items.items}")
        return Answer(
            tier=Tier.CLOUD,
            agent=f"cloud@{self.cloud.address}",
            variant=str(variant),
            outputs=outputs,
            confidences=(float(confidence or 0.0),) * items.items,
            elapsed_ms=(self._clock() - started) * 1000.0,
            precision=str(precision),
            queue_ms=reported_ms(params, QUEUE_MS) or 0.0,  # a foreign cloud says neither
            compute_ms=reported_ms(params, COMPUTE_MS) or 0.0,
        )


class _Cascade:
    """One request's climb through the tiers, item by item.

    Every item starts on the lowest tier that fits. After each answer, the items whose own
    confidence meets that tier's threshold are settled there; only the unsure ones climb,
    as a smaller batch. The response holds every item's answer in the original order.
    """

    def __init__(self, plane: RouterDataPlane, job: Job) -> None:
        self.plane = plane
        self.job = job
        self.pending = list(range(job.inputs.items))
        self.best: dict[int, tuple[Answer, int]] = {}  # item -> (answer, its row there)
        self.answers: list[Answer] = []
        self.sent: list[list[int]] = []  # per answer, the items its rows answer (for audits)
        self.path: list[Tier] = []
        self.timings: dict[Tier, float] = {}
        self.queue_ms = 0.0  # summed over the answers kept, as each tier measured it
        self.compute_ms = 0.0
        self.exclude: set[str] = set()
        self.above: Tier | None = None
        self.problem: StratusError | None = None
        self.degraded = False
        self.tier_label = "none"
        self.climb: tuple[Tier, str] | None = None  # the tier left last, and why
        self.reason = ""  # why unsure items were answered where they were (stratus.reason)
        self.nowhere_higher = False  # ... because no tier above serves the family: degraded

    def remaining_ms(self) -> float:
        return self.job.budget_ms - (self.plane._clock() - self.job.started) * 1000.0

    async def run(self) -> pb.ModelInferResponse:
        job = self.job
        thresholds = self.plane.registry.thresholds(job.family)
        while (self.pending or not self.answers) and (remaining := self.remaining_ms()) > 0:
            snapshot = self.plane.snapshot(job.model)
            attempt = Attempt(
                model=job.model,
                remaining_ms=remaining,
                items=max(1, len(self.pending)),
                min_tier=job.options.min_tier,
                max_tier=job.options.max_tier,
                above=self.above,
                exclude=frozenset(self.exclude),
            )
            target = choose(attempt, snapshot, self.plane._rng)
            arm: tuple[Plan, bool] | None = None
            if not isinstance(target, NoTarget) and job.pinned is None and target.agent_id is not None:
                target, arm = self._arm(target, attempt)
            if isinstance(target, NoTarget):
                # A failure met on the way up explains more than "nothing is left to try".
                kind = Overloaded if target.full else DeadlineExceeded if target.too_slow else Unavailable
                if self.problem is None:
                    self.problem = kind(target.reason)
                break
            self._note_climb(target.tier, snapshot.tiers)
            model = line_key(arm[0].candidate) if arm is not None and arm[1] else None
            items = len(self.pending)
            answer = await self._try(target, remaining, model)
            if answer is None:
                if arm is not None:
                    self.plane.record_arm(arm[0], candidate=arm[1], answer=None, accepted=(), items=items)
                self.climb = (target.tier, "failed")
                continue
            accepted = self._accepted(answer, snapshot, thresholds)
            if arm is not None:
                self.plane.record_arm(arm[0], candidate=arm[1], answer=answer, accepted=accepted, items=items)
                if not arm[1] and self.plane.rollouts.shadow_wanted(arm[0]):
                    sent = self.job.inputs.take(self.pending)
                    self.plane.shadow(arm[0], job, attempt, sent, answer)
            self._record(answer, accepted)
            self.above = answer.tier
            self.climb = (answer.tier, "unsure")
        if not self.pending and self.answers:
            return self._respond(degraded=self.nowhere_higher)
        if self.answers:
            if self.plane.fail_without_cloud and self.plane.cloud is not None and self._needed_cloud():
                raise Unavailable(
                    f"the cloud is unavailable ({self.plane.cloud.status}) and the router runs with "
                    f"--on-cloud-failure fail; {len(self.pending)} item(s) were still unsure"
                )
            return self._respond(degraded=True)
        if self.problem is None:
            self.problem = DeadlineExceeded(
                f"budget of {job.budget_ms:.1f} ms ran out before any tier answered"
            )
        raise self.problem

    def _accepted(
        self, answer: Answer, snapshot: FleetSnapshot, thresholds: Mapping[Tier, float]
    ) -> list[bool]:
        """Which items of ``answer`` stop climbing: each sure one, or all of a final answer."""
        job = self.job
        top = top_tier(snapshot, job.options.max_tier)
        final = job.pinned is not None or top is None or answer.tier >= top
        if final and job.pinned is None and answer.tier < Tier.CLOUD:  # nothing is above the cloud
            self._note_short(answer, snapshot, thresholds)
        return settled(
            answer.confidences,
            answer.tier,
            final=final,
            thresholds=thresholds,
            min_confidence=job.options.min_confidence,
        )

    def _note_short(self, answer: Answer, snapshot: FleetSnapshot, thresholds: Mapping[Tier, float]) -> None:
        """A final answer with items below its tier's threshold: never silently wrong. Where no
        tier above serves the family (no cloud variant, no such agents), the answer is degraded
        and the router says so once in its log; where ``stratus.max_tier`` kept the items, the
        answer says so (the client asked for it)."""
        options = self.job.options
        short = settled(
            answer.confidences,
            answer.tier,
            final=False,
            thresholds=thresholds,
            min_confidence=options.min_confidence,
        ).count(False)
        if not short:
            return
        higher = top_tier(snapshot, Tier.CLOUD)
        family, tier = self.job.family, answer.tier.label
        if higher is not None and higher > answer.tier:
            self.reason = held_reason(options.max_tier, short, answer.tier)
            return
        self.nowhere_higher = True
        self.reason = (
            f"no tier above {tier} serves '{family}': {short} item(s) stayed below the {tier} threshold"
        )
        if family not in self.plane.warned_short:
            self.plane.warned_short.add(family)
            log.warning(
                "%s: unsure answers are degraded (no tier above %s serves it: give the cloud a variant "
                "of it, or agents of a higher tier)",
                family,
                tier,
            )

    def _note_climb(self, tier: Tier, tiers: frozenset[Tier]) -> None:
        """Count a climb: after an unsure answer or a failure, or past a tier too slow to try."""
        metrics = self.plane.metrics
        if metrics is None:
            return
        if self.climb is None:  # the first try: any lower tier the model has was skipped
            options = self.job.options
            lower = [t for t in tiers if options.min_tier <= t < tier]
            if lower:
                metrics.escalations.labels(self.job.label, min(lower).label, tier.label, "too_slow").inc()
            return
        left, reason = self.climb
        if tier > left:
            metrics.escalations.labels(self.job.label, left.label, tier.label, reason).inc()

    def _record(self, answer: Answer, accepted: Sequence[bool]) -> None:
        """Keep each sent item's newest answer; only the unsure items stay pending."""
        metrics = self.plane.metrics
        if metrics is not None:
            family, tier = self.job.label, answer.tier.label
            metrics.tier_duration.labels(family, tier).observe(answer.elapsed_ms / 1000.0)
            histogram = metrics.confidence.labels(family, tier)
            for value in answer.confidences:
                histogram.observe(value)
        self.answers.append(answer)
        self.sent.append(list(self.pending))
        self.path.append(answer.tier)
        self.timings[answer.tier] = self.timings.get(answer.tier, 0.0) + answer.elapsed_ms
        self.queue_ms += answer.queue_ms
        self.compute_ms += answer.compute_ms
        for row, item in enumerate(self.pending):
            self.best[item] = (answer, row)
        self.pending = [item for item, ok in zip(self.pending, accepted, strict=True) if not ok]

    def _needed_cloud(self) -> bool:
        """The climb stopped below a cloud that serves the model and was not refused by max_tier."""
        assert self.plane.cloud is not None
        cloud_serves = self.plane.cloud.models.get(self.job.model, False)
        return cloud_serves and self.job.options.max_tier >= Tier.CLOUD and Tier.CLOUD not in self.path

    def _arm(self, target: Target, attempt: Attempt) -> tuple[Target, tuple[Plan, bool] | None]:
        """Under a rollout on the target's tier, the step's share goes to the candidate
        (on an agent that serves it); the rest, and any the candidate cannot take, stay."""
        drawn = self.plane.rollouts.arm(self.job.family, target.tier)
        if drawn is None:
            return target, None
        plan, to_candidate = drawn
        if to_candidate:
            chosen = self.plane.candidate_target(plan, attempt)
            if chosen is not None:
                return chosen, (plan, True)
        return target, (plan, False)

    async def _try(self, target: Target, remaining: float, model: str | None = None) -> Answer | None:
        # Keep a little of the budget for the way back, so a late tier times out here
        # and the best answer so far still reaches the client before its deadline.
        allowed = remaining - min(RETURN_MARGIN_MS, remaining * 0.1)
        items = self.job.inputs.take(self.pending)
        try:
            return await self.plane.dispatch(target, self.job, items, allowed, model=model)
        except _RETRYABLE as exc:
            log.info("%s failed for %r: %s", target.agent_id or "cloud", self.job.id[:64], exc)
            self.exclude.add(target.agent_id or "cloud")
            self.problem = exc
            return None

    def _respond(self, *, degraded: bool) -> pb.ModelInferResponse:
        job = self.job
        items = range(job.inputs.items)
        tiers = [self.best[i][0].tier for i in items]
        self.degraded = degraded
        self.tier_label = max(tiers, default=self.answers[-1].tier).label
        if degraded and self.plane.metrics is not None:
            reason = _STOPPED.get(type(self.problem), "no_higher_tier") if self.problem else "no_higher_tier"
            self.plane.metrics.degraded.labels(job.label, reason).inc()
        last = max(self.answers, key=lambda a: a.tier)
        response = pb.ModelInferResponse(model_name=job.asked_for, id=job.id)
        self._outputs().write_response(response, raw=job.raw)
        Served(
            tier=max(tiers, default=last.tier),
            agent=last.agent,
            variant=last.variant,
            precision=last.precision,
            confidence=min((self.best[i][0].confidences[self.best[i][1]] for i in items), default=1.0),
            path=self.path,
            degraded=degraded,
            timings_ms=self.timings,
            item_tiers=tiers,
            reason=self.reason,
            queue_ms=self.queue_ms,
            compute_ms=self.compute_ms,
        ).write(response.parameters)
        return response

    def _outputs(self) -> Tensors:
        """Every item's row from the answer that settled it, in the request's order."""
        if len(self.answers) == 1:
            return self.answers[0].outputs
        runs: list[Tensors] = []
        start = 0
        count = self.job.inputs.items
        while start < count:  # consecutive items answered by consecutive rows of one answer
            answer, row = self.best[start]
            stop = start + 1
            while stop < count and self.best[stop][0] is answer and self.best[stop][1] == row + stop - start:
                stop += 1
            runs.append(answer.outputs.rows(row, row + stop - start))
            start = stop
        return Tensors.join(runs)


# Why a climb stopped below the tier an answer needed, as the degraded counter says it.
_STOPPED: dict[type[StratusError], str] = {
    Overloaded: "overloaded",
    DeadlineExceeded: "too_slow",
    Unavailable: "unavailable",
}

# Shadow requests in flight at once, at most: mirroring must never crowd out real work.
MAX_SHADOWS = 64
# A request with neither a budget nor a deadline still ends: nothing waits forever on a
# peer that stopped answering without dropping its link.
DEFAULT_BUDGET_MS = 30_000.0
# At most this much of a request's remaining budget is kept back for answering the client.
RETURN_MARGIN_MS = 5.0


# What NOT_FOUND lists, at most, in characters of names: its message travels in gRPC
# metadata (8 KiB by default), which a fleet of thousands of names would pass.
MAX_LISTED_CHARS = 1024


def listing(names: Sequence[str], most_chars: int = MAX_LISTED_CHARS) -> str:
    """Names for an error message, in order, while they fit in ``most_chars``; then how many
    more there are, and where to find them all."""
    shown: list[str] = []
    size = 0
    for name in names:
        size += len(name) + 2
        if size > most_chars:
            break
        shown.append(name)
    if len(shown) == len(names):
        return f"[{', '.join(shown)}]"
    more = f"and {len(names) - len(shown)} more (RepositoryIndex lists them all)"
    return f"[{', '.join([*shown, more])}]"


def _pinned_options(options: RequestOptions, tiers: frozenset[Tier]) -> RequestOptions:
    if not tiers:
        return options
    tier = min(tiers)
    return RequestOptions(budget_ms=options.budget_ms, min_confidence=0.0, min_tier=tier, max_tier=tier)


def write_generation(response: pb.ModelInferResponse, result: Generation) -> None:
    """Where the text came from and how sure, as response parameters (``stratus.*``)."""
    Served(
        tier=result.tier,
        agent=result.agent,
        variant=result.variant,
        precision=result.precision,
        confidence=result.confidence,
        path=result.path,
        degraded=result.degraded,
        timings_ms=result.timings_ms,
    ).write(response.parameters)
    set_parameter(response.parameters, FINISH_REASON, result.finish_reason)
    answer = Chunk(
        tokens=result.tokens, prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens
    )
    for key, value in answer.parameters().items():
        set_parameter(response.parameters, key, value)
    write_usage(response, answer)


def _budget(budget_ms: float | None, timeout_s: float | None) -> float:
    """The tighter of the client's ``stratus.budget_ms`` and its gRPC deadline."""
    limits = [b for b in (budget_ms, timeout_s * 1000.0 if timeout_s is not None else None) if b is not None]
    return min(limits) if limits else DEFAULT_BUDGET_MS


def family_spec(info: fpb.FamilyInfo) -> FamilySpec:
    """A FamilySpec rebuilt from what an agent said, for input checks and metadata."""
    from pathlib import Path

    from stratus.confidence import ConfidenceMethod
    from stratus.family_spec import ConfidenceSpec

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
