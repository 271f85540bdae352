"""What one message on a shared stream may carry, and how many items a Work may merge."""

from __future__ import annotations

import pytest

from router.backends.agent import items_that_fit
from stratus.datatypes import checked_shape
from stratus.errors import InvalidInput
from stratus.sched.batching import BatchKey
from stratus.serving.channels import MAX_MESSAGE_BYTES, MAX_WORK_BYTES, check_fits


def key(*inputs: tuple[str, str, tuple[int, ...]]) -> BatchKey:
    return BatchKey(variant="v", inputs=inputs)


def test_a_work_merges_no_more_items_than_a_link_carries() -> None:
    image = key(("image", "FP32", (3, 224, 224)))  # 588 KiB an item: 6 fit in 4 MiB, never --max-batch 32
    assert items_that_fit(image) == MAX_WORK_BYTES // (3 * 224 * 224 * 4) == 6
    two = key(("a", "FP32", (64,)), ("b", "INT64", (8,)))  # every input of an item counts
    assert items_that_fit(two) == MAX_WORK_BYTES // (64 * 4 + 8 * 8)
    assert items_that_fit(key(("text_input", "BYTES", ()))) == MAX_WORK_BYTES  # variable size: not capped here


def test_a_message_near_the_stream_limit_is_refused_alone() -> None:
    check_fits(MAX_WORK_BYTES, "a Work")
    with pytest.raises(InvalidInput, match=r"a Work would be 4128769 bytes, over the 4128768-byte limit"):
        check_fits(MAX_WORK_BYTES + 1, "a Work")
    assert MAX_MESSAGE_BYTES - MAX_WORK_BYTES == 64 * 1024  # room for the Work's own fields


@pytest.mark.parametrize("shape", [[0, 2**40, 2**40], [2**32, 0], [0] * 3 + [2**31 + 1]])
def test_an_empty_shape_with_impossible_dimensions_is_refused(shape: list[int]) -> None:
    with pytest.raises(InvalidInput, match="more than the limit of 2147483648"):
        checked_shape(shape, tensor="x")
    assert checked_shape([0, 2**31], tensor="x") == (0, 2**31)  # at the limit: an empty array numpy makes
