"""Turning a model's outputs into one confidence per item of a batch.

The router escalates a request while its confidence is below the tier's threshold, so
these functions must be monotone in "how sure the model is" and comparable across the
variants of a family (they all produce probabilities over the same classes).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating[Any]]


class ConfidenceMethod(enum.StrEnum):
    MAX_SOFTMAX = "max_softmax"
    MARGIN = "margin"


def softmax(logits: FloatArray) -> FloatArray:
    """Numerically stable softmax over the last axis."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    result: FloatArray = exp / exp.sum(axis=-1, keepdims=True)
    return result


def max_probability(probabilities: FloatArray) -> FloatArray:
    """Top-1 probability: high when the model puts its mass on one class."""
    result: FloatArray = probabilities.max(axis=-1)
    return result


def margin(probabilities: FloatArray) -> FloatArray:
    """Top-1 minus top-2 probability: low when two classes compete, whatever the rest."""
    if probabilities.shape[-1] < 2:
        return max_probability(probabilities)
    top2 = np.partition(probabilities, -2, axis=-1)[..., -2:]
    result: FloatArray = top2[..., 1] - top2[..., 0]
    return result


def tempered(probabilities: FloatArray, temperature: float) -> FloatArray:
    """Probabilities re-spread as if their logits were divided by ``temperature``.

    Temperature scaling (fitted on the calibration split) keeps every item's top class
    and only changes how sure the model claims to be: T > 1 softens an overconfident
    model, so a threshold means the same share of right answers on every tier.
    """
    if temperature == 1.0:
        return probabilities
    logits = np.log(np.clip(probabilities, np.finfo(np.float64).tiny, None))
    return softmax(logits / temperature)


def confidence(
    scores: FloatArray, *, method: ConfidenceMethod, apply_softmax: bool, temperature: float = 1.0
) -> FloatArray:
    """Confidence per batch item, as the family config (and the variant's temperature) says."""
    values = scores.astype(np.float64)
    probabilities = softmax(values / temperature) if apply_softmax else tempered(values, temperature)
    if method is ConfidenceMethod.MARGIN:
        return margin(probabilities)
    return max_probability(probabilities)
