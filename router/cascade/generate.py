"""The cascade for generation: a lower tier's answer is held until it is accepted.

A generative request climbs like a classifier's, with three differences:

* a lower tier's tokens are held, never shown, until its whole answer is accepted (its
  confidence reaches the tier's threshold): a client never sees text a higher tier then
  replaces. The final tier (the highest this request may reach) streams straight through;
* while a lower tier generates, its running confidence is watched, and as soon as the
  answer can no longer be accepted (:meth:`RunningConfidence.hopeless`) the rest of that
  generation is cancelled (the Cancel reaches the agent's runtime) and the request climbs;
* nothing is merged into batches: a generation holds its agent's slot while it runs.

Every tier's answer is cut at the first stop string (the family's or the request's) here
too, text that may begin one held back until settled: Stratus's own tiers stop and cut
there already, a foreign cloud may not. Its confidence is judged on the tokens kept. The
answer's ``completion_tokens`` are the tokens the answering tier generated for it (as the
tier counts them, a stop string's included), not those of the tiers it climbed past, which
``generated`` counts per tier.

When nothing above can answer, the best answer so far is returned marked degraded, as for
classifiers; with ``--on-cloud-failure fail`` the request fails UNAVAILABLE instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from router.backends.base import Backend
from router.cascade.common import CascadeContext, cloud_facts
from router.policy import FleetSnapshot, Target, top_tier
from router.policy.climb import (
    ClimbState,
    Degrade,
    Dispatch,
    Fail,
    after_answer,
    after_failure,
    finish,
    next_action,
    retryable,
)
from stratus.convert.inference import TextRequest
from stratus.convert.parameters import RequestOptions, Served
from stratus.convert.text import chat_templated, read_usage
from stratus.datatypes import ParameterValue
from stratus.errors import StratusError
from stratus.families.chat import CHAT_TEMPLATE, MESSAGES
from stratus.families.confidence import accepts, threshold_for
from stratus.families.description import FamilyDescription
from stratus.families.generation import (
    FINISH_REASON,
    Chunk,
    GenerationMethod,
    RunningConfidence,
    StopCut,
    Token,
)
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

log = logging.getLogger("stratus.generate")

Sink = Callable[[Chunk], Awaitable[None]]


class TextGenerator(Protocol):
    """What serves generative requests, as the OpenAI API needs it (the router's data plane):
    that API depends on this, never on the data plane itself."""

    def ready(self) -> bool: ...

    def model_names(self) -> list[str]: ...

    def model_ready(self, name: str) -> bool: ...

    def generative(self, name: str) -> FamilyDescription | None:
        """The family's description when ``name`` is a generative model, else None."""
        ...

    async def generate_text(
        self, request: TextRequest, *, timeout_s: float | None, sink: Sink | None = None
    ) -> Generation: ...


@dataclass(frozen=True, kw_only=True)
class Generation:
    """What the client gets: the text, where it came from, how sure, and how it went."""

    text: str
    tokens: tuple[Token, ...]
    tier: Tier
    agent: str
    variant: str
    confidence: float
    finish_reason: str
    path: tuple[Tier, ...]
    timings_ms: dict[Tier, float]
    degraded: bool = False
    generated: dict[Tier, int] = field(default_factory=dict)  # tokens each tier made, cancelled ones too
    precision: str = ""  # of the variant that answered, where it is known
    prompt_tokens: int | None = None  # the answering tier's count; None where it did not say
    completion_tokens: int = 0  # tokens the answering tier generated for this answer
    chat_template: bool | None = None  # a chat's: the answering tier rendered it (else its last user message)


@dataclass
class _Arriving:
    """One tier's answer as its tokens arrive: cut at a stop string, judged on what is kept."""

    running: RunningConfidence
    cut: StopCut
    made: int = 0  # tokens received, kept or not

    def add(self, tokens: Sequence[Token]) -> tuple[Token, ...]:
        """The tokens now settled (to show, where this tier is final)."""
        self.made += len(tokens)
        kept = self.cut.feed(tokens)
        self.running.add(kept)
        return kept

    def finish(self) -> tuple[Token, ...]:
        kept = self.cut.finish()
        self.running.add(kept)
        return kept

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.running.tokens)


class _Hopeless(Exception):
    """The answer being generated can no longer be accepted on its tier."""


@dataclass
class GenerationCascade:
    """Performs one generative request's climb; :mod:`router.policy.climb` decides it."""

    context: CascadeContext
    family: FamilyDescription
    request: pb.ModelInferRequest  # text_input and the generation's settings, checked
    options: RequestOptions
    budget_ms: float
    started: float
    sink: Sink | None = None  # receives what the client may see, as it is settled
    stops: tuple[str, ...] = ()  # the family's and the request's
    label: str = ""  # the family its metrics count it under
    path: list[Tier] = field(default_factory=list)
    timings: dict[Tier, float] = field(default_factory=dict)
    state: ClimbState = field(default_factory=ClimbState)
    thresholds: dict[Tier, float] = field(init=False)  # the family's, by tier
    generated: dict[Tier, int] = field(default_factory=dict)
    climbed: list[Generation] = field(default_factory=list)  # unsure answers climbed past (for audits)
    shown_any: bool = False  # the client has seen text: a failure now cannot be retried unseen

    def _count(self, tier: Tier, tokens: int) -> None:
        self.generated[tier] = self.generated.get(tier, 0) + tokens

    @property
    def method(self) -> GenerationMethod:
        generation = self.family.generation
        return generation.method if generation is not None else GenerationMethod.MEAN_LOGPROB

    def _arriving(self) -> _Arriving:
        return _Arriving(running=RunningConfidence(self.method), cut=StopCut(self.stops))

    def __post_init__(self) -> None:
        self.state.min_tier, self.state.max_tier = self.options.min_tier, self.options.max_tier
        self.thresholds = dict(self.family.thresholds)

    def remaining_ms(self) -> float:
        return self.budget_ms - (self.context.now() - self.started) * 1000.0

    def accepts(self, answer: Generation) -> bool:
        return accepts(
            answer.confidence,
            answer.tier,
            thresholds=self.thresholds,
            min_confidence=self.options.min_confidence,
        )

    async def run(self) -> Generation:
        best: Generation | None = None
        model = self.request.model_name  # the family, or a pinned variant
        while (remaining := self.remaining_ms()) > 0:
            snapshot = self.context.snapshot(model)
            action = next_action(self.state, self.state.attempt(model, remaining), snapshot, self.context.rng)
            if not isinstance(action, Dispatch):
                break
            answer = await self._step(action, snapshot, remaining)
            if answer is None:
                continue
            if action.final or self.accepts(answer):
                sure = self.accepts(answer)
                if not action.final:
                    await self._show(answer.tokens)  # held until now: accepted, so shown
                nowhere = not sure and self._nowhere_higher(snapshot, answer.tier)
                return dataclasses.replace(answer, degraded=nowhere, generated=dict(self.generated))
            self.climbed.append(answer)
            best = answer if best is None or answer.tier >= best.tier else best
        end = finish(
            self.state,
            answered=best is not None,
            unsure="the answer was still unsure" if best is not None else "",
            budget_ms=self.budget_ms,
            cloud=cloud_facts(self.context, model),
        )
        if best is None or not isinstance(end, Degrade):
            assert isinstance(end, Fail)
            raise end.error
        await self._show(best.tokens)
        return dataclasses.replace(best, degraded=True, generated=dict(self.generated))

    async def _step(self, action: Dispatch[Backend], snapshot: FleetSnapshot[Backend], remaining: float) -> Generation | None:
        """Generate on the tier the climb chose; None when it failed (the climb retries)."""
        target = action.target
        if action.escalation is not None:
            step = action.escalation
            self.context.observer.escalated(self.label, step.left, step.to, step.reason)
        watch = self._can_climb(snapshot, target.tier)
        answer = await self._try(target, remaining, final=action.final, watch=watch)
        if answer is not None:
            after_answer(self.state, answer.tier)
        return answer

    def _nowhere_higher(self, snapshot: FleetSnapshot[Backend], tier: Tier) -> bool:
        """An unsure final answer is degraded where no tier above serves the family, as for
        classifiers; not where ``stratus.max_tier`` kept it low (the client asked for that)."""
        if self.request.model_name != self.family.name or tier >= Tier.CLOUD:
            return False  # a pinned variant's answer is final by the client's choice
        higher = top_tier(snapshot, Tier.CLOUD)
        return higher is None or higher <= tier

    def _can_climb(self, snapshot: FleetSnapshot[Backend], tier: Tier) -> bool:
        """Something above ``tier`` could take the request now: only then is a lower tier's
        generation worth cancelling early (else its answer, however unsure, is the best)."""
        return any(
            tier < t <= self.options.max_tier and any(target.ready for target in pool)
            for t, pool in snapshot.pools.items()
        )

    async def _show(self, tokens: Sequence[Token]) -> None:
        """A held answer, shown once the climb ends on it (nothing is tried after: shown_any stays)."""
        if self.sink is not None and tokens:
            await self.sink(Chunk(tokens=tuple(tokens)))

    async def _try(self, target: Target[Backend], remaining: float, *, final: bool, watch: bool) -> Generation | None:
        self.path.append(target.tier)
        started = self.context.now()
        try:
            answer = await self._run(target, remaining, final=final, watch=watch)
        except _Hopeless:
            log.debug("%s: %s answer gave up early", self.request.id, target.tier.label)
            answer = None
        except StratusError as exc:
            if not retryable(exc):
                raise
            if self.shown_any:  # another agent's text after this one's would read as one answer
                log.info("%s failed a generation after the client saw part of it: %s", target.id, exc)
                raise
            log.info("%s failed a generation: %s", target.id, exc)
            after_failure(self.state, target, exc)
            self.path.pop()
            return None
        finally:
            elapsed = (self.context.now() - started) * 1000.0
            self.timings[target.tier] = self.timings.get(target.tier, 0.0) + elapsed
        if answer is not None:
            return dataclasses.replace(answer, timings_ms=dict(self.timings), generated=dict(self.generated))
        return Generation(  # hopeless: climb from this tier
            text="",
            tokens=(),
            tier=target.tier,
            agent=target.id,
            variant="",
            confidence=0.0,
            finish_reason="cancelled",
            path=tuple(self.path),
            timings_ms=dict(self.timings),
            generated=dict(self.generated),
        )

    async def _run(self, target: Target[Backend], remaining: float, *, final: bool, watch: bool) -> Generation:
        """Generate on ``target``: its chunks shown as they come when it is the final tier;
        cancelled once hopeless when ``watch`` (something above could still take it)."""
        answer = self._arriving()
        threshold = threshold_for(target.tier, self.thresholds, self.options.min_confidence)
        shown: asyncio.Queue[Chunk | None] = asyncio.Queue()
        work = asyncio.current_task()

        def show(kept: tuple[Token, ...]) -> None:
            if final and kept:
                shown.put_nowait(Chunk(tokens=kept))

        def on_chunk(chunk: Chunk) -> None:
            show(answer.add(chunk.tokens))
            gone = threshold is not None and answer.running.hopeless(threshold)
            if not final and watch and gone and work is not None:
                work.cancel(msg="hopeless")

        pump = None
        if final and self.sink is not None:
            pump = asyncio.create_task(self._pump(shown), name="stratus-generation-pump")
        prompt_tokens = completion_tokens = None
        try:
            result = await target.candidate.generate(self.request, on_chunk, budget_ms=remaining)
            show(answer.finish())
            said = result.said
            prompt_tokens, completion_tokens = read_usage(said)
        except asyncio.CancelledError as exc:
            if exc.args == ("hopeless",) and asyncio.current_task() is work:
                work.uncancel()  # type: ignore[union-attr]
                raise _Hopeless from None
            raise
        finally:
            completion_tokens = max(completion_tokens or 0, answer.made)
            self._count(target.tier, completion_tokens)
            shown.put_nowait(None)
            if pump is not None:
                await pump
        # The target's own confidence is of the same tokens, unless a stop string cut them.
        own = None if answer.cut.stopped else result.confidence
        return Generation(
            text=answer.text,
            tokens=tuple(answer.running.tokens),
            tier=target.tier,
            agent=result.agent,
            variant=result.variant,
            precision=result.precision,
            confidence=answer.running.value if own is None else own,
            finish_reason="stop" if answer.cut.stopped else _finish_reason(said),
            path=tuple(self.path),
            timings_ms=dict(self.timings),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            chat_template=chat_templated(said, asked=MESSAGES in self.request.parameters),
        )

    async def _pump(self, shown: asyncio.Queue[Chunk | None]) -> None:
        assert self.sink is not None
        while (chunk := await shown.get()) is not None:
            self.shown_any = True
            await self.sink(chunk)


def _finish_reason(said: Mapping[str, ParameterValue | None]) -> str:
    """Why the target stopped, as it said (a foreign one that says nothing: it stopped)."""
    reason = said.get(FINISH_REASON)
    return reason if isinstance(reason, str) and reason else "stop"


def generation_values(result: Generation) -> dict[str, ParameterValue]:
    """Where the text came from and how sure, as response parameters (``stratus.*``)."""
    values = Served(
        tier=result.tier,
        agent=result.agent,
        variant=result.variant,
        precision=result.precision,
        confidence=result.confidence,
        path=result.path,
        degraded=result.degraded,
        timings_ms=result.timings_ms,
    ).values()
    values[FINISH_REASON] = result.finish_reason
    if result.chat_template is not None:
        values[CHAT_TEMPLATE] = result.chat_template
    answer = Chunk(
        tokens=result.tokens, prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens
    )
    values.update(answer.parameters())
    values.update(answer.usage())
    return values
