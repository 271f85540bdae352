"""The cloud link's circuit breaker: escalations fail fast while the cloud keeps failing,
and one probe now and then finds it back."""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    """Fail fast while the cloud keeps failing; probe it now and then to see it recover.

    Closed: calls flow. After ``threshold`` consecutive failures (errors or timeouts) it
    opens: calls are refused at once, so escalations answer degraded instead of piling up
    behind a cloud that is away. After a cooldown (doubling, capped) it is half-open: one
    probe call may pass; its success closes the breaker, its failure opens it again.
    """

    def __init__(
        self,
        *,
        threshold: int = 5,
        cooldown_s: float = 1.0,
        max_cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self._base_cooldown = cooldown_s
        self._max_cooldown = max_cooldown_s
        self._cooldown = cooldown_s
        self._clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self.probing = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        if self._clock() - self.opened_at < self._cooldown:
            return "open"
        return "half-open"

    def allows(self) -> bool:
        state = self.state
        return state == "closed" or (state == "half-open" and not self.probing)

    def before_call(self) -> None:
        if self.state == "half-open":
            self.probing = True

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.probing = False
        self._cooldown = self._base_cooldown

    def failure(self) -> None:
        self.failures += 1
        if self.state == "half-open" or self.failures >= self.threshold:
            if self.opened_at is not None:
                self._cooldown = min(self._cooldown * 2, self._max_cooldown)
            self.opened_at = self._clock()
            self.probing = False
