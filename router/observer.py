"""What the router's data plane and cascades tell its metrics, as events.

The cascades and the data plane report what happened (an answer, a refusal, a climb, a
tier's answer, tokens made) to a :class:`RouterObserver`; they never check whether metrics
are on. A router without metrics gets :class:`NullObserver`, which drops every event, so the
code that serves requests has one path whether anything records them or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from stratus.convert.errors import error_label
from stratus.errors import StratusError
from stratus.obs.metrics import Children, RouterMetrics
from stratus.tiers import Tier


class RouterObserver(Protocol):
    """The events the router's request path emits; ``family`` is a bounded metric label."""

    def answered(self, family: str, tier: str, *, degraded: bool, seconds: float) -> None:
        """A request answered from ``tier`` (its highest answering tier), ``seconds`` after admission."""
        ...

    def refused(self, family: str, error: StratusError) -> None:
        """A request that ended in an error, by its gRPC code."""
        ...

    def escalated(self, family: str, left: Tier, to: Tier, reason: str) -> None:
        """A climb from ``left`` to ``to``: "unsure", "failed" or "too_slow"."""
        ...

    def degraded(self, family: str, reason: str) -> None: ...

    def tier_answered(self, family: str, tier: Tier, elapsed_ms: float, confidences: Sequence[float]) -> None:
        """One classifier answer from ``tier``: its time and each item's confidence."""
        ...

    def tier_time(self, family: str, tier: Tier, elapsed_ms: float) -> None: ...

    def tokens(self, family: str, tier: Tier, fate: str, count: int) -> None:
        """Tokens ``tier`` generated, "answered" (the client got them) or "discarded"."""
        ...

    def first_text(self, family: str, seconds: float) -> None: ...

    def rollout_request(self, family: str, tier: Tier, *, candidate: bool, ok: bool) -> None: ...


class NullObserver:
    """Drops every event: the observer of a router that keeps no metrics."""

    def answered(self, family: str, tier: str, *, degraded: bool, seconds: float) -> None:
        pass

    def refused(self, family: str, error: StratusError) -> None:
        pass

    def escalated(self, family: str, left: Tier, to: Tier, reason: str) -> None:
        pass

    def degraded(self, family: str, reason: str) -> None:
        pass

    def tier_answered(self, family: str, tier: Tier, elapsed_ms: float, confidences: Sequence[float]) -> None:
        pass

    def tier_time(self, family: str, tier: Tier, elapsed_ms: float) -> None:
        pass

    def tokens(self, family: str, tier: Tier, fate: str, count: int) -> None:
        pass

    def first_text(self, family: str, seconds: float) -> None:
        pass

    def rollout_request(self, family: str, tier: Tier, *, candidate: bool, ok: bool) -> None:
        pass


class MetricsObserver:
    """Records each event in the router's Prometheus metrics (stratus/obs/metrics.py)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        # the children every answered request records in, kept (stratus.obs.metrics.Children)
        self._requests, self._duration = Children(metrics.requests), Children(metrics.duration)
        self._tier_duration, self._confidence = Children(metrics.tier_duration), Children(metrics.confidence)

    def answered(self, family: str, tier: str, *, degraded: bool, seconds: float) -> None:
        self._requests(family, tier, "degraded" if degraded else "ok").inc()
        self._duration(family).observe(seconds)

    def refused(self, family: str, error: StratusError) -> None:
        reason = error_label(error)
        self.metrics.requests.labels(family, "none", reason).inc()
        self.metrics.refusals.labels(reason).inc()

    def escalated(self, family: str, left: Tier, to: Tier, reason: str) -> None:
        self.metrics.escalations.labels(family, left.label, to.label, reason).inc()

    def degraded(self, family: str, reason: str) -> None:
        self.metrics.degraded.labels(family, reason).inc()

    def tier_answered(self, family: str, tier: Tier, elapsed_ms: float, confidences: Sequence[float]) -> None:
        self.tier_time(family, tier, elapsed_ms)
        histogram = self._confidence(family, tier.label)
        for value in confidences:
            histogram.observe(value)

    def tier_time(self, family: str, tier: Tier, elapsed_ms: float) -> None:
        self._tier_duration(family, tier.label).observe(elapsed_ms / 1000.0)

    def tokens(self, family: str, tier: Tier, fate: str, count: int) -> None:
        if count > 0:
            self.metrics.generated_tokens.labels(family, tier.label, fate).inc(count)

    def first_text(self, family: str, seconds: float) -> None:
        self.metrics.first_text.labels(family).observe(seconds)

    def rollout_request(self, family: str, tier: Tier, *, candidate: bool, ok: bool) -> None:
        arm = "candidate" if candidate else "current"
        self.metrics.rollout_requests.labels(family, tier.label, arm, "ok" if ok else "error").inc()


def observer_for(metrics: RouterMetrics | None) -> RouterObserver:
    """The observer for a router with these metrics, or none."""
    return NullObserver() if metrics is None else MetricsObserver(metrics)
