"""One Work, answered: run it on the local models within its budget and send back the
Result (and, for generative Work, its Chunks as they come). Kept apart from the link so
that what an answer is does not depend on how it travels."""

from __future__ import annotations

import asyncio
import logging

import grpc

from stratus.convert.errors import error_to_wire, wire_error, wire_error_label
from stratus.convert.fleet import chunk_to_wire
from stratus.convert.inference import InferRequest
from stratus.errors import DeadlineExceeded, StratusError
from stratus.execution.local_models import LocalModels
from stratus.families.generation import Chunk
from stratus.families.spec import VariantSpec
from stratus.serving.channels import check_fits
from stratus.wire import fleet_pb2 as fpb

log = logging.getLogger("stratus.agent")

Outbox = asyncio.Queue[fpb.AgentMessage | None]


async def serve_work(models: LocalModels, agent_name: str, work: fpb.Work, outbox: Outbox) -> None:
    """Answer ``work`` and put its Result in ``outbox``, whatever happened: an error, a
    cancel from the router and a bug each become the Result's error, so the router never
    waits on Work that silently died."""
    result = fpb.Result(request_id=work.request_id)
    ran: VariantSpec | None = None
    try:
        ran = await _run(models, agent_name, work, result, outbox)
    except asyncio.CancelledError:
        result.error.CopyFrom(wire_error(grpc.StatusCode.CANCELLED, "cancelled by the router"))
    except StratusError as exc:
        result.error.CopyFrom(error_to_wire(exc))
    except Exception as exc:
        log.exception("work %s failed", work.request_id)
        result.error.CopyFrom(error_to_wire(exc))
    models.count(_outcome(result), work.request.model_name, ran)
    outbox.put_nowait(fpb.AgentMessage(result=result))


async def _run(
    models: LocalModels, agent_name: str, work: fpb.Work, result: fpb.Result, outbox: Outbox
) -> VariantSpec:
    """Run the Work's items (maybe in one batch with other Work) within its budget; a
    generative Work sends its tokens as Chunks while it runs, then the Result. Returns
    the variant that ran."""
    budget_s = work.budget_ms / 1000.0 if work.budget_ms > 0 else None

    async def send(chunk: Chunk) -> None:
        outbox.put_nowait(fpb.AgentMessage(chunk=chunk_to_wire(work.request_id, chunk)))

    request = InferRequest.from_wire(work.request)
    try:
        async with asyncio.timeout(budget_s):
            if models.generates(request.model_name):
                answer = await models.generate(request, send)
            else:
                answer = await models.answer(request)
    except TimeoutError:
        raise DeadlineExceeded(f"agent {agent_name}: budget of {work.budget_ms:.1f} ms ran out") from None
    result.variant = answer.variant.name
    result.response.CopyFrom(answer.result.to_wire())
    result.confidence = answer.confidence
    result.confidences.extend(answer.confidences)
    result.service_ms = answer.service_ms
    result.queue_ms = answer.queue_ms
    result.batch_size = answer.batch_size
    # Over the router's message limit the Result would end the link and every Work on it.
    check_fits(result.ByteSize(), f"agent {agent_name}'s answer")
    return answer.variant


def _outcome(result: fpb.Result) -> str:
    if result.WhichOneof("outcome") != "error":
        return "ok"
    return wire_error_label(result.error)
