"""Decision records: which tiers a request tried, what each said, and why the climb stopped.

A record is built for every classifier request from what its cascade saw (one :class:`Hop`
per tier tried, skipped, held back or found unreachable) and is cheap: a few small objects.
It leaves the router two ways:

* in the response, when the client asks (``stratus.explain = true``): one JSON parameter,
  ``stratus.decision``;
* as Parquet beside capture (``--decision-log DIR``): every provisional request's record, and
  a sampled share of the rest (``--decision-log-share``), written on a thread of its own by
  :class:`~stratus.obs.capture.CaptureWriter`, so no request waits on a disk.

Outcomes: ``accepted`` (every item sent was sure), ``unsure`` (some climbed on), ``too_slow``
and ``failed`` (the tier did not answer: another was tried), ``skipped`` (a tier the model has,
passed over: too slow for what was left of the budget, full, or failed for it already),
``held_back`` (the cloud, never sent the family's items: ``[privacy] escalate = false``) and
``unavailable`` (the cloud, unreachable: its breaker open, its link down).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Protocol

from stratus.convert.tensors import Tensors
from stratus.errors import DeadlineExceeded, StratusError
from stratus.tiers import Tier

ACCEPTED: Final = "accepted"
UNSURE: Final = "unsure"
TOO_SLOW: Final = "too_slow"
FAILED: Final = "failed"
SKIPPED: Final = "skipped"
HELD_BACK: Final = "held_back"
UNAVAILABLE: Final = "unavailable"
OUTCOMES: Final = (ACCEPTED, UNSURE, TOO_SLOW, FAILED, SKIPPED, HELD_BACK, UNAVAILABLE)
DETAIL_CHARS: Final = 200  # of an error's message kept in a hop


@dataclass(frozen=True, kw_only=True)
class Hop:
    """One tier's part in a request's climb."""

    tier: str
    outcome: str
    target: str = ""  # the agent (or cloud gateway) tried
    variant: str = ""
    items: int = 0  # sent to it
    unsure: int = 0  # of those, below its threshold
    confidence: float | None = None  # the lowest of its answers' confidences
    threshold: float | None = None  # the tier's escalation threshold in force
    ms: float = 0.0
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One request's record."""

    request_id: str
    family: str
    model: str  # the name the client asked for
    hops: Sequence[Hop]
    final_tier: str
    reason: str  # why it ended where it did ("accepted", or stratus.reason's text)
    degraded: bool
    provisional: bool
    items: int
    total_ms: float
    time_unix: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(as_row(self), separators=(",", ":"), allow_nan=False)


def as_row(decision: Decision) -> dict[str, Any]:
    """The record as plain values (JSON's and Parquet's), with no NaN."""
    row = asdict(decision)
    row["hops"] = [{k: _finite(v) for k, v in asdict(hop).items()} for hop in decision.hops]
    return row


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def answered_hop(
    tier: Tier,
    *,
    target: str,
    variant: str,
    confidences: Sequence[float],
    accepted: Sequence[bool],
    thresholds: Mapping[Tier, float],
    ms: float,
) -> Hop:
    unsure = sum(1 for ok in accepted if not ok)
    return Hop(
        tier=tier.label,
        outcome=UNSURE if unsure else ACCEPTED,
        target=target,
        variant=variant,
        items=len(accepted),
        unsure=unsure,
        confidence=min(confidences, default=None),
        threshold=thresholds.get(tier),
        ms=round(ms, 3),
    )


def failed_hop(tier: Tier, *, target: str, items: int, error: StratusError, ms: float) -> Hop:
    outcome = TOO_SLOW if isinstance(error, DeadlineExceeded) else FAILED
    return Hop(tier=tier.label, outcome=outcome, target=target, items=items, ms=round(ms, 3),
               detail=str(error)[:DETAIL_CHARS])  # fmt: skip


def skipped_hops(tiers: frozenset[Tier], *, lowest: Tier, before: Tier, tried: Sequence[str]) -> list[Hop]:
    """The model's tiers from ``lowest`` up to (not including) the one the climb goes to now
    that have no hop yet: passed over."""
    passed = [t for t in sorted(tiers) if lowest <= t < before and t.label not in tried]
    why = "not tried: too slow for the budget left, full, or failed"
    return [Hop(tier=t.label, outcome=SKIPPED, detail=why) for t in passed]


def cloud_hop(outcome: str, detail: str) -> Hop:
    return Hop(tier=Tier.CLOUD.label, outcome=outcome, detail=detail[:DETAIL_CHARS])


class ClimbedJob(Protocol):
    """What a record reads of the request (router.cascade.classify.Job)."""

    @property
    def family(self) -> str: ...
    @property
    def asked_for(self) -> str: ...
    @property
    def pinned(self) -> str | None: ...
    @property
    def inputs(self) -> Tensors: ...


class Climbed(Protocol):
    """What a record reads of a finished climb (router.cascade.classify.ClassifyCascade)."""

    @property
    def job(self) -> ClimbedJob: ...
    @property
    def hops(self) -> list[Hop]: ...
    @property
    def request_id(self) -> str: ...
    @property
    def tier_label(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def degraded(self) -> bool: ...
    @property
    def provisional(self) -> bool: ...
    def elapsed_ms(self) -> float: ...


def decision_of(climbed: Climbed, *, cloud_held: bool, cloud_away: str) -> Decision:
    """The record of a finished climb; a cloud the climb never reached gets a hop saying why:
    held back (``[privacy] escalate = false``), or ``cloud_away`` (why it was unreachable)."""
    job = climbed.job
    hops = list(climbed.hops)
    if job.pinned is None and Tier.CLOUD.label not in {h.tier for h in hops}:
        if cloud_held:
            hops.append(
                cloud_hop(HELD_BACK, "[privacy] escalate = false: the family's inputs stay on the site")
            )
        elif cloud_away:
            hops.append(cloud_hop(UNAVAILABLE, cloud_away))
    return Decision(
        request_id=climbed.request_id,
        family=job.family,
        model=job.asked_for,
        hops=hops,
        final_tier=climbed.tier_label,
        reason=climbed.reason or "accepted",
        degraded=climbed.degraded,
        provisional=climbed.provisional,
        items=job.inputs.items,
        total_ms=round(climbed.elapsed_ms(), 3),
    )


# -- Parquet -------------------------------------------------------------------------------


def decision_schema() -> Any:
    import pyarrow as pa

    hop = pa.struct(
        [("tier", pa.string()), ("outcome", pa.string()), ("target", pa.string()), ("variant", pa.string()),
         ("items", pa.int64()), ("unsure", pa.int64()), ("confidence", pa.float64()),
         ("threshold", pa.float64()), ("ms", pa.float64()), ("detail", pa.string())]
    )  # fmt: skip
    return pa.schema(
        [("time_unix", pa.float64()), ("request_id", pa.string()), ("family", pa.string()),
         ("model", pa.string()), ("hops", pa.list_(hop)), ("final_tier", pa.string()), ("reason", pa.string()),
         ("degraded", pa.bool_()), ("provisional", pa.bool_()), ("items", pa.int64()), ("total_ms", pa.float64())]
    )  # fmt: skip
