"""The labelled data Stratus ships with, none of it downloaded.

* ``digits``: scikit-learn's bundled 8x8 handwritten digits. The held-out split is exactly
  ``train_test_split(X, y, test_size=0.3, stratify=y, random_state=0)``; the calibration
  split is carved from the training part.
* ``defects``: 32x32 grayscale surfaces from a factory line, generated here with fixed
  seeds (numpy only): ``ok``, ``scratch``, ``spot`` or ``crack``. Each split comes from
  its own seed, so the held-out images are never among those trained or calibrated on.

One definition of the splits, used by the model builder, ``models verify`` and
``models calibrate``: nothing is trained or calibrated on the held-out split, and the
models never see the calibration split while training.
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
class Splits:
    """A family's labelled data: trained on, calibrated on, and held out."""

    fit: Split
    calibration: Split
    held_out: Split


def _sklearn() -> tuple[Any, Any]:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ConfigError(
            "the digits data comes with scikit-learn; install it with: pip install -e '.[models]' in the checkout (or 'stratus-router[models]')"
        ) from None
    return load_digits, train_test_split


def digits_splits() -> Splits:
    """Fit, calibration and held-out splits; pixels divided by 16 into [0, 1]."""
    load_digits, train_test_split = _sklearn()
    x_all, y_all = load_digits(return_X_y=True)
    x = (x_all / 16.0).astype(np.float32)
    y = y_all.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, stratify=y, random_state=0)
    x_fit, x_cal, y_fit, y_cal = train_test_split(
        x_train, y_train, test_size=0.25, stratify=y_train, random_state=1
    )
    return Splits(fit=Split(x_fit, y_fit), calibration=Split(x_cal, y_cal), held_out=Split(x_test, y_test))


# ---------------------------------------------------------------------------------------------
# defects: generated surfaces
# ---------------------------------------------------------------------------------------------

DEFECT_CLASSES = ("ok", "scratch", "spot", "crack")
DEFECT_SIDE = 32
# Each split's (seed, images). The generator draws everything from one seeded stream, so a
# split is the same on every machine and no two splits share an image.
DEFECT_SPLITS = {"fit": (1101, 12000), "calibration": (2202, 2000), "held_out": (3303, 2000)}

Images = npt.NDArray[np.float32]  # [n, side, side]
_Rng = np.random.Generator


def _grid() -> tuple[Images, Images]:
    """Pixel coordinates (row, column), as [side, side] arrays."""
    axis = np.arange(DEFECT_SIDE, dtype=np.float32)
    rows, cols = np.meshgrid(axis, axis, indexing="ij")
    return rows, cols


def _upsampling(low: int) -> npt.NDArray[np.float32]:
    """[side, low]: bilinear interpolation from ``low`` evenly spaced samples to every pixel."""
    position = np.linspace(0.0, low - 1.0, DEFECT_SIDE)
    weights = np.maximum(0.0, 1.0 - np.abs(position[:, None] - np.arange(low)[None, :]))
    return weights.astype(np.float32)


def _surface(rng: _Rng, count: int) -> Images:
    """Textured metal: tilted lighting, blotches, and grain (brushed when its gratings share
    a direction, cross-hatched when they do not), at each image's own strength."""
    axis = np.arange(DEFECT_SIDE, dtype=np.float32) - (DEFECT_SIDE - 1) / 2.0
    tilt = rng.uniform(-0.006, 0.006, (count, 2, 1)).astype(np.float32)
    image = (tilt[:, 0] * axis)[:, :, None] + (tilt[:, 1] * axis)[:, None, :]
    upsample = _upsampling(5)
    blotches = rng.normal(0.0, 1.0, (count, 5, 5)).astype(np.float32)
    image += rng.uniform(0.0, 0.05, (count, 1, 1)).astype(np.float32) * (upsample @ blotches @ upsample.T)
    return image + _grain(rng, count, axis)


def _grain(rng: _Rng, count: int, axis: npt.NDArray[np.float32]) -> Images:
    """Three gratings per image, sin(a*row + b*col + phase), each the sum of two outer
    products (sin(x + y) = sin x cos y + cos x sin y): one small matrix product per image."""
    direction = rng.uniform(0.0, np.pi, (count, 1)) + rng.uniform(0.0, 1.6, (count, 1)) * rng.uniform(
        -1.0, 1.0, (count, 3)
    )
    frequency = rng.uniform(0.5, 2.4, (count, 3))
    phase = rng.uniform(0.0, 2 * np.pi, (count, 3))
    strength = rng.uniform(0.0, 0.03, (count, 3))
    along_rows = (frequency * np.sin(direction))[:, None, :] * axis[None, :, None] + phase[:, None, :]
    along_cols = (frequency * np.cos(direction))[:, None, :] * axis[None, :, None]
    left = np.concatenate([strength[:, None] * np.sin(along_rows), strength[:, None] * np.cos(along_rows)], 2)
    right = np.concatenate([np.cos(along_cols), np.sin(along_cols)], axis=2)
    return left.astype(np.float32) @ right.astype(np.float32).transpose(0, 2, 1)


def _splat(
    count: int, owner: npt.NDArray[np.int64], row: Any, col: Any, weight: Any, *, wide: bool = False
) -> Images:
    """Points with weights, spread bilinearly onto ``count`` images, then blurred to ~1.5 px
    wide strokes (~2.5 px ``wide``); a stroke of unit weight per pixel of length peaks near 1
    (near 0.7 when wide)."""
    top, left = np.floor(row), np.floor(col)
    indices, shares = [], []
    for d_row, d_col in ((0, 0), (0, 1), (1, 0), (1, 1)):
        r, c = top + d_row, left + d_col
        inside = (r >= 0) & (r < DEFECT_SIDE) & (c >= 0) & (c < DEFECT_SIDE)
        share = weight * (1.0 - np.abs(row - r)) * (1.0 - np.abs(col - c))
        indices.append(
            ((owner * DEFECT_SIDE + r.astype(np.int64)) * DEFECT_SIDE + c.astype(np.int64))[inside]
        )
        shares.append(share[inside])
    flat = np.bincount(
        np.concatenate(indices), weights=np.concatenate(shares), minlength=count * DEFECT_SIDE * DEFECT_SIDE
    )
    blurred = _blur(flat.reshape(count, DEFECT_SIDE, DEFECT_SIDE))
    strokes: Images = (2.0 * (_blur(blurred) if wide else blurred)).astype(np.float32)
    return strokes


def _blur(images: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The separable [1, 2, 1] / 4 blur, zero outside the image."""
    rows = np.pad(images, ((0, 0), (1, 1), (0, 0)))
    down = 0.25 * rows[:, :-2] + 0.5 * rows[:, 1:-1] + 0.25 * rows[:, 2:]
    cols = np.pad(down, ((0, 0), (0, 0), (1, 1)))
    return 0.25 * cols[:, :, :-2] + 0.5 * cols[:, :, 1:-1] + 0.25 * cols[:, :, 2:]


def _scratches(rng: _Rng, count: int) -> Images:
    """Straight, thin, bright or dark, fading at both ends."""
    points = 64
    centre = rng.uniform(4.0, DEFECT_SIDE - 5.0, (count, 2, 1))
    angle = rng.uniform(0.0, np.pi, (count, 1))
    length = rng.uniform(10.0, 26.0, (count, 1))
    t = np.linspace(-0.5, 0.5, points)[None, :]
    row = centre[:, 0] + t * length * np.sin(angle)
    col = centre[:, 1] + t * length * np.cos(angle)
    weight = (length / points) * (1.0 - (2.0 * t) ** 4)
    owner = np.repeat(np.arange(count), points).reshape(count, points)
    return _contrast(rng, count, 0.14, 0.7, dark=0.5) * _splat(count, owner, row, col, weight)


def _cracks(rng: _Rng, count: int) -> Images:
    """Dark, jagged paths: a zigzag of short segments about a heading, mostly with a branch,
    the whole crack centred somewhere inside the image."""
    trunk = _walk(rng, count, np.zeros((count, 2)), 9)
    fork = 4 * 6  # the branch leaves from the trunk's fifth vertex
    branch = _walk(rng, count, np.stack([trunk[0][:, fork], trunk[1][:, fork]], axis=1), 4)
    keep = (rng.random(count) < 0.7)[:, None]
    row = np.concatenate([trunk[0], branch[0]], axis=1)
    col = np.concatenate([trunk[1], branch[1]], axis=1)
    weight = np.concatenate([trunk[2], branch[2] * keep], axis=1)
    centre = rng.uniform(9.0, DEFECT_SIDE - 10.0, (count, 2))
    row += centre[:, :1] - (row.min(axis=1, keepdims=True) + row.max(axis=1, keepdims=True)) / 2
    col += centre[:, 1:] - (col.min(axis=1, keepdims=True) + col.max(axis=1, keepdims=True)) / 2
    owner = np.repeat(np.arange(count), row.shape[1]).reshape(count, -1)
    return _contrast(rng, count, 0.16, 0.8, dark=1.0) * _splat(count, owner, row, col, weight, wide=True)


def _walk(rng: _Rng, count: int, start: Any, segments: int) -> tuple[Any, Any, Any]:
    """(rows, columns, weights) of points along a zigzag path from ``start``; 6 per segment."""
    per = 6
    heading = rng.uniform(0.0, 2 * np.pi, (count, 1))
    angle = heading + rng.uniform(-1.2, 1.2, (count, segments))
    step = rng.uniform(1.5, 3.5, (count, segments))
    rows = np.concatenate([start[:, :1], start[:, :1] + np.cumsum(step * np.sin(angle), axis=1)], axis=1)
    cols = np.concatenate([start[:, 1:], start[:, 1:] + np.cumsum(step * np.cos(angle), axis=1)], axis=1)
    t = np.arange(per) / per
    row = (rows[:, :-1, None] + (rows[:, 1:] - rows[:, :-1])[:, :, None] * t).reshape(count, -1)
    col = (cols[:, :-1, None] + (cols[:, 1:] - cols[:, :-1])[:, :, None] * t).reshape(count, -1)
    weight = np.repeat(step / per, per, axis=1)
    return row, col, weight


def _spots(rng: _Rng, count: int) -> Images:
    """Small round or oval pits (dark) and residue (bright)."""
    rows, cols = _grid()
    centre = rng.uniform(3.0, DEFECT_SIDE - 4.0, (count, 2, 1, 1)).astype(np.float32)
    radius = rng.uniform(1.0, 2.2, (count, 1, 1)).astype(np.float32)
    squash = rng.uniform(0.6, 1.0, (count, 1, 1)).astype(np.float32)
    angle = rng.uniform(0.0, np.pi, (count, 1, 1)).astype(np.float32)
    d_row, d_col = rows - centre[:, 0], cols - centre[:, 1]
    along = d_row * np.cos(angle) + d_col * np.sin(angle)
    across = (d_col * np.cos(angle) - d_row * np.sin(angle)) / squash
    blob = np.exp(-0.5 * (along**2 + across**2) / radius**2)
    return _contrast(rng, count, 0.16, 0.8, dark=0.6) * blob


def _contrast(rng: _Rng, count: int, low: float, high: float, *, dark: float) -> Images:
    """Each defect's signed strength: faint ones are common (log-uniform), ``dark`` of them dark."""
    strength = np.exp(rng.uniform(np.log(low), np.log(high), count))
    sign = np.where(rng.random(count) < dark, -1.0, 1.0)
    return (strength * sign).astype(np.float32).reshape(count, 1, 1)


def _smudges(rng: _Rng, count: int) -> Images:
    """Broad, faint stains on a third of all surfaces, whatever their class: not defects."""
    axis = np.arange(DEFECT_SIDE, dtype=np.float32)
    centre = rng.uniform(0.0, DEFECT_SIDE - 1.0, (count, 2, 1)).astype(np.float32)
    radius = rng.uniform(3.5, 8.0, (count, 1)).astype(np.float32)
    strength = rng.uniform(-0.08, 0.08, (count, 1)) * (rng.random((count, 1)) < 0.35)
    down = (strength * np.exp(-0.5 * ((axis - centre[:, 0]) / radius) ** 2)).astype(np.float32)
    across = np.exp(-0.5 * ((axis - centre[:, 1]) / radius) ** 2)
    smudges: Images = down.reshape(count, DEFECT_SIDE, 1) * across.reshape(count, 1, DEFECT_SIDE)
    return smudges


_DRAW = {"scratch": _scratches, "spot": _spots, "crack": _cracks}


def defect_images(count: int, seed: int) -> Split:
    """``count`` labelled surfaces, an equal share of each class, NHWC ``[count, 32, 32, 1]``
    in [0, 1]: lighting level and contrast, texture, defect strength and sensor noise all
    vary, and faint defects are as common as plain ones."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(count) % len(DEFECT_CLASSES))
    image = _surface(rng, count) + _smudges(rng, count)
    for label, name in enumerate(DEFECT_CLASSES):
        chosen = np.flatnonzero(labels == label)
        if name in _DRAW:
            image[chosen] += _DRAW[name](rng, len(chosen))
    gain = rng.uniform(0.7, 1.3, (count, 1, 1)).astype(np.float32)
    level = rng.uniform(0.3, 0.7, (count, 1, 1)).astype(np.float32)
    noise = rng.uniform(0.01, 0.05, (count, 1, 1)).astype(np.float32)
    image = level + gain * image + noise * rng.standard_normal(image.shape, dtype=np.float32)
    x = np.clip(image, 0.0, 1.0).astype(np.float32)[..., None]
    return Split(x, labels.astype(np.int64))


def defects_splits() -> Splits:
    """Fit, calibration and held-out splits, each from its own seed."""
    return Splits(**{name: defect_images(count, seed) for name, (seed, count) in DEFECT_SPLITS.items()})


_DATASETS: dict[str, Any] = {"digits": digits_splits, "defects": defects_splits}


def dataset_for(family: str) -> Splits:
    """The labelled data of a shipped family."""
    make = _DATASETS.get(family)
    if make is None:
        raise ConfigError(
            f"no bundled labelled data for family '{family}' (only {', '.join(map(repr, _DATASETS))})"
        )
    splits: Splits = make()
    return splits
