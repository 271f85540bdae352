"""fleet.proto's messages ⇄ domain types."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from stratus.errors import InvalidInput
from stratus.families.audit import AuditSpec, TierCalibration, calibration_info
from stratus.families.confidence import threshold_problem
from stratus.families.description import FamilyDescription
from stratus.families.generation import Chunk, GenerationMethod, Token
from stratus.families.offline import OfflineSpec
from stratus.families.spec import GenerationSpec, ServedFamily, TensorSpec
from stratus.families.suggest import AuditRow, TierAnswer
from stratus.obs.stats import LatencySummary, LoadReport
from stratus.tiers import Tier
from stratus.wire import fleet_pb2 as fpb
from stratus.wire import inference_pb2 as pb


class TensorMetadata(Protocol):
    """A tensor as metadata names it (``ModelMetadataResponse.TensorMetadata``)."""

    @property
    def name(self) -> str: ...

    @property
    def datatype(self) -> str: ...

    @property
    def shape(self) -> Iterable[int]: ...


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
    brings them; a key that names no tier, or a value no cascade compares with (NaN), refuses
    the Hello, saying ``where``."""
    try:
        read = {Tier.parse(name): value for name, value in thresholds.items()}
    except InvalidInput as exc:
        raise InvalidInput(f"{where}: thresholds: {exc}") from None
    for tier, value in read.items():
        problem = threshold_problem(value)
        if problem is not None:
            raise InvalidInput(f"{where}: the {tier.label} threshold {problem}")
    return read


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
        mean_ms=reported_time(estimate.mean_ms),
        p50_ms=reported_time(estimate.p50_ms),
        p99_ms=reported_time(estimate.p99_ms),
        count=estimate.count,
    )


def reported_time(ms: float) -> float:
    """A time a peer reported, as statistics may add it up: NaN, infinite or negative is 0."""
    return ms if math.isfinite(ms) and ms > 0 else 0.0


def heartbeat_to_wire(report: LoadReport) -> fpb.Heartbeat:
    return fpb.Heartbeat(
        in_flight=report.in_flight,
        queue_length=report.queue_length,
        received=report.received,
        latency=[latency_to_wire(variant, summary) for variant, summary in report.latency.items()],
    )


def heartbeat_from_wire(beat: fpb.Heartbeat) -> LoadReport:
    """What :func:`heartbeat_to_wire` wrote (a variant named twice: its last estimate)."""
    return LoadReport(
        in_flight=beat.in_flight,
        queue_length=beat.queue_length,
        received=beat.received,
        latency={estimate.variant: latency_from_wire(estimate) for estimate in beat.latency},
    )


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


def family_to_wire(family: FamilyDescription) -> fpb.FamilyInfo:
    """A family as a Hello describes it (an agent's :func:`~stratus.families.description.described`
    folder): what :func:`family_from_wire` reads back."""
    info = fpb.FamilyInfo(
        name=family.name,
        inputs=tensor_metadata(family.inputs),
        outputs=tensor_metadata(family.outputs),
        thresholds=thresholds_to_wire(family.thresholds),
        cloud_variants=family.cloud_variants,
        calibrated_cloud_share=family.calibrated_cloud_share,
        **family_fields(family),
    )
    if family.generation is not None:
        info.kind = "generative"
        info.confidence_method = family.generation.method.value
        info.max_tokens = family.generation.max_tokens
        info.stop.extend(family.generation.stop)
    return info


def family_fields(family: ServedFamily) -> dict[str, Any]:
    """The FamilyInfo fields for a family's audits and privacy (keyword arguments of its constructor)."""
    audit = fpb.AuditSettings(compare=family.audit.compare, auto=family.audit.auto)
    if family.audit.share is not None:
        audit.share = family.audit.share
    if family.audit.max_per_s is not None:
        audit.max_per_s = family.audit.max_per_s
    calibrated = {tier.label: calibration_info(f) for tier, f in family.tier_accuracy.items()}
    offline = family.offline
    settings = fpb.OfflineSettings(
        defer=offline.defer, max_items=offline.max_items, max_bytes=offline.max_bytes, max_age_s=offline.max_age_s
    )
    return {"audit": audit, "calibrated": calibrated, "keep_on_site": not family.escalate, "offline": settings}


def family_from_wire(info: fpb.FamilyInfo) -> FamilyDescription:
    """What an agent's Hello says of a family, read once, when it arrives; a
    threshold or figure keyed by no tier, or a confidence method this version does not know,
    refuses it."""
    where = f"family {info.name[:64]!r}"
    return FamilyDescription(
        name=info.name,
        inputs=tensor_specs(info.inputs),
        outputs=tensor_specs(info.outputs),
        thresholds=thresholds_from_wire(info.thresholds, where),
        generation=_generation(info, where) if info.kind == "generative" else None,
        cloud_variants=tuple(info.cloud_variants),
        calibrated_cloud_share=info.calibrated_cloud_share if info.HasField("calibrated_cloud_share") else None,
        audit=AuditSpec(
            share=info.audit.share if info.audit.HasField("share") else None,
            max_per_s=info.audit.max_per_s if info.audit.HasField("max_per_s") else None,
            compare=info.audit.compare,
            auto=info.audit.auto,
        ),
        tier_accuracy={_tier(name, where): _calibration(f) for name, f in info.calibrated.items()},
        escalate=not info.keep_on_site,
        offline=_offline(info.offline, where) if info.HasField("offline") else OfflineSpec(),
    )


def _offline(settings: fpb.OfflineSettings, where: str) -> OfflineSpec:
    try:
        return OfflineSpec(
            defer=settings.defer,
            max_items=settings.max_items,
            max_bytes=settings.max_bytes,
            max_age_s=settings.max_age_s,
        )
    except ValueError as exc:
        raise InvalidInput(f"{where}: [offline] {exc}") from None


def tensor_specs(tensors: Iterable[TensorMetadata]) -> tuple[TensorSpec, ...]:
    """Tensors as metadata describes them (a Hello's, a cloud's ModelMetadata)."""
    return tuple(TensorSpec(name=t.name, datatype=t.datatype, shape=tuple(t.shape)) for t in tensors)


def tensor_metadata(specs: Iterable[TensorSpec]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
    """Tensors as metadata describes them: what :func:`tensor_specs` reads back."""
    return [pb.ModelMetadataResponse.TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape) for s in specs]


def _generation(info: fpb.FamilyInfo, where: str) -> GenerationSpec:
    try:
        method = GenerationMethod(info.confidence_method or GenerationMethod.MEAN_LOGPROB.value)
    except ValueError:
        known = [m.value for m in GenerationMethod]
        raise InvalidInput(
            f"{where}: confidence method {info.confidence_method[:32]!r} is not one of {known}"
        ) from None
    return GenerationSpec(max_tokens=info.max_tokens, stop=tuple(info.stop), method=method)


def _tier(name: str, where: str) -> Tier:
    try:
        return Tier.parse(name)
    except InvalidInput as exc:
        raise InvalidInput(f"{where}: calibrated figures: {exc}") from None


def _calibration(figures: fpb.TierCalibration) -> TierCalibration:
    return TierCalibration(
        accuracy=figures.accuracy,
        agreement=figures.agreement if figures.HasField("agreement") else None,
        items=figures.items,
    )


def audit_row_to_wire(row: AuditRow) -> fpb.AuditRow:
    return fpb.AuditRow(
        tiers=[
            fpb.TierAnswer(tier=a.tier.label, confidence=a.confidence, answer=a.answer, agrees=a.agrees)
            for a in row.lower
        ],
        top_tier=row.top.label,
        label=row.label,
    )


def audit_row_from_wire(row: fpb.AuditRow) -> AuditRow:
    """A listed row as a value (an unknown tier name is refused: ConfigError)."""
    return AuditRow(
        lower=tuple(
            TierAnswer(
                tier=Tier.parse(a.tier),
                confidence=a.confidence,
                answer=a.answer,
                agrees=a.agrees if a.HasField("agrees") else None,
            )
            for a in row.tiers
        ),
        top=Tier.parse(row.top_tier),
        label=row.label,
    )
