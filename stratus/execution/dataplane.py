"""The data plane over the models loaded here: the cloud gateway's, and an agent's
``--serve`` endpoint. It turns ``LocalModels``' answers into inference responses that say
who answered (tier, agent, variant, timings), and streams generative ones token by token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from stratus.convert.fleet import tensor_metadata
from stratus.convert.inference import InferRequest, InferResult
from stratus.convert.parameters import BATCH_SIZE, MODEL_VERSION, VARIANT, Served
from stratus.convert.tensors import MAX_REQUEST_ITEMS
from stratus.convert.text import chunk_result, generative_config, generative_metadata, read_usage
from stratus.errors import DeadlineExceeded
from stratus.execution.local_models import LocalAnswer, LocalModels
from stratus.families.chat import CHAT_TEMPLATE
from stratus.families.generation import FINAL, FINISH_REASON, Chunk
from stratus.families.spec import TensorSpec
from stratus.obs.metrics import counted
from stratus.sched.streams import OnItem, relayed
from stratus.serving.servicer import DataPlane
from stratus.tiers import Tier
from stratus.wire import inference_pb2 as pb


class LocalDataPlane(DataPlane):
    """Serves the variants loaded here: the cloud gateway, and an agent's ``--serve``."""

    def __init__(self, models: LocalModels, *, tier: Tier, name: str) -> None:
        self.models = models
        self.tier = tier
        self.name = name

    def ready(self) -> bool:
        return bool(self.models.runners) or bool(self.models.generators and self.models.generators.runners)

    def model_ready(self, name: str) -> bool:
        return name in self.models.model_names()

    def model_names(self) -> list[str]:
        return self.models.model_names()

    def model_metadata(self, name: str) -> pb.ModelMetadataResponse:
        family, variant = self.models.variant_for(name)
        if family.generative:
            return generative_metadata(name, self._runtime(variant.name))
        return pb.ModelMetadataResponse(
            name=name,
            versions=[MODEL_VERSION],
            platform=self._runtime(variant.name),
            inputs=tensor_metadata(family.inputs),
            outputs=tensor_metadata(family.outputs),
        )

    def model_config(self, name: str) -> pb.ModelConfig:
        family, variant = self.models.variant_for(name)
        if family.generative:
            assert family.generation is not None
            max_tokens = family.generation.max_tokens
            return generative_config(name, self._runtime(variant.name), max_tokens, variant=variant.name)
        config = model_config(family, name, self._runtime(variant.name))
        config.parameters[VARIANT].string_value = variant.name  # the variant that answers ``name`` here
        return config

    def _runtime(self, variant: str) -> str:
        generators = self.models.generators
        if generators is not None and variant in generators.runners:
            return generators.runners[variant].runtime
        return self.models.runners[variant].describe().runtime

    def generate(self, request: InferRequest, *, timeout_s: float | None) -> AsyncIterator[InferResult]:
        if not self.models.generates(request.model_name):
            return super().generate(request, timeout_s=timeout_s)
        return self._generate(request)

    async def _generate(self, request: InferRequest) -> AsyncIterator[InferResult]:
        """Each token as a result as soon as it is made, then a final one with the finish
        reason and who answered; a caller that stops reading stops the generation."""

        async def produce(on_chunk: OnItem[Chunk]) -> LocalAnswer:
            return await self.models.generate(request, on_chunk)

        with counted(lambda outcome: self.models.count(outcome, request.model_name)):
            async with relayed(produce) as relay:
                async for chunk in relay.items():
                    yield chunk_result(request, chunk)
                answer = relay.result()
        reason = answer.result.parameters[FINISH_REASON]
        prompt_tokens, completion_tokens = read_usage(answer.result.parameters)
        ending = Chunk(
            tokens=(),
            finish_reason=str(reason),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )
        final = chunk_result(request, ending)
        final.parameters[FINAL] = True
        final.parameters.update(self._served(answer).values())
        if CHAT_TEMPLATE in answer.result.parameters:  # a chat's: how its prompt was made
            final.parameters[CHAT_TEMPLATE] = answer.result.parameters[CHAT_TEMPLATE]
        yield final

    def _served(self, answer: LocalAnswer) -> Served:
        return Served(
            tier=self.tier,
            agent=self.name,
            variant=answer.variant.name,
            precision=answer.variant.precision,
            compute=self.models.computes.get(answer.variant.name, ""),
            confidence=answer.confidence,
            path=(self.tier,),
            timings_ms={self.tier: answer.service_ms},
            queue_ms=answer.queue_ms,
            compute_ms=answer.service_ms,
        )

    async def infer(self, request: InferRequest, *, timeout_s: float | None) -> InferResult:
        """Answered within the caller's deadline, or DEADLINE_EXCEEDED: a request whose caller
        has given up holds no slot or queue place here."""
        with counted(lambda outcome: self.models.count(outcome, request.model_name)):
            try:
                async with asyncio.timeout(timeout_s):
                    answer = await self.models.answer(request)
            except TimeoutError:
                raise DeadlineExceeded(f"no answer within the caller's deadline ({timeout_s:g} s)") from None
        result = answer.result
        result.parameters.update(self._served(answer).values())
        result.parameters[BATCH_SIZE] = answer.batch_size
        return result


_TYPE_NAMES = {"BOOL": "TYPE_BOOL", "BYTES": "TYPE_STRING"}


class Tensored(Protocol):
    """What has a family's tensors: its spec here, or a router's description of it."""

    @property
    def inputs(self) -> Sequence[TensorSpec]: ...

    @property
    def outputs(self) -> Sequence[TensorSpec]: ...


def model_config(family: Tensored, name: str, backend: str) -> pb.ModelConfig:
    """Triton's ModelConfig for a family: dims without the batch dimension."""

    def data_type(datatype: str) -> pb.DataType.ValueType:
        return pb.DataType.Value(_TYPE_NAMES.get(datatype, f"TYPE_{datatype}"))

    return pb.ModelConfig(
        name=name,
        platform=backend,
        backend=backend,
        max_batch_size=MAX_REQUEST_ITEMS,
        input=[
            pb.ModelInput(name=s.name, data_type=data_type(s.datatype), dims=s.shape[1:])
            for s in family.inputs
        ],
        output=[
            pb.ModelOutput(name=s.name, data_type=data_type(s.datatype), dims=s.shape[1:])
            for s in family.outputs
        ],
    )
