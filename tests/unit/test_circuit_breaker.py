"""The cloud link's circuit breaker, on an injected clock."""

from __future__ import annotations

from router.cloud.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_fails_fast() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=3, cooldown_s=1.0, clock=clock)
    for _ in range(2):
        breaker.failure()
    assert breaker.state == "closed" and breaker.allows()
    breaker.success()  # a success in between resets the count
    for _ in range(3):
        breaker.failure()
    assert breaker.state == "open" and not breaker.allows()


def test_half_open_lets_exactly_one_probe_through() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=1.0, clock=clock)
    breaker.failure()
    clock.now += 1.01
    assert breaker.state == "half-open" and breaker.allows()
    breaker.before_call()
    assert not breaker.allows()  # the probe is in flight; others still fail fast
    breaker.success()
    assert breaker.state == "closed" and breaker.allows()


def test_a_failed_probe_reopens_with_a_longer_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=1.0, max_cooldown_s=3.0, clock=clock)
    breaker.failure()
    for expected_cooldown in (2.0, 3.0, 3.0):  # doubles, then stays at the cap
        clock.now += 10.0
        breaker.before_call()
        breaker.failure()
        clock.now += expected_cooldown - 0.01
        assert breaker.state == "open"
        clock.now += 0.02
        assert breaker.state == "half-open"
