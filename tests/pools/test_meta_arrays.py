"""Span metadata: the array forms equal the list forms, both equal a per-page reference
read off the buffers' own views, and both point at the page's bytes."""

import ctypes

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvtier import HostKVPool, UnsupportedLayoutError
from tests.support.pools import LAYOUT_ORDERS, SPECS, fill_random, slots

PAGES = 7


def random_pool(spec, layout, page_size, seed=3):
    pool = HostKVPool(spec, PAGES * page_size, page_size, layout=layout)
    gen = torch.Generator().manual_seed(seed)
    for buf in pool.buffers.values():
        fill_random(buf, gen)
    return pool


def split_factors(spec):
    return [f for f in range(1, 9) if all(c.head_num % f == 0 for c in spec.components)]


def reference_spans(pool, pages, split_factor=None):
    """One ``(ptr, nbytes)`` per span, from a torch view of each piece (no stride arithmetic)."""
    order = LAYOUT_ORDERS[pool.layout]
    axis = order.index("page")
    spans = []
    for p in pages:
        if split_factor is not None:  # (page, head, ...): each head group of each component
            for g in range(split_factor):
                for buf in pool.buffers.values():
                    hg = buf.shape[1] // split_factor
                    piece = buf[p, g * hg:(g + 1) * hg]
                    spans.append((piece.data_ptr(), piece.numel() * piece.element_size()))
            continue
        outer = [()]
        for n in pool.buffers[pool.spec.names[0]].shape[:axis]:
            outer = [(*o, i) for o in outer for i in range(n)]
        for o in outer:
            for buf in pool.buffers.values():
                piece = buf[(*o, p)]
                assert piece.is_contiguous()
                spans.append((piece.data_ptr(), piece.numel() * piece.element_size()))
    return spans


def assert_same(arrays, lists):
    ptrs, sizes = arrays
    ptr_list, size_list = lists
    for a in (ptrs, sizes):
        assert isinstance(a, np.ndarray) and a.dtype == np.int64 and a.ndim == 1
    assert all(type(x) is int for x in ptr_list + size_list)
    assert ptrs.tolist() == ptr_list and sizes.tolist() == size_list


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_array_form_equals_list_form_and_the_reference(spec_name, layout, page_size):
    spec = SPECS[spec_name]
    pool = random_pool(spec, layout, page_size)
    for pages in ([], [3], [6, 0, 4, 1], list(range(PAGES))[::-1]):
        idx = slots(pages, page_size)
        lists = pool.get_page_buffer_meta(idx)
        assert_same(pool.get_page_buffer_meta_array(idx), lists)
        assert list(zip(*lists)) == reference_spans(pool, pages)
        if pool.supports_split_heads:
            for f in split_factors(spec):
                lists = pool.get_split_heads_page_buffer_meta(idx, f)
                assert_same(pool.get_split_heads_page_buffer_meta_array(idx, f), lists)
                assert list(zip(*lists)) == reference_spans(pool, pages, f)


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_array_spans_hold_the_page_bytes(layout):
    spec, page_size = SPECS["asym"], 4
    pool = random_pool(spec, layout, page_size, seed=9)
    pages = [5, 2]
    ptrs, sizes = pool.get_page_buffer_meta_array(slots(pages, page_size))
    got = b"".join(ctypes.string_at(int(p), int(s)) for p, s in zip(ptrs, sizes))
    axis = LAYOUT_ORDERS[layout].index("page")
    want = []
    for p in pages:  # outer axes, then component, then the page's native bytes
        outer = pool.buffers["k"].shape[:axis]
        for o in np.ndindex(*outer):
            for buf in pool.buffers.values():
                want.append(buf[(*o, p)].contiguous().view(torch.uint8).numpy().tobytes())
    assert got == b"".join(want)
    if pool.supports_split_heads:
        ptrs, sizes = pool.get_split_heads_page_buffer_meta_array(slots(pages, page_size), 2)
        got = b"".join(ctypes.string_at(int(p), int(s)) for p, s in zip(ptrs, sizes))
        want = [buf[p, g * (buf.shape[1] // 2):(g + 1) * (buf.shape[1] // 2)].contiguous().view(torch.uint8)
                .numpy().tobytes() for p in pages for g in range(2) for buf in pool.buffers.values()]
        assert got == b"".join(want)


def test_arrays_are_new_each_call():
    pool = random_pool(SPECS["mha"], "page_first", 4)
    ptrs, sizes = pool.get_page_buffer_meta_array(slots([1, 2], 4))
    again = pool.get_page_buffer_meta_array(slots([1, 2], 4))
    ptrs[:] = 0
    sizes[:] = 0
    assert again[0].tolist() == pool.get_page_buffer_meta(slots([1, 2], 4))[0]
    assert pool.get_page_buffer_meta_array(slots([1, 2], 4))[1].tolist() == again[1].tolist() != [0] * 4


def test_array_forms_validate_like_the_list_forms():
    pool = random_pool(SPECS["asym"], "page_head", 4)
    bad = [(torch.tensor([0, 1, 2]), "not a multiple of page_size"),
           (torch.tensor([4, 5, 7, 6]), "not consecutive"),
           (torch.tensor([28, 29, 30, 31]), "outside the pool"),
           (torch.zeros(4), "float32")]
    for idx, match in bad:
        for call in (pool.get_page_buffer_meta, pool.get_page_buffer_meta_array,
                     lambda i: pool.get_split_heads_page_buffer_meta_array(i, 2)):
            with pytest.raises(ValueError, match=match):
                call(idx)
    with pytest.raises(ValueError, match="4 heads.*split_factor 3"):
        pool.get_split_heads_page_buffer_meta_array(slots([0], 4), 3)
    with pytest.raises(ValueError, match="split_factor"):
        pool.get_split_heads_page_buffer_meta_array(slots([0], 4), True)
    with pytest.raises(UnsupportedLayoutError):
        random_pool(SPECS["asym"], "page_first", 4).get_split_heads_page_buffer_meta_array(slots([0], 4), 2)


#: what ``Tensor.numpy()`` and ``.tolist()`` record: no kernel, nothing for the intra-op pool
_NO_COMPUTE = {"aten::detach", "detach", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::to",
               "aten::alias"}


@pytest.mark.parametrize("pages", [1, 2048])
def test_metadata_runs_no_torch_kernel(pages):
    """torch's element-wise ops go through its intra-op thread pool, which stalls on a
    loaded machine: the metadata path does its arithmetic in numpy."""
    page_size = 16
    pool = HostKVPool(SPECS["asym"], pages * page_size, page_size, layout="page_head", device="meta")
    idx = slots(list(range(pages))[::-1], page_size)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pool.get_page_buffer_meta(idx)
        pool.get_page_buffer_meta_array(idx)
        pool.get_split_heads_page_buffer_meta(idx, 2)
        pool.get_split_heads_page_buffer_meta_array(idx, 4)
    assert {e.name for e in prof.events()} <= _NO_COMPUTE


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_wrapped_buffers_in_separate_allocations(layout):
    """Each component's own base address: the array form follows it as the list form does."""
    spec, page_size = SPECS["three"], 2
    sizes = {"page": PAGES, "slot": page_size, "layer": spec.layer_num}
    buffers = {c.name: torch.zeros(tuple({**sizes, "head": c.head_num, "dim": c.head_dim}[a]
                                         for a in LAYOUT_ORDERS[layout]), dtype=spec.dtype)
               for c in spec.components}
    pool = HostKVPool.from_buffers(spec, buffers, page_size, layout=layout)
    idx = slots([4, 0, 6], page_size)
    lists = pool.get_page_buffer_meta(idx)
    assert_same(pool.get_page_buffer_meta_array(idx), lists)
    assert list(zip(*lists)) == reference_spans(pool, [4, 0, 6])
    if pool.supports_split_heads:
        lists = pool.get_split_heads_page_buffer_meta(idx, 1)
        assert_same(pool.get_split_heads_page_buffer_meta_array(idx, 1), lists)
        assert list(zip(*lists)) == reference_spans(pool, [4, 0, 6], 1)
