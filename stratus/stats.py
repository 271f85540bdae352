"""Moving latency estimates: what agents report and what the routing policy predicts with."""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LatencySummary:
    mean_ms: float
    p50_ms: float
    p99_ms: float
    count: int


class LatencyWindow:
    """The last ``size`` samples plus an exponentially weighted mean.

    The EWMA follows load changes within a few requests; the window gives percentiles
    that a single average would hide (p99 is what budgets are broken by).
    """

    def __init__(self, *, size: int = 512, alpha: float = 0.2) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=size)
        self._alpha = alpha
        self._mean: float | None = None
        self.count = 0

    def add(self, ms: float) -> None:
        self._samples.append(ms)
        self._mean = ms if self._mean is None else self._alpha * ms + (1 - self._alpha) * self._mean
        self.count += 1

    @property
    def mean_ms(self) -> float | None:
        return self._mean

    def percentile(self, q: float) -> float:
        if not self._samples:
            return 0.0
        ordered = sorted(self._samples)
        index = min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))
        return ordered[index]

    def summary(self) -> LatencySummary:
        return LatencySummary(
            mean_ms=self._mean or 0.0,
            p50_ms=self.percentile(50),
            p99_ms=self.percentile(99),
            count=self.count,
        )


class RateMeter:
    """Events per second over the last ``window_s``, in one-second buckets.

    Constant cost to record and to read however many events there were, which matters
    when ``fleet status`` reads the rate of every agent of a thousand-agent fleet.
    """

    def __init__(self, *, window_s: int = 10, clock: Callable[[], float] = time.monotonic) -> None:
        self._window = window_s
        self._clock = clock
        self._buckets = [0] * window_s
        self._seconds = [-1] * window_s  # which whole second each bucket counts
        self._started = clock()

    def add(self, count: int = 1) -> None:
        second = int(self._clock())
        slot = second % self._window
        if self._seconds[slot] != second:
            self._seconds[slot], self._buckets[slot] = second, 0
        self._buckets[slot] += count

    def per_second(self) -> float:
        now = self._clock()
        oldest = int(now) - self._window + 1
        total = sum(b for b, s in zip(self._buckets, self._seconds, strict=True) if s >= oldest)
        return total / max(min(float(self._window), now - self._started), 1e-3)
