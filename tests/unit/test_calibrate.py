"""Cascade simulation and threshold choice on small hand-checked cases."""

from __future__ import annotations

import numpy as np
import pytest

from stratus.errors import ConfigError
from stratus.families.confidence import (
    PASS_ALL,
    ConfidenceMethod,
    confidence,
    margin,
    max_probability,
    softmax,
    tempered,
)
from stratus.families.suggest import (
    TierScores,
    candidate_thresholds,
    cascade,
    for_max_escalation,
    for_target_accuracy,
)
from stratus.tiers import Tier


def scores() -> list[TierScores]:
    # Four requests. The device is right on 0 and 1 (confident) and wrong on 2 (confident!) and 3 (unsure).
    device = TierScores(
        Tier.DEVICE, "s", np.array([0.95, 0.9, 0.8, 0.4]), np.array([True, True, False, False])
    )
    edge = TierScores(Tier.EDGE, "m", np.array([0.9, 0.9, 0.7, 0.6]), np.array([True, True, True, False]))
    cloud = TierScores(Tier.CLOUD, "l", np.array([1.0, 1.0, 1.0, 1.0]), np.array([True, True, True, True]))
    return [device, edge, cloud]


def test_cascade_answers_on_the_lowest_confident_tier() -> None:
    outcome = cascade(scores(), (0.85, 0.65))
    # device answers 0 and 1; edge answers 2 (0.7 >= 0.65); cloud answers 3.
    assert outcome.reached == (1.0, 0.5, 0.25)
    assert outcome.accuracy == 1.0
    low = cascade(scores(), (0.5, 0.5))  # device answers 0, 1, 2 (wrong); edge answers 3 (wrong)
    assert low.reached == (1.0, 0.25, 0.0)
    assert low.accuracy == 0.5


def test_target_accuracy_picks_the_cheapest_thresholds_that_reach_it() -> None:
    chosen = for_target_accuracy(scores(), 1.0)
    outcome = cascade(scores(), chosen)
    assert outcome.accuracy == 1.0
    assert outcome.reached[-1] == 0.25  # only the request nobody below can answer goes to the top
    with pytest.raises(ConfigError, match="no thresholds reach accuracy"):
        bad = scores()
        bad[2] = TierScores(Tier.CLOUD, "l", bad[2].confidence, np.array([False] * 4))
        for_target_accuracy(bad, 1.0)


def test_max_escalation_caps_the_top_tier_and_prefers_expected_then_counted_accuracy() -> None:
    capped = cascade(scores(), for_max_escalation(scores(), 0.25))
    assert capped.reached[2] <= 0.25
    # The device's 0.8 on request 2 beats the edge's 0.7: confidences are taken as calibrated.
    assert capped.reached == (1.0, 0.25, 0.25)
    assert capped.expected == pytest.approx((0.95 + 0.9 + 0.8 + 1.0) / 4)
    nothing_up = cascade(scores(), for_max_escalation(scores(), 0.0))
    assert nothing_up.reached[2] == 0.0
    assert nothing_up.accuracy == 0.5  # the device keeps 2 (0.8 > 0.7), the edge answers 3: both wrong
    # With no cap, every threshold goes as high as it can: all requests reach the top.
    assert cascade(scores(), for_max_escalation(scores(), 1.0)).reached[2] == 1.0


def test_counted_accuracy_breaks_ties_of_expected_accuracy() -> None:
    tied = scores()
    # Request 2: the device and the edge are equally sure, only the edge is right.
    tied[0] = TierScores(Tier.DEVICE, "s", np.array([0.95, 0.9, 0.7, 0.4]), tied[0].correct)
    capped = cascade(tied, for_max_escalation(tied, 0.25))
    assert capped.accuracy == 1.0 and capped.reached[2] == 0.25


def test_temperature_softens_or_sharpens_without_changing_the_answer() -> None:
    probabilities = np.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]])
    soft = confidence(
        probabilities, method=ConfidenceMethod.MAX_SOFTMAX, apply_softmax=False, temperature=2.0
    )
    sharp = confidence(
        probabilities, method=ConfidenceMethod.MAX_SOFTMAX, apply_softmax=False, temperature=0.5
    )
    plain = confidence(probabilities, method=ConfidenceMethod.MAX_SOFTMAX, apply_softmax=False)
    assert np.all(soft < plain) and np.all(sharp > plain)
    np.testing.assert_allclose(tempered(probabilities, 0.5).argmax(axis=1), [0, 0])
    np.testing.assert_allclose(tempered(probabilities, 0.5)[0], softmax(np.log(probabilities[0]) * 2.0))
    logits = np.log(probabilities)
    np.testing.assert_allclose(
        confidence(logits, method=ConfidenceMethod.MAX_SOFTMAX, apply_softmax=True, temperature=0.5), sharp
    )


def test_confidence_functions() -> None:
    probabilities = np.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]])
    np.testing.assert_allclose(max_probability(probabilities), [0.7, 0.4])
    np.testing.assert_allclose(margin(probabilities), [0.5, 0.05])
    logits = np.log(probabilities)
    np.testing.assert_allclose(softmax(logits), probabilities)
    np.testing.assert_allclose(
        confidence(logits, method=ConfidenceMethod.MARGIN, apply_softmax=True), [0.5, 0.05]
    )


def test_candidate_thresholds_are_what_family_toml_can_store() -> None:
    """Written with four decimals, a threshold must be the very one the cascade was run with."""
    values = np.random.default_rng(0).random(500) * 0.98
    candidates = candidate_thresholds(values)
    assert all(float(f"{t:.4f}") == t for t in candidates)
    assert candidates[0] == 0.0 and candidates[-1] > values.max()
    assert len(candidates) > 50
    below_one = candidate_thresholds(np.array([0.2, 0.99999]))
    assert max(below_one) == 1.0  # just above 0.99999, as family.toml stores it
    saturated = candidate_thresholds(np.array([0.2, 0.99999, 1.0]))
    assert max(saturated) == PASS_ALL  # the one threshold a confidence of 1.0 does not reach
    assert cascade([TierScores(Tier.DEVICE, "d", np.array([1.0]), np.array([False])),
                    TierScores(Tier.CLOUD, "c", np.array([1.0]), np.array([True]))], (PASS_ALL,)).accuracy == 1.0
