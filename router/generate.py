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
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.policy import Attempt, FleetSnapshot, NoTarget, Target, choose, top_tier
from stratus.errors import DeadlineExceeded, Overloaded, StratusError, Unavailable
from stratus.generation import (
    FINISH_REASON,
    Chunk,
    GenerationMethod,
    RunningConfidence,
    StopCut,
    Token,
)
from stratus.protocol import CONFIDENCE, PRECISION, VARIANT, RequestOptions, parameter_value
from stratus.text_wire import read_usage
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb

if TYPE_CHECKING:
    from router.dataplane import RouterDataPlane

log = logging.getLogger("stratus.generate")

Sink = Callable[[Chunk], Awaitable[None]]
_RETRYABLE = (Unavailable, Overloaded, DeadlineExceeded)


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
    plane: RouterDataPlane
    family: fpb.FamilyInfo
    request: pb.ModelInferRequest  # text_input and the generation's settings, checked
    options: RequestOptions
    budget_ms: float
    started: float
    sink: Sink | None = None  # receives what the client may see, as it is settled
    stops: tuple[str, ...] = ()  # the family's and the request's
    path: list[Tier] = field(default_factory=list)
    timings: dict[Tier, float] = field(default_factory=dict)
    exclude: set[str] = field(default_factory=set)
    problem: StratusError | None = None
    generated: dict[Tier, int] = field(default_factory=dict)
    climbed: list[Generation] = field(default_factory=list)  # unsure answers climbed past (for audits)

    def _count(self, tier: Tier, tokens: int) -> None:
        self.generated[tier] = self.generated.get(tier, 0) + tokens

    @property
    def method(self) -> GenerationMethod:
        return GenerationMethod(self.family.confidence_method or GenerationMethod.MEAN_LOGPROB.value)

    def _arriving(self) -> _Arriving:
        return _Arriving(running=RunningConfidence(self.method), cut=StopCut(self.stops))

    def remaining_ms(self) -> float:
        return self.budget_ms - (self.plane._clock() - self.started) * 1000.0

    def threshold(self, tier: Tier) -> float:
        if self.options.min_confidence is not None:
            return self.options.min_confidence
        return float(self.family.thresholds.get(tier.label, 0.0))

    async def run(self) -> Generation:
        best: Generation | None = None
        above: Tier | None = None
        while (remaining := self.remaining_ms()) > 0:
            model = self.request.model_name  # the family, or a pinned variant
            snapshot = self.plane.snapshot(model)
            attempt = Attempt(
                model=model,
                remaining_ms=remaining,
                min_tier=self.options.min_tier,
                max_tier=self.options.max_tier,
                above=above,
                exclude=frozenset(self.exclude),
            )
            target = choose(attempt, snapshot, self.plane._rng)
            if isinstance(target, NoTarget):
                if self.problem is None:
                    kind = Overloaded if target.full else DeadlineExceeded if target.too_slow else Unavailable
                    self.problem = kind(target.reason)
                break
            top = top_tier(snapshot, self.options.max_tier)
            final = top is None or target.tier >= top
            answer = await self._try(
                target, remaining, final=final, watch=self._can_climb(snapshot, target.tier)
            )
            if answer is None:
                continue
            above = answer.tier
            if final or answer.confidence >= self.threshold(answer.tier):
                if not final:
                    await self._show(answer.tokens)  # held until now: accepted, so shown
                return dataclasses.replace(answer, generated=dict(self.generated))
            self.climbed.append(answer)
            best = answer if best is None or answer.tier >= best.tier else best
        if best is None:
            raise self.problem or DeadlineExceeded(
                f"budget of {self.budget_ms:.1f} ms ran out before any tier answered"
            )
        if self.plane.fail_without_cloud and self.plane.cloud is not None and Tier.CLOUD not in self.path:
            raise Unavailable(
                f"the cloud is unavailable ({self.plane.cloud.status}) and the router runs with "
                "--on-cloud-failure fail; the answer was still unsure"
            )
        await self._show(best.tokens)
        return dataclasses.replace(best, degraded=True, generated=dict(self.generated))

    def _can_climb(self, snapshot: FleetSnapshot, tier: Tier) -> bool:
        """Something above ``tier`` could take the request now: only then is a lower tier's
        generation worth cancelling early (else its answer, however unsure, is the best)."""
        if any(t > tier and t <= self.options.max_tier for t, pool in snapshot.pools.items() if pool):
            return True
        cloud = snapshot.cloud
        return bool(cloud and cloud.available and cloud.serves and tier < Tier.CLOUD <= self.options.max_tier)

    async def _show(self, tokens: Sequence[Token]) -> None:
        if self.sink is not None and tokens:
            await self.sink(Chunk(tokens=tuple(tokens)))

    async def _try(self, target: Target, remaining: float, *, final: bool, watch: bool) -> Generation | None:
        self.path.append(target.tier)
        started = self.plane._clock()
        try:
            if target.agent_id is None:
                answer = await self._on_cloud(remaining, final=final)
            else:
                answer = await self._on_agent(target, remaining, final=final, watch=watch)
        except _Hopeless:
            log.debug("%s: %s answer gave up early", self.request.id, target.tier.label)
            answer = None
        except _RETRYABLE as exc:
            log.info("%s failed a generation: %s", target.agent_id or "cloud", exc)
            self.exclude.add(target.agent_id or "cloud")
            self.problem = exc
            self.path.pop()
            return None
        finally:
            elapsed = (self.plane._clock() - started) * 1000.0
            self.timings[target.tier] = self.timings.get(target.tier, 0.0) + elapsed
        if answer is not None:
            return dataclasses.replace(answer, timings_ms=dict(self.timings), generated=dict(self.generated))
        return Generation(  # hopeless: climb from this tier
            text="",
            tokens=(),
            tier=target.tier,
            agent=target.agent_id or "cloud",
            variant="",
            confidence=0.0,
            finish_reason="cancelled",
            path=tuple(self.path),
            timings_ms=dict(self.timings),
            generated=dict(self.generated),
        )

    async def _on_agent(self, target: Target, remaining: float, *, final: bool, watch: bool) -> Generation:
        assert target.agent_id is not None
        handle = self.plane.registry.agents[target.agent_id]
        answer = self._arriving()
        threshold = self.threshold(target.tier)
        shown: asyncio.Queue[Chunk | None] = asyncio.Queue()
        work = asyncio.current_task()

        def show(kept: tuple[Token, ...]) -> None:
            if final and kept:
                shown.put_nowait(Chunk(tokens=kept))

        def on_chunk(message: fpb.Chunk) -> None:
            show(answer.add(_from_wire(message).tokens))
            if not final and watch and answer.running.hopeless(threshold) and work is not None:
                work.cancel(msg="hopeless")

        pump = asyncio.create_task(self._pump(shown)) if final and self.sink is not None else None
        prompt_tokens = completion_tokens = None
        try:
            result = await self.plane.registry.generate(
                handle, self.request, budget_ms=remaining, on_chunk=on_chunk
            )
            show(answer.finish())
            prompt_tokens, completion_tokens = read_usage(result.response.parameters)
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
        judged_here = answer.cut.stopped or not result.confidences  # else the agent's own, on the same tokens
        return Generation(
            text=answer.text,
            tokens=tuple(answer.running.tokens),
            tier=target.tier,
            agent=handle.id,
            variant=result.variant,
            precision=handle.precision_of(result.variant),
            confidence=answer.running.value if judged_here else result.confidence,
            finish_reason="stop" if answer.cut.stopped else _finish_reason(result.response),
            path=tuple(self.path),
            timings_ms=dict(self.timings),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )

    async def _pump(self, shown: asyncio.Queue[Chunk | None]) -> None:
        assert self.sink is not None
        while (chunk := await shown.get()) is not None:
            await self.sink(chunk)

    async def _on_cloud(self, remaining: float, *, final: bool) -> Generation:
        """The cloud streams its answer: shown as it comes when it is the final tier."""
        cloud = self.plane.cloud
        assert cloud is not None
        answer = self._arriving()

        async def on_chunk(chunk: Chunk) -> None:
            kept = answer.add(chunk.tokens)
            if final:
                await self._show(kept)

        prompt_tokens = completion_tokens = None
        try:
            response = await cloud.generate(self.request, on_chunk, timeout_s=remaining / 1000.0)
            kept = answer.finish()
            if final:
                await self._show(kept)
            prompt_tokens, completion_tokens = read_usage(response.parameters)
        finally:
            completion_tokens = max(completion_tokens or 0, answer.made)
            self._count(Tier.CLOUD, completion_tokens)
        params = response.parameters
        said = not answer.cut.stopped and CONFIDENCE in params  # the cloud's own, on the same tokens
        confidence = parameter_value(params[CONFIDENCE]) if said else answer.running.value
        variant = parameter_value(params[VARIANT]) if VARIANT in params else self.family.name
        precision = parameter_value(params[PRECISION]) if PRECISION in params else ""
        return Generation(
            text=answer.text,
            tokens=tuple(answer.running.tokens),
            tier=Tier.CLOUD,
            agent=f"cloud@{cloud.address}",
            variant=str(variant),
            precision=str(precision),
            confidence=float(confidence or 0.0),
            finish_reason="stop" if answer.cut.stopped else _finish_reason(response),
            path=tuple(self.path),
            timings_ms=dict(self.timings),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )


def _from_wire(message: fpb.Chunk) -> Chunk:
    margins = list(message.margins)
    tokens = tuple(
        Token(
            text=message.text if index == 0 else "",
            logprob=logprob,
            margin=None if index >= len(margins) or math.isnan(margins[index]) else margins[index],
        )
        for index, logprob in enumerate(message.logprobs)
    )
    return Chunk(tokens=tokens or (Token(text=message.text, logprob=0.0),))


def _finish_reason(response: pb.ModelInferResponse) -> str:
    parameter = response.parameters.get(FINISH_REASON)
    return parameter.string_param if parameter is not None and parameter.string_param else "stop"
