"""Turning a model's outputs into one confidence per item of a batch.

The router escalates a request while its confidence is below the tier's threshold, so
these functions must be monotone in "how sure the model is" and comparable across the
variants of a family (they all produce probabilities over the same classes). A family's
config names one method:

* ``max_softmax``: the top-1 probability;
* ``margin``: top-1 minus top-2 probability (two classes competing is what matters);
* ``entropy``: ``1 - H(p) / log(K)`` over the K classes: 1 when all the mass is on one
  class, 0 when it is spread evenly (every class counts, not just the top two).

Each lies in [0, 1]; ``stratus models calibrate --compare-methods`` shows which one needs
the smallest share of requests at the top tier for a target accuracy.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from stratus.tiers import Tier

FloatArray = npt.NDArray[np.floating[Any]]


class ConfidenceMethod(enum.StrEnum):
    MAX_SOFTMAX = "max_softmax"
    MARGIN = "margin"
    ENTROPY = "entropy"


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


def normalized_entropy(probabilities: FloatArray) -> FloatArray:
    """``1 - H(p) / log(K)``: 1 for a one-hot answer, 0 for a uniform one (``0 log 0 = 0``)."""
    classes = probabilities.shape[-1]
    if classes < 2:
        return max_probability(probabilities)
    p = np.clip(probabilities, 0.0, 1.0)
    logs = np.log(np.where(p > 0.0, p, 1.0))
    entropy = -(p * logs).sum(axis=-1)
    result: FloatArray = np.clip(1.0 - entropy / np.log(classes), 0.0, 1.0)
    return result


_METHODS = {
    ConfidenceMethod.MAX_SOFTMAX: max_probability,
    ConfidenceMethod.MARGIN: margin,
    ConfidenceMethod.ENTROPY: normalized_entropy,
}


_TINY: Final = np.finfo(np.float64).tiny


def tempered(probabilities: FloatArray, temperature: float) -> FloatArray:
    """Probabilities re-spread as if their logits were divided by ``temperature``.

    Temperature scaling (fitted on the calibration split) keeps every item's top class
    and only changes how sure the model claims to be: T > 1 softens an overconfident
    model, so a threshold means the same share of right answers on every tier.
    """
    if temperature == 1.0:
        return probabilities
    logits = np.log(np.maximum(probabilities, _TINY))  # np.clip's Python wrapper costs more than the call
    return softmax(logits / temperature)


def confidence(
    scores: FloatArray, *, method: ConfidenceMethod, apply_softmax: bool, temperature: float = 1.0
) -> FloatArray:
    """Confidence per batch item, as the family config (and the variant's temperature) says."""
    values = scores.astype(np.float64)
    if method is ConfidenceMethod.MAX_SOFTMAX:  # the top probability, without the whole softmax
        if not apply_softmax and temperature == 1.0:
            return max_probability(values)
        logits = values if apply_softmax else np.log(np.maximum(values, _TINY))
        return _top_probability(logits / temperature)
    probabilities = softmax(values / temperature) if apply_softmax else tempered(values, temperature)
    return _METHODS[method](probabilities)


def _top_probability(logits: FloatArray) -> FloatArray:
    """``max_probability(softmax(logits))``, bit for bit: the top class's term is exp(0) = 1,
    so its probability is 1 / the sum, and every other is no larger."""
    exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
    result: FloatArray = 1.0 / exp.sum(axis=-1)
    return result


# The range fit_temperature searches; a fit at either end may be the end, not the best
# (``stratus.tools.importer.trial.temperature_warning`` says so).
TEMPERATURE_GRID: Final = (0.25, 4.0)


def fit_temperature(
    scores: FloatArray, labels: npt.NDArray[np.integer[Any]], *, apply_softmax: bool
) -> float:
    """The temperature with the lowest negative log-likelihood on labelled examples.

    Fitted on a calibration split (never the held-out one), it makes a variant's confidence
    mean what it says, so one threshold per tier fits every variant of the tier. A grid over
    log T rather than an optimiser: deterministic, and a few hundred examples cannot tell
    neighbouring temperatures apart anyway. ``scores`` are logits when ``apply_softmax``,
    else probabilities.
    """
    values = scores.astype(np.float64)
    logits = values if apply_softmax else np.log(np.clip(values, 1e-30, None))
    rows = np.arange(len(labels))
    best_nll, best_t = np.inf, 1.0
    low, high = TEMPERATURE_GRID
    for temperature in np.round(np.exp(np.linspace(np.log(low), np.log(high), 97)), 3):
        scaled = logits / temperature
        scaled -= scaled.max(axis=1, keepdims=True)
        log_p = scaled - np.log(np.exp(scaled).sum(axis=1, keepdims=True))
        nll = float(-log_p[rows, labels].mean())
        if nll < best_nll - 1e-12:
            best_nll, best_t = nll, float(temperature)
    return best_t


# -- the accept rule: one for the router's cascades, its audits and the SDK --------------------


# A threshold no confidence reaches (the smallest family.toml stores above 1): the tier answers
# nothing and passes every request up. It is how a tier whose model is wrong *with full
# confidence* (an INT8 softmax saturates at 1.0) is taken out of a family's cascade without
# unloading it: it still answers, so audits keep measuring it and can bring it back.
PASS_ALL: Final = 1.0001


def threshold_problem(value: float) -> str | None:
    """Why ``value`` cannot be a threshold (None: it can): a confidence in [0, 1], or PASS_ALL."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (0.0 <= value <= 1.0 or value == PASS_ALL)  # nothing else above 1: it means nothing more
    ):
        return f"{value!r} is not in [0, 1] (or {PASS_ALL}: the tier passes every request up)"
    return None


def threshold_for(tier: Tier, thresholds: Mapping[Tier, float], min_confidence: float | None) -> float | None:
    """The confidence an answer from ``tier`` needs to stop climbing: the request's
    ``min_confidence`` when it gave one, else the family's threshold for the tier; None
    (anything is accepted) where the family has none for it."""
    return min_confidence if min_confidence is not None else thresholds.get(tier)


def accepts(
    confidence: float,
    tier: Tier,
    *,
    thresholds: Mapping[Tier, float],
    min_confidence: float | None,
) -> bool:
    """Whether an answer from ``tier`` is confident enough to stop climbing."""
    threshold = threshold_for(tier, thresholds, min_confidence)
    return threshold is None or confidence >= threshold


def settled(
    confidences: Sequence[float],
    tier: Tier,
    *,
    final: bool,
    thresholds: Mapping[Tier, float],
    min_confidence: float | None,
) -> list[bool]:
    """Which items of an answer from ``tier`` stop climbing: all of a final answer, else
    each item whose own confidence meets the threshold. Unsure items climb alone."""
    if final:
        return [True] * len(confidences)
    return [accepts(c, tier, thresholds=thresholds, min_confidence=min_confidence) for c in confidences]
