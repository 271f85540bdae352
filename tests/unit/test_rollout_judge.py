"""The rollout verdict's edges the mutation run found untested: the margins' bounds, the
window's counts, the Wald bound's terms, margins met exactly, and top-1 classes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from router.rollout_judge import WINDOW_LATENCIES, ArmWindow, Margins, judge, top1, worse_beyond
from stratus.convert.tensors import RawTensor, Tensors
from stratus.errors import InvalidInput

SHARES = "error and unsure margins are shares between 0 and 1"
P99 = "the p99 ratio must be at least 1 and its slack not negative"


def arm(requests: int, *, errors: int = 0, unsure: int = 0, latency_ms: float = 1.0) -> ArmWindow:
    """``requests`` of one item each: the first ``errors`` fail, the next ``unsure`` are unsure."""
    window = ArmWindow()
    for index in range(requests):
        failed = index < errors
        window.add(
            ok=not failed, latency_ms=latency_ms, items=1, unsure=int(errors <= index < errors + unsure)
        )
    return window


# -- margins ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_error_increase": 0.0},
        {"max_error_increase": 1.0},
        {"max_unsure_increase": 0.0},
        {"max_unsure_increase": 1.0},
        {"max_p99_ratio": 1.0},
        {"p99_slack_ms": 0.0},
        {"p99_slack_ms": 0.5},
    ],
)
def test_margins_accept_their_closed_bounds(kwargs: dict[str, float]) -> None:
    """Shares of exactly 0 or 1, a ratio of exactly 1 and any slack from 0 up are margins."""
    margins = Margins(**kwargs)
    for name, value in kwargs.items():
        assert getattr(margins, name) == value


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_error_increase": -0.01}, SHARES),
        ({"max_error_increase": 1.01}, SHARES),
        ({"max_error_increase": 1.5}, SHARES),
        ({"max_unsure_increase": -0.01}, SHARES),
        ({"max_unsure_increase": 1.5}, SHARES),
        ({"max_p99_ratio": 0.99}, P99),
        ({"p99_slack_ms": -0.1}, P99),
    ],
)
def test_margins_reject_each_bound_alone_and_say_which(kwargs: dict[str, float], message: str) -> None:
    """One margin out of range is enough, the others at their defaults; the error names the rule."""
    with pytest.raises(InvalidInput) as raised:
        Margins(**kwargs)
    assert str(raised.value) == message


# -- the window -------------------------------------------------------------------------------


def test_a_window_counts_each_failure_once_and_keeps_no_latency_for_it() -> None:
    """Three failures of five requests: 3 errors, 60%, and only the two answers' items and latencies."""
    window = ArmWindow()
    for ok in (False, True, False, True, False):
        window.add(ok=ok, latency_ms=5.0, items=2, unsure=1)
    assert (window.requests, window.errors, window.items, window.unsure) == (5, 3, 4, 2)
    assert window.error_share == pytest.approx(0.6)
    assert window.latencies_ms == [5.0, 5.0]


def test_a_window_keeps_at_most_window_latencies_latencies() -> None:
    """Memory is bounded: past WINDOW_LATENCIES answers, latencies are no longer kept."""
    window = arm(WINDOW_LATENCIES + 1)
    assert window.requests == WINDOW_LATENCIES + 1
    assert len(window.latencies_ms) == WINDOW_LATENCIES


# -- the Wald bound ---------------------------------------------------------------------------


def test_worse_beyond_uses_each_share_variance_above_the_floor() -> None:
    """1/10 against 1/10: p(1-p)/n = 0.009 for each (above the 0.25/n^2 floor of 0.0025), so
    the bound is -1.645 * sqrt(0.018)."""
    assert worse_beyond(1, 10, 1, 10) == pytest.approx(-1.645 * math.sqrt(0.018), rel=1e-12)


def test_worse_beyond_weighs_each_arm_by_its_own_share_and_count() -> None:
    """2/10 against 1/20: variances 0.2*0.8/10 = 0.016 and 0.05*0.95/20 = 0.002375."""
    expected = 0.15 - 1.645 * math.sqrt(0.016 + 0.002375)
    assert worse_beyond(2, 10, 1, 20) == pytest.approx(expected, rel=1e-12)
    # Swapped: the difference changes sign, the noise does not.
    assert worse_beyond(1, 20, 2, 10) == pytest.approx(-0.15 - 1.645 * math.sqrt(0.016 + 0.002375), rel=1e-12)


def test_worse_beyond_floors_a_zero_share_at_a_quarter_over_n() -> None:
    """0/100 against 0/100 is not certain: each variance is at least 0.25/100/100."""
    assert worse_beyond(0, 100, 0, 100) == pytest.approx(-1.645 * math.sqrt(2 * 0.25 / 100**2), rel=1e-12)


def test_worse_beyond_with_a_single_current_request_is_mostly_noise() -> None:
    """One current request (0/1) is a share, not a missing arm: its variance floor is 0.25."""
    expected = 0.5 - 1.645 * math.sqrt(0.25 / 100 + 0.25)
    assert worse_beyond(50, 100, 0, 1) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("n_a", "n_b"), [(0, 10), (10, 0), (0, 0)])
def test_worse_beyond_of_an_empty_arm_is_zero(n_a: int, n_b: int) -> None:
    """Nothing to compare: not worse at all."""
    assert worse_beyond(0, n_a, 0, n_b) == 0.0


# -- margins met exactly ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("margin", "worse"), [("max_error_increase", "errors"), ("max_unsure_increase", "unsure")]
)
def test_a_candidate_exactly_at_a_margin_advances(margin: str, worse: str) -> None:
    """A margin is how much worse a candidate may surely be (in errors, or in the unsure share):
    reaching it is allowed, a hair less than needed rolls back."""
    current, candidate = arm(100), arm(100, **{worse: 30})
    at = worse_beyond(30, 100, 0, 100)
    assert 0 < at < 1
    verdict = judge(current, candidate, min_requests=100, margins=Margins(**{margin: at}))
    assert verdict.action == "advance"
    below = Margins(**{margin: math.nextafter(at, 0.0)})
    assert judge(current, candidate, min_requests=100, margins=below).action == "rollback"


def test_an_advance_says_what_it_compared() -> None:
    """The reason of an advance carries both arms' counts, shares and p99s."""
    current = arm(200, errors=2, unsure=4, latency_ms=3.0)
    candidate = arm(100, errors=1, unsure=2, latency_ms=4.0)
    verdict = judge(current, candidate, min_requests=100, margins=Margins())
    assert verdict.action == "advance"
    # Unsure shares are of the answered items: 2/99 = 2.0% and 4/198 = 2.0%.
    assert verdict.reason == (
        "no worse over 100/200 requests: errors 1.0% vs 1.0%, p99 4.0 vs 3.0 ms, unsure 2.0% vs 2.0%"
    )


# -- top-1 classes ----------------------------------------------------------------------------


def _fp32(name: str, values: list[list[float]] | list[float] | list[list[list[float]]]) -> RawTensor:
    array = np.asarray(values, dtype=np.float32)
    return RawTensor(name, "FP32", tuple(array.shape), array.tobytes())


def test_top1_is_each_rows_best_class_in_the_first_output() -> None:
    """Three items of four classes; the second output (its own argmax differs) is ignored."""
    first = _fp32("probabilities", [[0.1, 0.2, 0.6, 0.1], [0.7, 0.1, 0.1, 0.1], [0.0, 0.1, 0.2, 0.7]])
    second = _fp32("other", [[9.0, 0.0, 0.0, 0.0]] * 3)
    best = top1(Tensors((first, second)))
    assert best is not None
    assert best.tolist() == [2, 0, 3]


def test_top1_flattens_each_item_of_a_three_axis_output() -> None:
    """Two items of 2x3 scores: the best of each item's six, counted in row-major order."""
    scores = [[[0.0, 0.1, 0.2], [0.9, 0.0, 0.0]], [[0.0, 0.0, 0.8], [0.1, 0.0, 0.0]]]
    best = top1(Tensors((_fp32("scores", scores),)))
    assert best is not None
    assert best.tolist() == [3, 2]


def test_top1_reads_the_outputs_datatype() -> None:
    """INT64 scores are read as 8-byte integers (negative ones too), not as the default float."""
    array = np.array([[-3, 5, 2], [7, -1, 3]], dtype=np.int64)
    best = top1(Tensors((RawTensor("scores", "INT64", (2, 3), array.tobytes()),)))
    assert best is not None
    assert best.tolist() == [1, 0]


@pytest.mark.parametrize(
    "tensors",
    [
        Tensors(()),
        Tensors((_fp32("scores", [0.2, 0.8, 0.5]),)),  # one axis: no classes per item
        Tensors((RawTensor("text", "BYTES", (2, 1), b"\x01\x00\x00\x00a\x01\x00\x00\x00b"),)),
    ],
    ids=["no outputs", "one axis", "bytes"],
)
def test_top1_has_no_classes_without_a_fixed_size_two_axis_output(tensors: Tensors) -> None:
    """No outputs, a 1-D output or a BYTES one: nothing to compare."""
    assert top1(tensors) is None
