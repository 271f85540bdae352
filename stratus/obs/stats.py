"""Moving latency estimates: what agents report and what the routing policy predicts with."""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class LatencySummary:
    mean_ms: float
    p50_ms: float
    p99_ms: float
    count: int


@dataclass(frozen=True, kw_only=True)
class LoadReport:
    """What an agent's heartbeat says: its load (runtime calls at once, items queued), how
    many of the link's messages it has read, and the latency of each variant that ran since
    its previous heartbeat on that link."""

    in_flight: int = 0
    queue_length: int = 0
    received: int = 0
    latency: Mapping[str, LatencySummary] = field(default_factory=dict)


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

    def percentile(self, q: float, *, last: int | None = None) -> float:
        """The q-th percentile of the window, or of its ``last`` samples only."""
        if not self._samples:
            return 0.0
        samples = list(self._samples)[-last:] if last else self._samples
        ordered = sorted(samples)
        index = min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))
        return ordered[index]

    @classmethod
    def merged(cls, windows: Sequence[LatencyWindow]) -> LatencyWindow:
        """One window holding the samples of several (several gateways as one cloud tier)."""
        merged = cls(size=max([512, *(w._samples.maxlen or 0 for w in windows)]) * max(1, len(windows)))
        for window in windows:
            merged._samples.extend(window._samples)
            merged.count += window.count
        means = [w._mean for w in windows if w._mean is not None]
        merged._mean = sum(means) / len(means) if means else None
        return merged

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


class ServiceCurve:
    """Service time by batch size, learned from the batches a target ran.

    One moving mean per power-of-two bucket of batch sizes (1, 2, 3-4, 5-8, ...), each
    scaled to the size asked for by its mean batch size; between learnt buckets the
    estimate interpolates, beyond the largest it grows in proportion to the items (a
    pessimistic guess until bigger batches have run). So predicted latency stays right
    when batches grow, from the first few batches of each size on.
    """

    def __init__(self, *, alpha: float = 0.2) -> None:
        self._alpha = alpha
        self._ms: dict[int, float] = {}  # bucket -> moving mean of ms
        self._items: dict[int, float] = {}  # bucket -> moving mean of its batch sizes
        self._points: list[tuple[float, float]] = []  # (mean size, mean ms), by size

    @staticmethod
    def _bucket(items: int) -> int:
        return max(0, items - 1).bit_length()

    def add(self, items: int, ms: float) -> None:
        if items < 1 or ms < 0:
            return
        bucket = self._bucket(items)
        if bucket not in self._ms:
            self._ms[bucket], self._items[bucket] = ms, float(items)
        else:
            self._ms[bucket] += self._alpha * (ms - self._ms[bucket])
            self._items[bucket] += self._alpha * (items - self._items[bucket])
        self._points = sorted((self._items[b], self._ms[b]) for b in self._ms)

    @property
    def known(self) -> bool:
        return bool(self._ms)

    def estimate(self, items: int, default: float = 1.0) -> float:
        """Expected ms to run a batch of ``items``; ``default`` for one item when nothing is known."""
        points = self._points
        if not points:
            return default * max(1, items)
        below = [p for p in points if p[0] <= items]
        above = [p for p in points if p[0] > items]
        if below and above:
            (x0, y0), (x1, y1) = below[-1], above[0]
            return y0 + (y1 - y0) * (items - x0) / (x1 - x0)
        if above:  # smaller than anything seen: no cheaper than the smallest batch seen
            return above[0][1]
        x, y = below[-1]
        return y * items / x


class SizeWindow:
    """Mean of the last ``size`` batch sizes: what an operator reads as "batch" in status."""

    def __init__(self, *, size: int = 256) -> None:
        self._sizes: collections.deque[int] = collections.deque(maxlen=size)
        self._total = 0

    def add(self, items: int) -> None:
        if len(self._sizes) == self._sizes.maxlen:
            self._total -= self._sizes[0]
        self._sizes.append(items)
        self._total += items

    @property
    def mean(self) -> float:
        return self._total / len(self._sizes) if self._sizes else 0.0
