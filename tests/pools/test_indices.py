"""Whole-page index validation, including random page-aligned index sets."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pools.indices import page_slots, page_starts


@settings(max_examples=100, deadline=None)
@given(page_size=st.sampled_from([1, 4, 16]), data=st.data())
def test_random_page_sets_round_trip(page_size, data):
    num_pages = 32
    pages = data.draw(st.lists(st.integers(0, num_pages - 1), max_size=12, unique=True))
    idx = page_slots(torch.tensor(pages, dtype=torch.int64), page_size)
    assert page_starts(idx, page_size=page_size, size=num_pages * page_size, what="x").tolist() == pages


@pytest.mark.parametrize("indices, match", [
    ([0, 1, 2], "3 slots, not a multiple of page_size 4"),
    ([4, 5, 6, 7, 16, 17, 18, 19], r"slots in \[4, 19\], outside the pool's \[0, 16\)"),
    ([-4, -3, -2, -1], "outside"),
    ([2, 3, 4, 5], "starts at slot 2, not a multiple of page_size 4"),
    ([4, 5, 7, 6], "not consecutive"),
])
def test_bad_indices_name_the_numbers(indices, match):
    with pytest.raises(ValueError, match=match):
        page_starts(torch.tensor(indices), page_size=4, size=16, what="host_indices")


def test_dtype_shape_type_and_device_are_checked():
    with pytest.raises(ValueError, match="float32"):
        page_starts(torch.zeros(4), page_size=4, size=16, what="x")
    with pytest.raises(ValueError, match="1-D"):
        page_starts(torch.zeros(1, 4, dtype=torch.int64), page_size=4, size=16, what="x")
    with pytest.raises(ValueError, match="torch.Tensor"):
        page_starts([0, 1, 2, 3], page_size=4, size=16, what="x")
    with pytest.raises(ValueError, match="meta"):
        page_starts(torch.arange(4, device="meta"), page_size=4, size=16, what="x")
    with pytest.raises(ValueError, match="more than once"):
        page_starts(torch.tensor([4, 5, 4, 5]), page_size=2, size=16, what="x", unique=True)
    assert page_starts(torch.tensor([4, 5, 4, 5], dtype=torch.int32), page_size=2, size=16, what="x").tolist() == [2, 2]
