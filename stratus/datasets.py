"""The labelled data Stratus ships with: scikit-learn's bundled digits (no download).

One definition of the splits, used by the model builder, ``models verify`` and
``models calibrate``: the held-out split is exactly
``train_test_split(X, y, test_size=0.3, stratify=y, random_state=0)`` and nothing is
trained or calibrated on it; the calibration split is carved from the training part
and the models never see it while training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from stratus.errors import ConfigError

Features = npt.NDArray[np.float32]
Labels = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Split:
    x: Features
    y: Labels

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class DigitsSplits:
    fit: Split
    calibration: Split
    held_out: Split


def _sklearn() -> tuple[Any, Any]:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ConfigError(
            "the digits data comes with scikit-learn; install it with: pip install 'stratus[models]'"
        ) from None
    return load_digits, train_test_split


def digits_splits() -> DigitsSplits:
    """Fit, calibration and held-out splits; pixels divided by 16 into [0, 1]."""
    load_digits, train_test_split = _sklearn()
    x_all, y_all = load_digits(return_X_y=True)
    x = (x_all / 16.0).astype(np.float32)
    y = y_all.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, stratify=y, random_state=0)
    x_fit, x_cal, y_fit, y_cal = train_test_split(
        x_train, y_train, test_size=0.25, stratify=y_train, random_state=1
    )
    return DigitsSplits(
        fit=Split(x_fit, y_fit), calibration=Split(x_cal, y_cal), held_out=Split(x_test, y_test)
    )


def dataset_for(family: str) -> DigitsSplits:
    """The labelled data of a shipped family."""
    if family != "digits":
        raise ConfigError(f"no bundled labelled data for family '{family}' (only 'digits')")
    return digits_splits()
