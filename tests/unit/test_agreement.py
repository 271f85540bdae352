"""The agreement estimator: Wilson intervals, the sliding window on an injected clock, verdicts."""

from __future__ import annotations

import pytest

from router.audit.agreement import (
    DRIFTED,
    IN_LINE,
    NOT_CALIBRATED,
    TOO_FEW,
    AgreementBook,
    AuditKey,
    Estimate,
    total,
    verdict,
    wilson,
)
from stratus.tiers import Tier


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(agent: str = "device-1", variant: str = "digits-small", tier: Tier = Tier.DEVICE) -> AuditKey:
    return AuditKey("digits", tier, variant, agent)


@pytest.mark.parametrize(
    ("agreed", "audits", "lower", "upper"),
    [
        (50, 100, 0.4038, 0.5962),  # the textbook case: p = 0.5, n = 100
        (10, 10, 0.7225, 1.0),  # all agree: the interval still has width
        (0, 10, 0.0, 0.2775),
        (30, 30, 0.8865, 1.0),  # the count the module's docstring quotes
        (95, 100, 0.8882, 0.9785),
    ],  # each checked against the roots of (k/n - p)^2 = z^2 p (1 - p) / n, found by bisection
)
def test_wilson_interval_matches_hand_computed_values(
    agreed: int, audits: int, lower: float, upper: float
) -> None:
    low, high = wilson(agreed, audits)
    assert low == pytest.approx(lower, abs=5e-4)
    assert high == pytest.approx(upper, abs=5e-4)


def test_wilson_with_no_audits_says_nothing_and_narrows_with_more() -> None:
    assert wilson(0, 0) == (0.0, 1.0)
    widths = [wilson(round(0.9 * n), n)[1] - wilson(round(0.9 * n), n)[0] for n in (10, 100, 1000)]
    assert widths[0] > widths[1] > widths[2]
    assert 0.9 - wilson(900, 1000)[0] < 0.025  # 0.8797: about two points below, at 1000 audits


def test_estimates_add_up() -> None:
    both = total([Estimate(10, 9), Estimate(30, 15)])
    assert (both.audits, both.agreed) == (40, 24)
    assert both.agreement == pytest.approx(0.6)
    assert Estimate().agreement == 0.0


def test_window_keeps_the_last_n_audits() -> None:
    clock = Clock()
    book = AgreementBook(max_audits=10, max_age_s=3600.0, clock=clock)
    for _ in range(10):
        book.add(key(), False)
    for _ in range(4):
        book.add(key(), True)  # push out four disagreements
    estimate = book.estimates()[key()]
    assert (estimate.audits, estimate.agreed) == (10, 4)


def test_window_forgets_audits_older_than_its_age() -> None:
    clock = Clock()
    book = AgreementBook(max_audits=100, max_age_s=60.0, clock=clock)
    for _ in range(5):
        book.add(key(), False)
    clock.now += 30.0
    for _ in range(3):
        book.add(key(), True)
    assert book.estimates()[key()] == Estimate(8, 3)
    clock.now += 31.0  # the first five are now 61 s old
    assert book.estimates()[key()] == Estimate(3, 3)
    clock.now += 30.0
    assert book.estimates() == {}  # an empty window is dropped, not reported as 0 of 0


def test_book_keeps_keys_apart_and_filters_by_family() -> None:
    book = AgreementBook(clock=Clock())
    book.add(key("device-1"), True)
    book.add(key("device-2"), False)
    book.add(AuditKey("defects", Tier.EDGE, "defects-medium", "edge-1"), True)
    assert book.estimates("digits") == {key("device-1"): Estimate(1, 1), key("device-2"): Estimate(1, 0)}
    assert len(book.estimates()) == 3


def test_book_bounds_its_windows_forgetting_the_stalest() -> None:
    clock = Clock()
    book = AgreementBook(max_windows=2, clock=clock)
    book.add(key("a"), True)
    clock.now += 1
    book.add(key("b"), True)
    clock.now += 1
    book.add(key("a"), True)  # "a" audited last now; "b" is the stalest
    clock.now += 1
    book.add(key("c"), True)
    assert set(book.estimates()) == {key("a"), key("c")}


def test_book_refuses_an_empty_window() -> None:
    with pytest.raises(ValueError):
        AgreementBook(max_audits=0)


@pytest.mark.parametrize(
    ("estimate", "calibrated", "expected"),
    [
        (Estimate(400, 392), 0.98, IN_LINE),  # 0.961-0.990: all of it above the line 0.93
        (Estimate(100, 40), 0.98, DRIFTED),  # 0.309-0.498: all of it below
        (Estimate(100, 97), 0.98, TOO_FEW),  # 0.916-0.990 straddles 0.93
        (Estimate(200, 180), 0.98, TOO_FEW),  # 0.851-0.934 straddles it too
        (Estimate(30, 30), 0.98, TOO_FEW),  # 0.886-1.0: a perfect agent, not yet in line
        (Estimate(29, 0), 0.98, TOO_FEW),  # under the minimum, however bad
        (Estimate(500, 500), None, NOT_CALIBRATED),
    ],
)
def test_verdict(estimate: Estimate, calibrated: float | None, expected: str) -> None:
    assert verdict(estimate, calibrated, margin=0.05, min_audits=30) == expected


def test_verdict_margin_and_minimum_are_the_callers() -> None:
    estimate = Estimate(100, 80)  # 0.711-0.867
    assert verdict(estimate, 0.98, margin=0.05) == DRIFTED
    assert verdict(estimate, 0.98, margin=0.2) == TOO_FEW  # line 0.78 inside the interval
    assert verdict(estimate, 0.98, margin=0.3) == IN_LINE  # line 0.68 below it
    assert verdict(estimate, 0.98, margin=0.05, min_audits=101) == TOO_FEW
