"""fleet.proto's messages ⇄ domain types."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from stratus.errors import InvalidInput
from stratus.families.confidence import ConfidenceMethod
from stratus.families.generation import Chunk, Token
from stratus.families.spec import ConfidenceSpec, FamilySpec, TensorSpec
from stratus.obs.stats import LatencySummary
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb


def wire_tier(tier: Tier | None) -> fpb.Tier.ValueType:
    """:meth:`Tier.to_wire` in the stubs' type; None is TIER_UNSPECIFIED (a request that
    names no tier)."""
    return fpb.Tier.ValueType(tier.to_wire()) if tier is not None else fpb.TIER_UNSPECIFIED


def tier_label(value: int, unknown: str = "unknown") -> str:
    """A tier a router reported, as an operator reads it; one this version does not know
    (a newer router's) is shown as ``unknown``, not refused, so the rest of the table shows."""
    try:
        return Tier.from_wire(value).label
    except InvalidInput:
        return unknown


def thresholds_from_wire(thresholds: Mapping[str, float], where: str) -> dict[Tier, float]:
    """FamilyInfo.thresholds, keyed on the wire by tier label, read once at the Hello that
    brings them; a key that names no tier refuses the Hello, saying ``where``."""
    try:
        return {Tier.parse(name): value for name, value in thresholds.items()}
    except InvalidInput as exc:
        raise InvalidInput(f"{where}: thresholds: {exc}") from None


def thresholds_to_wire(thresholds: Mapping[Tier, float]) -> dict[str, float]:
    return {tier.label: value for tier, value in thresholds.items()}


def latency_to_wire(variant: str, summary: LatencySummary) -> fpb.LatencyEstimate:
    return fpb.LatencyEstimate(
        variant=variant,
        mean_ms=summary.mean_ms,
        p50_ms=summary.p50_ms,
        p99_ms=summary.p99_ms,
        count=summary.count,
    )


def latency_from_wire(estimate: fpb.LatencyEstimate) -> LatencySummary:
    """A heartbeat's estimate for one variant, as figures the router may add and compare: a
    time that is NaN, infinite or negative reads as 0 (unknown)."""
    return LatencySummary(
        mean_ms=_time(estimate.mean_ms),
        p50_ms=_time(estimate.p50_ms),
        p99_ms=_time(estimate.p99_ms),
        count=estimate.count,
    )


def _time(ms: float) -> float:
    return ms if math.isfinite(ms) and ms > 0 else 0.0


def chunk_to_wire(request_id: str, chunk: Chunk) -> fpb.Chunk:
    """A generative Work's tokens so far; a margin the runtime did not give travels as NaN."""
    return fpb.Chunk(
        request_id=request_id,
        text=chunk.text,
        logprobs=[t.logprob for t in chunk.tokens],
        margins=[math.nan if t.margin is None else t.margin for t in chunk.tokens],
    )


def chunk_from_wire(message: fpb.Chunk) -> Chunk:
    """The tokens of an agent's Chunk (the text rides on the first; NaN margins are none)."""
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


def family_spec_from_wire(info: fpb.FamilyInfo) -> FamilySpec:
    """A FamilySpec rebuilt from what an agent's Hello said, for the router's input checks and
    metadata (its variants stay the agents': none are named here)."""

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
        thresholds=thresholds_from_wire(info.thresholds, f"family {info.name!r}"),
        variants=(),
        source=Path("<agent>"),
    )
