"""The cloud gateway's data plane for a generative family served by an upstream vLLM.

Requests for the family (or for the upstream model's own name) go to the upstream; every
other request goes to the gateway's local models. A prompt arrives as Triton's vLLM
backend takes it: a BYTES input ``text_input`` of shape [1], its settings as parameters
(``max_tokens``...) or in a ``sampling_parameters`` input (:mod:`stratus.families.sampling`).
``infer`` answers with the whole text at once; ``generate`` (a ModelStreamInfer request
with ``stream`` true) with one response per chunk, the last marked
``triton_final_response`` and carrying the upstream's token counts. Either is cut at the
first stop string here, whatever the upstream did with it. Every answer carries the
upstream's queue as ``stratus.queue``, so a router can predict how long the cloud will take.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Final

from cloud_gateway.upstream import OpenAIUpstream
from stratus.convert.inference import InferRequest, InferResult
from stratus.convert.parameters import Served
from stratus.convert.text import chunk_result, generative_config, generative_metadata, read_generation
from stratus.errors import InvalidInput, NotFound, StratusError
from stratus.families.generation import (
    FINAL,
    TEXT_OUTPUT,
    Chunk,
    GenerationMethod,
    GenerationParams,
    StopCut,
    Token,
    confidence_of,
)
from stratus.obs.metrics import GenerationTiming, Metric, ModelMetrics, counted, gauge, outcome_of
from stratus.serving.servicer import DataPlane
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb

QUEUE: Final = "stratus.queue"  # response parameter: requests the upstream holds (waiting + running)
PLATFORM: Final = "vllm"


@dataclass(frozen=True, kw_only=True)
class GenerativeModel:
    """The generative family the upstream serves, and how its requests generate by default."""

    family: str
    variant: str  # the upstream's model name
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    method: GenerationMethod = GenerationMethod.MEAN_LOGPROB

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")

    @property
    def names(self) -> list[str]:
        return sorted({self.family, self.variant})


class UpstreamDataPlane(DataPlane):
    """The upstream's generative family, in front of the local data plane (if any)."""

    def __init__(
        self,
        upstream: OpenAIUpstream,
        model: GenerativeModel,
        *,
        local: DataPlane | None,
        name: str,
        recorder: ModelMetrics | None = None,
    ) -> None:
        self.upstream = upstream
        self.model = model
        self.local = local
        self.name = name
        self.recorder = recorder

    def _serves(self, name: str) -> bool:
        return name in (self.model.family, self.model.variant)

    def _local(self, name: str) -> DataPlane:
        if self.local is None:
            raise NotFound(f"model '{name}' is not served here; serving {self.model_names()}")
        return self.local

    def ready(self) -> bool:
        return self.upstream.healthy and (self.local is None or self.local.ready())

    def model_ready(self, name: str) -> bool:
        if self._serves(name):
            return self.upstream.healthy
        return self.local is not None and self.local.model_ready(name)

    def model_names(self) -> list[str]:
        return sorted({*self.model.names, *(self.local.model_names() if self.local else [])})

    def model_metadata(self, name: str) -> pb.ModelMetadataResponse:
        if not self._serves(name):
            return self._local(name).model_metadata(name)
        return generative_metadata(name, PLATFORM)

    def model_config(self, name: str) -> pb.ModelConfig:
        if not self._serves(name):
            return self._local(name).model_config(name)
        return generative_config(name, PLATFORM, self.model.max_tokens, variant=self.model.variant)

    async def infer(self, request: InferRequest, *, timeout_s: float | None) -> InferResult:
        if not self._serves(request.model_name):
            return await self._local(request.model_name).infer(request, timeout_s=timeout_s)
        with counted(self._count):
            prompt, params = self._parse(request)
            started, made = time.perf_counter(), 0
            try:
                whole = await self.upstream.complete(prompt, params, timeout_s=timeout_s)
                cut = StopCut(params.stop)
                chunk = _cut_final(whole, cut.feed(whole.tokens) + cut.finish(), cut)
                made = len(chunk.tokens)
            finally:  # the whole text comes at once: no first token to time apart
                self._record(started, None, made)
        result = self._result(request, chunk)
        result.parameters.update(self._served(chunk.tokens, started).values())
        return result

    def generate(self, request: InferRequest, *, timeout_s: float | None) -> AsyncIterator[InferResult]:
        if not self._serves(request.model_name):
            return self._local(request.model_name).generate(request, timeout_s=timeout_s)
        try:
            prompt, params = self._parse(request)  # a bad request is refused before anything is sent
        except StratusError as exc:
            self._count(outcome_of(exc))
            raise
        return self._generate(request, prompt, params, timeout_s)

    async def _generate(
        self, request: InferRequest, prompt: str, params: GenerationParams, timeout_s: float | None
    ) -> AsyncIterator[InferResult]:
        started = time.perf_counter()
        first: float | None = None
        tokens: list[Token] = []
        cut = StopCut(params.stop)
        try:
            with counted(self._count):
                async for chunk in self.upstream.stream(prompt, params, timeout_s=timeout_s):
                    kept = cut.feed(chunk.tokens)
                    if first is None and kept:
                        first = time.perf_counter() - started
                    if chunk.finish_reason is None:
                        tokens.extend(kept)
                        if kept:
                            yield self._result(request, Chunk(tokens=kept))
                        continue
                    ending = _cut_final(chunk, kept + cut.finish(), cut)  # the upstream's last event
                    tokens.extend(ending.tokens)
                    result = self._result(request, ending)
                    result.parameters[FINAL] = True
                    result.parameters.update(self._served(tokens, started).values())
                    yield result
                    return
        finally:
            self._record(started, first, len(tokens))

    def _count(self, outcome: str) -> None:
        if self.recorder is not None:
            self.recorder.count_work(self.model.family, self.model.variant, outcome)

    def _record(self, started: float, first_token_s: float | None, tokens: int) -> None:
        """One generation's times and tokens; its queue is the upstream's own, not known here."""
        if self.recorder is not None:
            timing = GenerationTiming(
                queued_s=None,
                first_token_s=first_token_s,
                running_s=time.perf_counter() - started,
                tokens=tokens,
            )
            self.recorder.record_generation(self.model.family, self.model.variant, timing)

    def _parse(self, request: InferRequest) -> tuple[str, GenerationParams]:
        wanted = [name for name in request.outputs if name != TEXT_OUTPUT]
        if wanted:
            raise InvalidInput(
                f"model '{request.model_name}' has no output {wanted}; it gives ['{TEXT_OUTPUT}']"
            )
        prompt, params = read_generation(request, request.model_name, self.model.max_tokens)
        return prompt, params.stopping_also_at(self.model.stop)

    def _result(self, request: InferRequest, chunk: Chunk) -> InferResult:
        result = chunk_result(request, chunk)
        result.parameters[QUEUE] = self.upstream.load.queue
        return result

    def _served(self, tokens: Sequence[Token], started: float) -> Served:
        """Who answered, and how sure the whole answer is."""
        return Served(
            tier=Tier.CLOUD,
            agent=self.name,
            variant=self.model.variant,
            confidence=confidence_of(tokens, self.model.method),
            path=(Tier.CLOUD,),
            timings_ms={Tier.CLOUD: (time.perf_counter() - started) * 1000.0},
        )

    def levels(self) -> list[Metric]:
        """The upstream's queue, read at each scrape."""
        load = self.upstream.load
        samples: list[tuple[list[str], float]] = [(["waiting"], load.waiting), (["running"], load.running)]
        return [
            gauge(
                "stratus_upstream_requests",
                "Requests the upstream server holds, by state.",
                ["state"],
                samples,
            )
        ]


def _cut_final(chunk: Chunk, kept: tuple[Token, ...], cut: StopCut) -> Chunk:
    """The upstream's last chunk with the tokens kept of it; "stop" where a stop string cut it."""
    reason = "stop" if cut.stopped else chunk.finish_reason
    return dataclasses.replace(chunk, tokens=kept, finish_reason=reason)
