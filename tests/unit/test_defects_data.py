"""The generated ``defects`` data: deterministic, balanced, in the family's input layout, and
with a held-out split that shares no image with the splits trained or calibrated on."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from stratus.errors import ConfigError
from stratus.families.repository import ModelRepository
from stratus.tools.datasets import (
    DEFECT_CLASSES,
    DEFECT_SPLITS,
    Split,
    Splits,
    dataset_for,
    defect_images,
)


@pytest.fixture(scope="module")
def splits() -> Splits:
    return dataset_for("defects")


def test_the_same_seed_gives_the_same_images_and_another_seed_others() -> None:
    first, again, other = defect_images(64, 7), defect_images(64, 7), defect_images(64, 8)
    assert first.x.tobytes() == again.x.tobytes() and np.array_equal(first.y, again.y)
    assert first.x.tobytes() != other.x.tobytes()


def test_shapes_types_range_and_class_balance(splits: Splits) -> None:
    for name, (_, count) in DEFECT_SPLITS.items():
        split: Split = getattr(splits, name)
        assert split.x.shape == (count, 32, 32, 1) and split.x.dtype == np.float32
        assert split.y.shape == (count,) and split.y.dtype == np.int64
        assert float(split.x.min()) >= 0.0 and float(split.x.max()) <= 1.0
        assert np.bincount(split.y, minlength=len(DEFECT_CLASSES)).tolist() == [count // 4] * 4


def test_the_splits_share_no_image(splits: Splits) -> None:
    seen = [{image.tobytes() for image in split.x} for split in (splits.fit, splits.calibration)]
    held_out = {image.tobytes() for image in splits.held_out.x}
    assert len(held_out) == len(splits.held_out)
    assert not held_out & seen[0] and not held_out & seen[1] and not seen[0] & seen[1]


def test_the_classes_differ_where_it_matters(splits: Splits) -> None:
    """A defect is a local departure from the surface: the largest deviation from a pixel's
    neighbourhood is larger, on average, on a defective surface than on a good one."""
    x, y = splits.calibration.x[..., 0], splits.calibration.y
    padded = np.pad(x, ((0, 0), (2, 2), (2, 2)), mode="edge")
    local = sum(padded[:, i : i + 32, j : j + 32] for i in range(5) for j in range(5)) / 25.0
    deviation = np.abs(x - local).max(axis=(1, 2))
    ok = deviation[y == 0].mean()
    assert all(deviation[y == label].mean() > ok for label in (1, 2, 3))


def test_the_data_is_in_the_family_input_layout(splits: Splits, repository: ModelRepository) -> None:
    family = repository.family("defects")
    spec = family.inputs[0]
    assert spec.name == "image" and spec.datatype == "FP32"
    assert splits.held_out.x.shape[1:] == tuple(spec.shape[1:])
    assert tuple(family.outputs[0].shape) == (-1, len(DEFECT_CLASSES))


def test_unknown_families_have_no_data() -> None:
    with pytest.raises(ConfigError, match="no bundled labelled data for family 'parts'"):
        dataset_for("parts")


def test_the_defects_data_needs_no_scikit_learn() -> None:
    code = (
        "import sys; from stratus.tools.datasets import defect_images; defect_images(8, 0); "
        "assert 'sklearn' not in sys.modules, 'sklearn imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
