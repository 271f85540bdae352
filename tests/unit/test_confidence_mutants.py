"""Confidence edge cases the mutation run found untested: the last axis of any batch shape,
two classes, out-of-range scores, overflow, the threshold rule, and the temperature fit
checked against an NLL grid search written here."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy.special import logsumexp

from stratus.families.confidence import (
    PASS_ALL,
    TEMPERATURE_GRID,
    fit_temperature,
    margin,
    max_probability,
    normalized_entropy,
    softmax,
    tempered,
    threshold_problem,
)

SIGMOID_1 = 1.0 / (1.0 + math.exp(-1.0))  # softmax([1, 0])[0]

# -- the last axis, whatever the batch shape ---------------------------------------------------


# Two items with one position each, three classes: a leading axis of length 1 in the middle.
PER_POSITION = np.array([[[0.6, 0.3, 0.1]], [[0.2, 0.2, 0.6]]])


def test_max_probability_reads_the_last_axis_of_a_three_axis_batch() -> None:
    """A (batch, positions, classes) array gets one confidence per position."""
    np.testing.assert_allclose(max_probability(PER_POSITION), [[0.6], [0.6]])


def test_margin_reads_the_last_axis_of_a_three_axis_batch() -> None:
    """The class count and the top two come from the last axis, not the second."""
    np.testing.assert_allclose(margin(PER_POSITION), [[0.3], [0.4]])


def test_entropy_reads_the_last_axis_of_a_three_axis_batch() -> None:
    """K is the last axis (3 here), and the sum runs over it."""
    first = 1 + (0.6 * math.log(0.6) + 0.3 * math.log(0.3) + 0.1 * math.log(0.1)) / math.log(3)
    second = 1 + (2 * 0.2 * math.log(0.2) + 0.6 * math.log(0.6)) / math.log(3)
    np.testing.assert_allclose(normalized_entropy(PER_POSITION), [[first], [second]])


def test_margin_of_two_classes_is_their_difference() -> None:
    """Two classes are enough for a margin; only one class falls back to the top probability."""
    np.testing.assert_allclose(margin(np.array([[0.7, 0.3], [0.45, 0.55]])), [0.4, 0.1])


def test_entropy_of_two_classes_uses_log_two() -> None:
    """Two even classes are a uniform answer (0), not a top probability of 0.5."""
    expected = 1 + (0.8 * math.log(0.8) + 0.2 * math.log(0.2)) / math.log(2)
    np.testing.assert_allclose(
        normalized_entropy(np.array([[0.5, 0.5], [0.8, 0.2]])), [0.0, expected], atol=1e-12
    )


def test_margin_is_top_one_minus_top_two_for_any_order_of_five_classes() -> None:
    """The top two are found wherever they sit in the row (never a negative margin)."""
    rows = np.random.default_rng(3).dirichlet(np.ones(5), size=300)
    ordered = np.sort(rows, axis=1)
    np.testing.assert_allclose(margin(rows), ordered[:, -1] - ordered[:, -2])
    for permutation in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        row = np.array([[0.4, 0.3, 0.15, 0.1, 0.05]])[:, permutation]
        np.testing.assert_allclose(margin(row), [0.1])


# -- scores outside [0, 1] (a dequantized output rounds past the ends) ------------------------


def test_entropy_counts_a_probability_above_one_as_one() -> None:
    """1.2 is clamped to 1 (its term p log p = 0); the 0.3 still counts."""
    expected = 1 + 0.3 * math.log(0.3) / math.log(3)
    np.testing.assert_allclose(normalized_entropy(np.array([[1.2, 0.3, 0.0]])), [expected])


def test_entropy_counts_a_minus_infinite_score_as_no_mass() -> None:
    """A -inf score is clamped to 0, leaving two even classes of three."""
    expected = 1 - math.log(2) / math.log(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(normalized_entropy(np.array([[-np.inf, 0.5, 0.5]])), [expected])


def test_entropy_of_rows_summing_past_one_is_floored_at_zero() -> None:
    """Four classes at 0.4 each have H = -1.6 log 0.4 > log 4; the confidence stays 0."""
    assert -1.6 * math.log(0.4) > math.log(4)
    np.testing.assert_array_equal(normalized_entropy(np.array([[0.4, 0.4, 0.4, 0.4]])), [0.0])


# -- softmax and tempering never overflow or warn ---------------------------------------------


def test_softmax_of_huge_logits_is_finite() -> None:
    """exp(1000) overflows; shifting each row by its own max keeps it in range."""
    result = softmax(np.array([[1000.0, 999.0], [-1000.0, -1001.0]]))
    np.testing.assert_allclose(result, [[SIGMOID_1, 1 - SIGMOID_1]] * 2)


def test_softmax_shifts_each_row_by_its_own_max() -> None:
    """A row far below another must not underflow to 0/0 because of the other row's max."""
    result = softmax(np.array([[1000.0, 999.0], [0.0, -1.0]]))
    np.testing.assert_allclose(result, [[SIGMOID_1, 1 - SIGMOID_1]] * 2)


def test_tempering_zero_probabilities_stays_finite_and_warns_nothing() -> None:
    """log(0) would be -inf (and a warning); a zero stays a tiny but possible class, and a
    row of zeros (a model that gave nothing) spreads evenly instead of turning NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = tempered(np.array([[1.0, 0.0], [0.0, 0.0]]), 4.0)
    assert np.all(np.isfinite(result))
    assert result[0, 1] > 0.0
    np.testing.assert_allclose(result[1], [0.5, 0.5])


def test_tempering_at_two_takes_square_roots_of_the_probabilities() -> None:
    """Logits halved: p_i ** (1/2), renormalised."""
    roots = np.sqrt([0.64, 0.36])
    np.testing.assert_allclose(tempered(np.array([[0.64, 0.36]]), 2.0), [roots / roots.sum()])


# -- the threshold rule -----------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 0.5, 1.0, PASS_ALL, 0, 1])
def test_threshold_problem_accepts_the_closed_range_and_pass_all(value: float) -> None:
    """Both ends count: 0 accepts everything, PASS_ALL passes everything up."""
    assert threshold_problem(value) is None


@pytest.mark.parametrize("value", [-0.01, 1.00005, PASS_ALL + 1e-6, 2.0, True, False, "0.5", None])
def test_threshold_problem_rejects_everything_else_and_says_why(value: object) -> None:
    """Out of range, a bool (an int to Python) or not a number: the message names the value
    and the range."""
    problem = threshold_problem(value)  # type: ignore[arg-type]
    assert problem == f"{value!r} is not in [0, 1] (or 1.0001: the tier passes every request up)"


# -- the temperature fit, against a grid search written here ----------------------------------


def _documented_grid() -> list[float]:
    """97 temperatures evenly spaced in log T over [0.25, 4], rounded to 3 decimals."""
    low, high = 0.25, 4.0
    step = (math.log(high) - math.log(low)) / 96
    return [round(math.exp(math.log(low) + i * step), 3) for i in range(97)]


def _mean_nll(logits: np.ndarray, labels: np.ndarray, temperature: float) -> float:
    scaled = logits / temperature
    return float(np.mean(logsumexp(scaled, axis=1) - scaled[np.arange(len(labels)), labels]))


def _oracle(logits: np.ndarray, labels: np.ndarray) -> float:
    """The grid temperature with the lowest mean NLL (the first of equals)."""
    grid = _documented_grid()
    losses = [_mean_nll(logits, labels, t) for t in grid]
    return grid[int(np.argmin(losses))]


def _drawn_at(
    temperature: float, *, seed: int, n: int = 6000, classes: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """Logits, and labels drawn from softmax(logits / temperature): a model whose logits are
    ``temperature`` times too sharp."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=(n, classes))
    scaled = logits / temperature
    p = np.exp(scaled - logsumexp(scaled, axis=1, keepdims=True))
    labels = (rng.random((n, 1)) > np.cumsum(p, axis=1)).sum(axis=1)
    return logits, labels


def test_documented_grid_matches_the_module_range() -> None:
    """The oracle's grid spans TEMPERATURE_GRID."""
    grid = _documented_grid()
    assert (grid[0], grid[-1]) == TEMPERATURE_GRID
    assert grid[48] == 1.0


@pytest.mark.parametrize(("true_t", "seed"), [(2.0, 1), (0.5, 2), (1.3, 5)])
def test_fit_on_logits_finds_the_temperature_the_labels_were_drawn_at(true_t: float, seed: int) -> None:
    """Labels sampled at a known temperature: the fit is that grid point of least NLL, and
    with 6000 examples it lies within 10% of the truth."""
    logits, labels = _drawn_at(true_t, seed=seed)
    fitted = fit_temperature(logits, labels, apply_softmax=True)
    assert fitted == _oracle(logits, labels)
    assert abs(fitted - true_t) < 0.1 * true_t


def test_fit_on_probabilities_matches_the_fit_on_their_logits() -> None:
    """Probabilities are turned back into logits (log p): the same NLL curve, the same fit."""
    logits, labels = _drawn_at(1.7, seed=7)
    probabilities = np.exp(logits - logsumexp(logits, axis=1, keepdims=True))
    fitted = fit_temperature(probabilities, labels, apply_softmax=False)
    assert fitted == _oracle(np.log(probabilities), labels)
    assert abs(fitted - 1.7) < 0.17


def test_fit_ignores_a_large_offset_added_to_each_row() -> None:
    """Softmax ignores a constant per row; offsets of +-1000 must neither overflow nor let one
    row's scale underflow another."""
    logits, labels = _drawn_at(2.5, seed=11)
    offsets = np.random.default_rng(12).uniform(-1000.0, 1000.0, size=(len(labels), 1))
    offsets[0] = 1000.0
    offsets[1] = -1000.0
    assert fit_temperature(logits + offsets, labels, apply_softmax=True) == _oracle(logits, labels)


def test_fit_of_perfectly_separated_labels_is_the_lowest_temperature() -> None:
    """Every label's logit leads by 50: the NLL falls as T shrinks (to 0.0 in floating point
    below T of about 1.8), so the smallest grid temperature is the best, ties or not."""
    labels = np.array([0, 1, 2, 1, 0, 2])
    logits = np.zeros((6, 3))
    logits[np.arange(6), labels] = 50.0
    assert fit_temperature(logits, labels, apply_softmax=True) == 0.25


def test_fit_of_very_overconfident_probabilities_is_the_top_of_the_range() -> None:
    """Labels drawn at T = 8, beyond the grid: the NLL still falls at 4, the last point."""
    logits, labels = _drawn_at(8.0, seed=13)
    assert _oracle(logits, labels) == 4.0
    assert fit_temperature(logits, labels, apply_softmax=True) == 4.0


def test_fit_on_probabilities_with_zeros_warns_nothing() -> None:
    """A zero probability is floored before its log (a -inf logit would warn and poison the
    NLL of every temperature)."""
    probabilities = np.array([[0.9, 0.1, 0.0], [0.0, 0.7, 0.3], [0.2, 0.0, 0.8], [0.6, 0.4, 0.0]])
    labels = np.array([0, 1, 0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fitted = fit_temperature(probabilities, labels, apply_softmax=False)
    floored = np.log(np.clip(probabilities, 1e-30, None))
    assert fitted == _oracle(floored, labels)
    assert TEMPERATURE_GRID[0] <= fitted <= TEMPERATURE_GRID[1]


def test_fit_with_no_examples_leaves_the_temperature_at_one() -> None:
    """No labels, no evidence: the neutral temperature, not a grid end."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the mean of no examples
        fitted = fit_temperature(np.empty((0, 3)), np.empty(0, dtype=np.int64), apply_softmax=True)
    assert fitted == 1.0


def test_fit_leaves_the_temperature_at_one_when_a_label_is_ruled_out() -> None:
    """A -inf logit on a label (a masked class) is infinitely unlikely at every temperature:
    no temperature is better than another, so none is chosen over the neutral one."""
    logits, labels = _drawn_at(2.0, seed=17, n=200)
    logits[0, labels[0]] = -np.inf
    assert fit_temperature(logits, labels, apply_softmax=True) == 1.0
