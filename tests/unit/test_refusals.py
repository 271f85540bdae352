"""Refused Hellos are logged at a bounded rate, and an address that keeps failing is refused
before its credentials are checked (security2 N11), on an injected clock."""

from __future__ import annotations

import logging

import pytest

from router.api.link import HelloRate, Refusals
from stratus.errors import Overloaded, Unauthenticated


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_refusals_are_logged_at_a_bounded_rate_and_summed_up(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    refusals = Refusals(window_s=10.0, max_logged=3, max_refused=1000, clock=clock)
    with caplog.at_level(logging.WARNING, logger="stratus.link"):
        for n in range(50):
            refusals.check("ipv4:10.0.0.9:5000")
            refusals.refused(f"rogue-{n}", "ipv4:10.0.0.9:5000", Unauthenticated("wrong token"))
        clock.now = 10.5
        refusals.check("ipv4:10.0.0.9:5000")  # the window turns: one line sums the rest up
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert all("refused agent 'rogue-" in line for line in lines[:3])
    assert lines[3].startswith("47 more agent Hellos refused in the last 10 s")


def test_an_address_that_keeps_failing_is_refused_at_once_until_the_window_turns() -> None:
    clock = Clock()
    refusals = Refusals(window_s=10.0, max_logged=0, max_refused=5, clock=clock)
    for _ in range(5):
        refusals.check("ipv4:10.0.0.9:5000")
        refusals.refused("rogue", "ipv4:10.0.0.9:6000", Unauthenticated("wrong token"))
    with pytest.raises(Overloaded, match="5 Hellos from this address were refused"):
        refusals.check("ipv4:10.0.0.9:7000")  # another port of the same address
    refusals.check("ipv4:10.0.0.8:5000")  # another address is not held back
    clock.now = 11.0
    refusals.check("ipv4:10.0.0.9:5000")


def test_each_agent_identity_opens_a_bounded_number_of_links_a_window() -> None:
    """A stolen credential churning its link is refused past six new links a minute; a pool's
    certificate gets room for its members twice over; a shared token binds no identity."""
    clock = Clock()
    rate = HelloRate({"kiosk": 10}, per_identity=6, window_s=60.0, clock=clock)
    for _ in range(6):
        rate.take("token:device-1")
    with pytest.raises(Overloaded, match=r"token:device-1 opened 6 links in the last 60 s"):
        rate.take("token:device-1")
    rate.take("cert:device-2")  # another identity is not held back
    assert [rate.most(i) for i in ("cert:a", "pool:kiosk", "pool:unknown", "fleet-token", "anonymous")] == [
        6, 26, 8, None, None,
    ]  # fmt: skip
    for _ in range(26):
        rate.take("pool:kiosk")
    with pytest.raises(Overloaded):
        rate.take("pool:kiosk")
    for _ in range(100):
        rate.take("fleet-token")
    clock.now = 60.0  # the window has passed: the oldest links no longer count
    rate.take("token:device-1")
