"""Confidence methods: entropy and margin, through the one function the agents call."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest

from stratus.execution.running import score
from stratus.families.confidence import (
    ConfidenceMethod,
    confidence,
    margin,
    normalized_entropy,
    softmax,
    tempered,
)
from stratus.families.repository import load_family


def test_entropy_is_one_for_a_sure_answer_and_zero_for_a_uniform_one() -> None:
    p = np.array([[1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0]])
    # H([.5, .5, 0, 0]) = log 2, and log 2 / log 4 = 1/2.
    np.testing.assert_allclose(normalized_entropy(p), [1.0, 0.0, 0.5], atol=1e-12)


def test_entropy_lies_in_zero_one_and_grows_as_the_model_sharpens() -> None:
    logits = np.random.default_rng(0).normal(size=(200, 7))
    values = [normalized_entropy(softmax(logits * scale)) for scale in (0.5, 1.0, 2.0, 4.0)]
    for value in values:
        assert np.all((value >= 0.0) & (value <= 1.0))
    for softer, sharper in itertools.pairwise(values):
        assert np.all(sharper >= softer - 1e-12)


def test_entropy_counts_every_class_where_max_and_margin_see_two() -> None:
    # Same top two probabilities; the rest of the mass spread or piled up.
    spread = np.array([[0.5, 0.2, 0.1, 0.1, 0.1]])
    piled = np.array([[0.5, 0.2, 0.3, 0.0, 0.0]])
    assert normalized_entropy(piled)[0] > normalized_entropy(spread)[0]
    np.testing.assert_allclose(margin(np.array([[0.5, 0.2, 0.1, 0.1, 0.1]])), [0.3])


def test_one_class_is_its_own_confidence() -> None:
    np.testing.assert_allclose(normalized_entropy(np.array([[0.8]])), [0.8])
    np.testing.assert_allclose(margin(np.array([[0.8]])), [0.8])


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        (ConfidenceMethod.MAX_SOFTMAX, [0.7, 0.4]),
        (ConfidenceMethod.MARGIN, [0.5, 0.05]),
        (
            ConfidenceMethod.ENTROPY,
            [
                1 + (0.7 * np.log(0.7) + 0.2 * np.log(0.2) + 0.1 * np.log(0.1)) / np.log(3),
                1 + (0.4 * np.log(0.4) + 0.35 * np.log(0.35) + 0.25 * np.log(0.25)) / np.log(3),
            ],
        ),
    ],
)
def test_confidence_dispatches_each_method_on_probabilities_and_logits(
    method: ConfidenceMethod, expected: list[float]
) -> None:
    probabilities = np.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]])
    np.testing.assert_allclose(confidence(probabilities, method=method, apply_softmax=False), expected)
    logits = np.log(probabilities) + 3.0  # any shift: softmax removes it
    np.testing.assert_allclose(confidence(logits, method=method, apply_softmax=True), expected)


def test_a_family_config_may_name_entropy_and_agents_score_with_it(models_dir: Path, tmp_path: Path) -> None:
    text = (models_dir / "digits" / "family.toml").read_text()
    assert 'method = "max_softmax"' in text
    config = tmp_path / "family.toml"
    config.write_text(text.replace('method = "max_softmax"', 'method = "entropy"'))
    for model in models_dir.joinpath("digits").iterdir():
        if model.name not in ("family.toml", "verified.toml"):
            shutil.copytree(model, tmp_path / model.name) if model.is_dir() else shutil.copy(model, tmp_path)
    family = load_family(config)
    assert family.confidence.method is ConfidenceMethod.ENTROPY
    variant = family.variant("digits-small")
    outputs = {"probabilities": np.array([[0.91] + [0.01] * 9, [0.1] * 10])}
    scores = score(family, variant, outputs)
    expected = confidence(
        outputs["probabilities"],
        method=ConfidenceMethod.ENTROPY,
        apply_softmax=False,
        temperature=variant.temperature,
    )
    np.testing.assert_allclose(scores, expected)
    assert scores[0] > 0.5 > scores[1]


def test_the_top_probability_is_the_whole_softmax_top_bit_for_bit() -> None:
    """max_softmax takes 1 / sum(exp(z - max z)), not the whole softmax: the same numbers,
    for logits and for probabilities (zeros among them), at any temperature."""
    rng = np.random.default_rng(7)
    for trial in range(400):
        logits = rng.normal(size=(int(rng.integers(1, 5)), int(rng.integers(2, 12)))) * rng.uniform(0.1, 20.0)
        probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        if trial % 5 == 0:
            probabilities[0, : probabilities.shape[1] // 2] = 0.0
        for temperature in (1.0, 0.5, 1.7):
            for apply_softmax, scores in ((True, logits), (False, probabilities)):
                values = scores.astype(np.float32).astype(np.float64)
                whole = softmax(values / temperature) if apply_softmax else tempered(values, temperature)
                got = confidence(
                    scores.astype(np.float32),
                    method=ConfidenceMethod.MAX_SOFTMAX,
                    apply_softmax=apply_softmax,
                    temperature=temperature,
                )
                assert np.array_equal(got, whole.max(axis=-1))
