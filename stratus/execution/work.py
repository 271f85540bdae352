"""One Work, answered: run it on the local models within its budget and send back the
Result (and, for generative Work, its Chunks as they come). Kept apart from the link so
that what an answer is does not depend on how it travels."""

from __future__ import annotations

import asyncio
import logging

import grpc

from stratus.convert.errors import status_label, status_of
from stratus.convert.fleet import chunk_to_wire
from stratus.convert.inference import InferRequest
from stratus.convert.work import failed_to_wire, result_to_wire
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
    ran: VariantSpec | None = None
    outcome = "ok"
    try:
        result, ran = await _run(models, agent_name, work, outbox)
    except asyncio.CancelledError:
        outcome = status_label(grpc.StatusCode.CANCELLED)
        result = failed_to_wire(work.request_id, grpc.StatusCode.CANCELLED, "cancelled by the router")
    except Exception as exc:
        if not isinstance(exc, StratusError):
            log.exception("work %s failed", work.request_id)
        code, message = status_of(exc)
        outcome = status_label(code)
        result = failed_to_wire(work.request_id, code, message)
    models.count(outcome, work.request.model_name, ran)
    outbox.put_nowait(fpb.AgentMessage(result=result))


async def _run(models: LocalModels, agent_name: str, work: fpb.Work, outbox: Outbox) -> tuple[fpb.Result, VariantSpec]:
    """Run the Work's items (maybe in one batch with other Work) within its budget; a
    generative Work sends its tokens as Chunks while it runs, then the Result. Returns
    the Result and the variant that ran."""
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
    result = result_to_wire(
        work.request_id,
        variant=answer.variant.name,
        answer=answer.result,
        confidences=answer.confidences,
        service_ms=answer.service_ms,
        queue_ms=answer.queue_ms,
        batch_size=answer.batch_size,
    )
    # Over the router's message limit the Result would end the link and every Work on it.
    check_fits(result.ByteSize(), f"agent {agent_name}'s answer")
    return result, answer.variant
