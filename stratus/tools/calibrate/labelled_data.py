"""The labelled data ``stratus models calibrate`` (and ``verify --data``, ``import --data``)
reads: a shipped family's bundled splits, a ``.npz`` file, or a folder the router captured
into (``--capture``, labels being the top tier's answers); checked against the family and
split once, stratified by label with a fixed seed."""

from __future__ import annotations

import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from stratus import datatypes
from stratus.datatypes import Array
from stratus.errors import ConfigError
from stratus.families.spec import FamilySpec
from stratus.tools.datasets import Split, dataset_for

Indices = npt.NDArray[np.intp]


# A .npz file's examples: this share of each class chooses thresholds, the rest is reported.
CALIBRATION_SHARE: Final = 0.6
SPLIT_SEED: Final = 0
MIN_EXAMPLES: Final = 20
LABELS: Final = "labels"
# Which captured items a folder gives: audits are an unbiased sample of what settled below the
# top tier; escalated items are the unsure ones only (biased towards the hard cases).
SOURCES: Final = ("audit", "escalated", "all")


@dataclass(frozen=True)
class LabelledData:
    """The split thresholds are chosen on, and the split only reported, with their names."""

    calibration: Split
    report: Split
    calibration_name: str
    report_name: str


def bundled_data(family: FamilySpec) -> LabelledData:
    """A shipped family's own calibration and held-out splits."""
    try:
        data = dataset_for(family.name)
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}; pass --data FILE.npz with arrays '{family.inputs[0].name}' and '{LABELS}'"
        ) from None
    return LabelledData(
        calibration=data.calibration,
        report=data.held_out,
        calibration_name=f"the bundled calibration split ({len(data.calibration)} examples)",
        report_name=f"the bundled held-out split ({len(data.held_out)} examples)",
    )


def load_labelled(family: FamilySpec, path: Path, *, source: str = "audit") -> LabelledData:
    """``--data PATH``: a capture folder (its ``source`` items) or a labelled .npz file."""
    if path.is_dir():
        return _split(checked(family, path, captured_arrays(family, path, source)), path)
    return load_npz(family, path)


def captured_arrays(family: FamilySpec, folder: Path, source: str) -> dict[str, Array]:
    """A capture folder's items of the family as arrays, ``labels`` being the top tier's answers."""
    from stratus.obs.capture import read_dataset

    if source not in SOURCES:
        raise ConfigError(f"--data-source {source}: expected one of {', '.join(SOURCES)}")
    try:
        inputs, labels = read_dataset(folder, family.name, source=None if source == "all" else source)
    except FileNotFoundError:
        raise ConfigError(
            f"{folder}: holds no captured {'' if source == 'all' else source + ' '}items of '{family.name}' "
            f"(a router writes them with --capture {folder} --capture-families {family.name})"
        ) from None
    return {**inputs, LABELS: labels}


def load_npz(
    family: FamilySpec, path: Path, *, share: float = CALIBRATION_SHARE, seed: int = SPLIT_SEED
) -> LabelledData:
    """A labelled .npz file, checked against the family, split stratified by label."""
    return _split(read_npz(family, path), path, share=share, seed=seed)


def _split(whole: Split, path: Path, *, share: float = CALIBRATION_SHARE, seed: int = SPLIT_SEED) -> LabelledData:
    first, second = stratified_split(whole.y, share, seed)
    if not len(second):
        raise ConfigError(f"{path}: too few examples per class to hold any out for the report")
    return LabelledData(
        calibration=Split(whole.x[first], whole.y[first]),
        report=Split(whole.x[second], whole.y[second]),
        calibration_name=f"{len(first)} of the {len(whole)} examples in {path.name} "
        f"({share:.0%} of each class, seed {seed})",
        report_name=f"the other {len(second)} examples in {path.name}",
    )


def read_npz(family: FamilySpec, path: Path) -> Split:
    """The examples of a .npz file: one array named after the family's (single) input, and
    ``labels``."""
    return checked(family, path, _npz_arrays(path))


def checked(family: FamilySpec, path: Path, arrays: dict[str, Array]) -> Split:
    """The examples in ``arrays`` (from ``path``); anything that does not fit the family is
    refused, naming the array."""
    if len(family.inputs) != 1:
        raise ConfigError(
            f"{path}: family '{family.name}' has {len(family.inputs)} inputs; "
            "labelled data is read for single-input families only"
        )
    spec = family.inputs[0]
    for name, what in ((spec.name, "the family's input"), (LABELS, "the class of each example")):
        if name not in arrays:
            raise ConfigError(f"{path}: no array '{name}' ({what}); the file holds {sorted(arrays)}")
    x, y = arrays[spec.name], arrays[LABELS]
    _check_examples(path, spec.name, spec.datatype, spec.shape, x)
    _check_labels(path, y, len(x), _classes(family))
    if len(y) < MIN_EXAMPLES:
        raise ConfigError(f"{path}: too few examples ({len(y)}); calibrating needs at least {MIN_EXAMPLES}")
    return Split(x, y.astype(np.int64))


def _npz_arrays(path: Path) -> dict[str, Array]:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ConfigError(f"{path}: holds a single array, not a .npz archive of named arrays")
        with loaded as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(f"{path}: not a readable .npz archive ({exc})") from None


def _check_examples(path: Path, name: str, datatype: str, shape: Sequence[int], x: Array) -> None:
    try:
        got = datatypes.datatype_of(x)
    except Exception:  # a dtype with no protocol datatype: reported below like any mismatch
        got = str(x.dtype)
    if got != datatype:
        wanted = datatypes.numpy_dtype(datatype, tensor=name)
        raise ConfigError(
            f"{path}: array '{name}' is {x.dtype}; the family's input is {datatype} (numpy {wanted})"
        )
    fits = x.ndim == len(shape) and all(d in (-1, g) for d, g in zip(shape[1:], x.shape[1:], strict=True))
    if not fits:
        wanted_shape = ["N", *(d if d != -1 else "any" for d in shape[1:])]
        raise ConfigError(
            f"{path}: array '{name}' has shape {list(x.shape)}; the family's input takes {wanted_shape}"
        )


def _check_labels(path: Path, y: Array, count: int, classes: int | None) -> None:
    if y.dtype.kind not in "iu":
        raise ConfigError(f"{path}: array '{LABELS}' is {y.dtype}; labels must be integers")
    if y.ndim != 1 or len(y) != count:
        raise ConfigError(
            f"{path}: array '{LABELS}' has shape {list(y.shape)}; it must be [{count}], one label per example"
        )
    bad = y[(y < 0) | (y >= (classes if classes is not None else np.iinfo(np.int64).max))]
    if len(bad):
        limit = f"{classes} classes (0..{classes - 1})" if classes is not None else "no negative classes"
        raise ConfigError(f"{path}: label {int(bad[0])} is out of range: the output has {limit}")


def _classes(family: FamilySpec) -> int | None:
    """The number of classes of the confidence output, when its config fixes it."""
    output = next(o for o in family.outputs if o.name == family.confidence.output)
    return output.shape[-1] if len(output.shape) == 2 and output.shape[-1] > 0 else None


def stratified_split(labels: Array, share: float, seed: int) -> tuple[Indices, Indices]:
    """Indices of ``share`` of each class (at least one), and of the rest; both sorted."""
    rng = np.random.default_rng(seed)
    first, second = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        cut = min(max(math.floor(len(members) * share + 0.5), 1), len(members))
        first.append(members[:cut])
        second.append(members[cut:])
    return np.sort(np.concatenate(first)), np.sort(np.concatenate(second))
