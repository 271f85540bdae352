"""A Work's Result and a reload's answer ⇄ values: read once, where they come off a link.

An agent's Result used to travel on through the router as the message it arrived in: the
Work side, the registry and the generation cascade each asked it their own questions (its
outcome, its outputs, its parameters, its figures), and each cleaned what it read. Here it
is read once, at the link's door, into a :class:`WorkResult`: times an agent reported are
figures statistics may add up, confidences are figures the policy may compare, and an
answer whose outputs cannot be read is an error of the agent's, not the client's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from stratus.convert.errors import error_from_wire, wire_error
from stratus.convert.fleet import reported_time
from stratus.convert.inference import InferResult
from stratus.convert.parameters import values_of
from stratus.convert.tensors import Tensors
from stratus.datatypes import ParameterValue
from stratus.errors import StratusError, Unavailable
from stratus.wire import fleet_pb2 as fpb


@dataclass(frozen=True, kw_only=True)
class WorkResult:
    """An agent's answer to one Work (a batch, or a generation), or the error it failed with."""

    request_id: str
    variant: str = ""
    batch_size: int = 0
    queue_ms: float = 0.0  # at the agent, waiting for a slot
    service_ms: float = 0.0  # at the agent, running the batch
    confidences: tuple[float, ...] = ()  # one per item, each within [0, 1]
    confidence: float = 0.0  # the Work's own (its least sure item's; a generation's)
    outputs: Tensors = field(default_factory=lambda: Tensors(()))
    said: Mapping[str, ParameterValue | None] = field(default_factory=dict)  # the answer's parameters
    error: StratusError | None = None

    @property
    def items(self) -> int:
        """How many items it answered, as its confidences count them (a generation: one)."""
        return max(1, len(self.confidences))

    def item_confidences(self, items: int) -> tuple[float, ...]:
        """One confidence per item: as listed, or the Work's own for each where it listed
        no such number."""
        return self.confidences if len(self.confidences) == items else (self.confidence,) * items


def result_from_wire(message: fpb.Result, peer: str) -> WorkResult:
    """An agent's Result as a value; ``peer`` names the agent in any error it carries."""
    if message.WhichOneof("outcome") == "error":
        return WorkResult(request_id=message.request_id, error=error_from_wire(message.error, peer))
    try:
        outputs = Tensors.from_response(message.response)
    except StratusError as exc:
        return WorkResult(request_id=message.request_id, error=Unavailable(f"{peer} answered what cannot be read: {exc}"))
    return WorkResult(
        request_id=message.request_id,
        variant=message.variant,
        batch_size=message.batch_size,
        queue_ms=reported_time(message.queue_ms),
        service_ms=reported_time(message.service_ms),
        confidences=tuple(_confidence(c) for c in message.confidences),
        confidence=_confidence(message.confidence),
        outputs=outputs,
        said=values_of(message.response.parameters),
    )


def result_to_wire(
    request_id: str,
    *,
    variant: str,
    answer: InferResult,
    confidences: Sequence[float],
    service_ms: float,
    queue_ms: float,
    batch_size: int,
) -> fpb.Result:
    """What an agent sends for Work it answered: what :func:`result_from_wire` reads back."""
    return fpb.Result(
        request_id=request_id,
        variant=variant,
        response=answer.to_wire(),
        confidence=min(confidences, default=1.0),
        confidences=confidences,
        service_ms=service_ms,
        queue_ms=queue_ms,
        batch_size=batch_size,
    )


def failed_to_wire(request_id: str, code: grpc.StatusCode, message: str) -> fpb.Result:
    """What an agent sends for Work that failed: the status it failed with
    (:func:`~stratus.convert.errors.status_of` names an exception's)."""
    return fpb.Result(request_id=request_id, error=wire_error(code, message))


def _confidence(value: float) -> float:
    """An agent's confidence as the policy may compare it: within [0, 1], NaN as 0 (unsure)."""
    return 0.0 if math.isnan(value) else min(1.0, max(0.0, value))


@dataclass(frozen=True, kw_only=True)
class Reloaded:
    """How a reload went (an agent's, a cloud gateway's): what it serves now."""

    ok: bool
    message: str
    variants: tuple[str, ...] = ()


def reloaded_from_wire(message: fpb.ReloadResponse) -> Reloaded:
    return Reloaded(ok=message.ok, message=message.message, variants=tuple(message.variants))


def reloaded_to_wire(reloaded: Reloaded) -> fpb.ReloadResponse:
    return fpb.ReloadResponse(ok=reloaded.ok, message=reloaded.message, variants=reloaded.variants)
