"""Agreement with the top tier, estimated from audits over a sliding window.

Each audit says whether one item's answer from a lower tier matched the top tier's answer.
Per (family, tier, variant, agent), the router keeps the last ``WINDOW_AUDITS`` of them, none
older than ``WINDOW_S``; the share that agreed comes with its 95% Wilson score interval, which
stays inside [0, 1] and is honest at the small counts one camera among fifty collects (a normal
interval around 30 of 30 would claim 100% +/- 0).

A tier's live agreement is judged against the agreement its thresholds gave on the calibration
split (``[tier_accuracy]`` in family.toml), less a margin:

* ``drifted``: the whole interval is below it (upper bound < calibrated - margin);
* ``in line``: the whole interval is at or above it (lower bound >= calibrated - margin);
* ``too few audits``: under ``MIN_AUDITS``, or the interval straddles the line: the audits so
  far cannot tell, and judging the lower bound alone would call a perfect agent with 30 audits
  (lower bound 0.886) drifted against a 0.98 calibration.

Pure bookkeeping on an injected clock: no I/O, no tasks.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from stratus.tiers import Tier

Z_95: Final = 1.959963984540054
WINDOW_AUDITS: Final = 1000
WINDOW_S: Final = 3600.0
MIN_AUDITS: Final = 30
MARGIN: Final = 0.05
# Windows kept at once (families x tiers x variants x agents): one per agent and variant of a
# large fleet; past it, the window audited longest ago is forgotten.
MAX_WINDOWS: Final = 8192

IN_LINE: Final = "in line"
DRIFTED: Final = "drifted"
TOO_FEW: Final = "too few audits"
NOT_CALIBRATED: Final = "not calibrated"


def wilson(agreed: int, audits: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of ``agreed / audits``; (0, 1) with no audits."""
    if audits <= 0:
        return 0.0, 1.0
    share = agreed / audits
    spread = z * z / audits
    centre = (share + spread / 2) / (1 + spread)
    half = z * math.sqrt(share * (1 - share) / audits + spread / (4 * audits)) / (1 + spread)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Estimate:
    """Audits in a window and how many agreed; sums over agents or variants add up."""

    audits: int = 0
    agreed: int = 0

    @property
    def agreement(self) -> float:
        return self.agreed / self.audits if self.audits else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.agreed, self.audits)

    def __add__(self, other: Estimate) -> Estimate:
        return Estimate(self.audits + other.audits, self.agreed + other.agreed)


def total(estimates: Iterable[Estimate]) -> Estimate:
    return sum(estimates, Estimate())


def verdict(
    estimate: Estimate, calibrated: float | None, *, margin: float = MARGIN, min_audits: int = MIN_AUDITS
) -> str:
    """See the module's docstring: the line is ``calibrated - margin``."""
    if calibrated is None:
        return NOT_CALIBRATED
    if estimate.audits < min_audits:
        return TOO_FEW
    lower, upper = estimate.interval
    line = calibrated - margin
    if upper < line:
        return DRIFTED
    return IN_LINE if lower >= line else TOO_FEW


@dataclass(frozen=True)
class AuditKey:
    """Whose answer was audited: a family's tier, the variant that answered, the agent."""

    family: str
    tier: Tier
    variant: str
    agent: str


class AgreementWindow:
    """The last ``max_audits`` outcomes, none older than ``max_age_s``."""

    def __init__(self, *, max_audits: int, max_age_s: float, clock: Callable[[], float]) -> None:
        self._seen: deque[tuple[float, bool]] = deque(maxlen=max_audits)
        self._max_age_s = max_age_s
        self._clock = clock
        self.newest = clock()

    def add(self, agreed: bool) -> None:
        self.newest = self._clock()
        self._seen.append((self.newest, agreed))

    def estimate(self) -> Estimate:
        oldest = self._clock() - self._max_age_s
        while self._seen and self._seen[0][0] < oldest:
            self._seen.popleft()
        return Estimate(len(self._seen), sum(1 for _, agreed in self._seen if agreed))


class AgreementBook:
    """Every window, by :class:`AuditKey`; bounded in windows and in audits per window."""

    def __init__(
        self,
        *,
        max_audits: int = WINDOW_AUDITS,
        max_age_s: float = WINDOW_S,
        max_windows: int = MAX_WINDOWS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_audits < 1 or max_age_s <= 0 or max_windows < 1:
            raise ValueError("an agreement window holds at least one audit, for some time")
        self.max_audits = max_audits
        self.max_age_s = max_age_s
        self._max_windows = max_windows
        self._clock = clock
        self._windows: dict[AuditKey, AgreementWindow] = {}

    def add(self, key: AuditKey, agreed: bool) -> None:
        window = self._windows.get(key)
        if window is None:
            if len(self._windows) >= self._max_windows:
                stalest = min(self._windows, key=lambda k: self._windows[k].newest)
                del self._windows[stalest]
            window = AgreementWindow(max_audits=self.max_audits, max_age_s=self.max_age_s, clock=self._clock)
            self._windows[key] = window
        window.add(agreed)

    def estimates(self, family: str | None = None) -> dict[AuditKey, Estimate]:
        """Each window with audits in it now (of one family, or all); empty ones are dropped."""
        found = {}
        for key, window in list(self._windows.items()):
            if family is not None and key.family != family:
                continue
            estimate = window.estimate()
            if estimate.audits:
                found[key] = estimate
            else:
                del self._windows[key]
        return found
