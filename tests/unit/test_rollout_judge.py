"""The rollout verdict's edges the mutation run found untested: the margins' bounds, the
window's counts, the Wald bound's terms, margins met exactly, and top-1 classes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from router.rollout.judge import (
    AUDIT_LOOK_GROWTH,
    WINDOW_LATENCIES,
    ArmWindow,
    Margins,
    Verdict,
    judge,
    top1,
    worse_beyond,
)
from stratus.convert.tensors import RawTensor, Tensors
from stratus.errors import InvalidInput

SHARES = "error, unsure and disagreement margins are shares between 0 and 1"
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
        {"max_disagreement_increase": 0.0},
        {"max_disagreement_increase": 1.0},
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
        ({"max_disagreement_increase": -0.01}, SHARES),
        ({"max_disagreement_increase": 1.01}, SHARES),
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


# -- agreement with the top tier (issue 34 §1) ----------------------------------------------------


def audited(window: ArmWindow, audits: int, *, disagreed: int) -> ArmWindow:
    for index in range(audits):
        window.add_audit(agreed=index >= disagreed)
    return window


def test_a_candidate_wrong_and_sure_of_itself_is_rolled_back_on_its_agreement() -> None:
    """The issue's case: no more errors, no slower, unsure no higher (0 here against 2%), but
    the top tier disagrees with 22% of its audited answers against 2% of the current's."""
    current = audited(arm(100, unsure=2), 50, disagreed=1)
    candidate = audited(arm(100), 50, disagreed=11)
    verdict = judge(current, candidate, min_requests=100, margins=Margins(), min_audits=50)
    assert verdict == Verdict(
        "rollback", "agreement 78.0% vs 98.0% with the top tier over 50/50 audits (surely lower)"
    )
    # Wald by hand: 0.20 - 2.576 * sqrt(0.22 * 0.78 / 50 + 0.02 * 0.98 / 50) = 0.20 - 0.1592
    assert worse_beyond(11, 50, 1, 50, z=2.576) == pytest.approx(0.0408, abs=1e-4)


def test_a_candidate_as_good_as_the_current_advances_and_says_both_agreements() -> None:
    current = audited(arm(100), 400, disagreed=4)
    candidate = audited(arm(100), 400, disagreed=3)
    verdict = judge(current, candidate, min_requests=100, margins=Margins(), min_audits=50)
    assert verdict.action == "advance"
    assert verdict.reason.endswith(
        ", agreement 99.2% vs 99.0% with the top tier over 400/400 audits (within 1.0%)"
    ), verdict.reason


def test_a_step_waits_for_each_arms_audits_where_the_tier_can_be_audited() -> None:
    current = audited(arm(100), 50, disagreed=0)
    candidate = audited(arm(100), 49, disagreed=0)
    waiting = judge(current, candidate, min_requests=100, margins=Margins(), min_audits=50)
    assert waiting == Verdict("wait", "49 candidate and 50 current audits of 50 each")
    # where nothing above the tier audits it (min_audits 0), requests alone decide, as before
    unaudited = judge(arm(100), arm(100), min_requests=100, margins=Margins())
    assert unaudited.action == "advance" and "agreement" not in unaudited.reason


def test_too_few_audits_to_tell_are_inconclusive_not_an_advance() -> None:
    """50 audits each, 2 against 1 disagreeing: not surely worse, but it could still be 6
    points worse, past the 1% margin; the judge waits for more rather than promote it."""
    current = audited(arm(100), 50, disagreed=1)
    candidate = audited(arm(100), 50, disagreed=2)
    verdict = judge(current, candidate, min_requests=100, margins=Margins(), min_audits=50)
    assert verdict == Verdict(
        "wait",
        "agreement 96.0% vs 98.0% with the top tier over 50/50 audits: not yet surely within 1.0%",
        inconclusive=True,
    )


def test_the_agreement_margin_is_how_much_lower_it_may_at_most_be() -> None:
    """Advance where the upper end of the difference's interval is below the margin."""
    current = audited(arm(100), 100, disagreed=0)
    candidate = audited(arm(100), 100, disagreed=1)
    could_be = -worse_beyond(0, 100, 1, 100)  # the upper end of (candidate - current)
    assert 0.01 < could_be < 1
    within = Margins(max_disagreement_increase=math.nextafter(could_be, 1.0))
    assert judge(current, candidate, min_requests=100, margins=within, min_audits=1).action == "advance"
    at = Margins(max_disagreement_increase=could_be)
    assert judge(current, candidate, min_requests=100, margins=at, min_audits=1).inconclusive
    assert ArmWindow().agreement == 1.0 and candidate.agreement == pytest.approx(0.99)


@pytest.mark.parametrize(
    ("current_agrees", "candidate_agrees", "rolled_back_at_least", "rolled_back_at_most"),
    [(0.98, 0.98, 0.0, 0.10), (0.995, 0.982, 0.70, 1.0), (0.99, 0.80, 1.0, 1.0)],
    ids=["equal", "the review's 1.3 points worse", "wrong on a fifth"],
)
def test_looks_spaced_by_growth_keep_false_rollbacks_rare_and_catch_a_worse_model(
    current_agrees: float, candidate_agrees: float, rolled_back_at_least: float, rolled_back_at_most: float
) -> None:
    """A step judged as router.rollout.plans does, looked at when each arm has the audits wanted
    (50, then AUDIT_LOOK_GROWTH times the last look's):
    over 200 seeded steps, an equal candidate is seldom rolled back and the review's worse
    model usually is (the simulation that chose the defaults)."""
    rng = np.random.default_rng(7)
    rolled_back = 0
    for _ in range(200):
        current, candidate, wanted = arm(100), arm(100), 50
        while True:  # the audits up to the next look arrive, then the judge looks
            for window, agrees in ((current, current_agrees), (candidate, candidate_agrees)):
                arriving = wanted - window.audited
                window.audited += arriving
                window.disagreed += int(rng.binomial(arriving, 1.0 - agrees))
            verdict = judge(current, candidate, min_requests=100, margins=Margins(), min_audits=wanted)
            assert verdict.action != "wait" or verdict.inconclusive, verdict
            if verdict.action != "wait":
                rolled_back += verdict.action == "rollback"
                break
            wanted = math.ceil(wanted * AUDIT_LOOK_GROWTH)
    assert rolled_back_at_least <= rolled_back / 200 <= rolled_back_at_most


def test_what_the_requests_show_rolls_back_before_any_audit_is_in() -> None:
    """A candidate unsure 40% against 0% is rolled back at once: audits only hold up an advance."""
    verdict = judge(arm(100), arm(100, unsure=40), min_requests=100, margins=Margins(), min_audits=50)
    assert verdict.action == "rollback" and verdict.reason.startswith("unsure 40.0% vs 0.0%")
