"""Flat pages (canonical, layout-independent) and zero-copy span metadata, checked byte by byte."""

import ctypes

import pytest
import torch

from kvtier import HostKVPool, UnsupportedLayoutError
from tests.support.pools import (LAYOUT_ORDERS, SPECS, bits, flat_page, logical_page, native_order,
                                 random_device_pool, slots)

PAGE_SIZES = [1, 16]


def filled_host(spec, layout, page_size, host_pages, dev_pages, seed=11):
    dev = random_device_pool(spec, 8 * page_size, page_size, seed=seed)
    host = HostKVPool(spec, 6 * page_size, page_size, layout=layout)
    host.backup_from_device_all_layer(dev, slots(host_pages, page_size), slots(dev_pages, page_size))
    return dev, host


def read(ptr: int, size: int) -> bytes:
    return ctypes.string_at(ptr, size)


def raw(t: torch.Tensor) -> bytes:
    return bits(t.contiguous()).numpy().tobytes()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_flat_page_is_canonical_and_moves_between_layouts(spec_name, layout, page_size):
    spec = SPECS[spec_name]
    dev, host = filled_host(spec, layout, page_size, [3, 0], [5, 2])
    page = host.get_data_page(3 * page_size)
    assert page.dtype == spec.dtype and page.dim() == 1
    assert torch.equal(bits(page), bits(flat_page(dev, 5 * page_size, page_size)))
    assert torch.equal(bits(host.get_dummy_flat_data_page()), bits(torch.zeros_like(page)))
    for other in LAYOUT_ORDERS:
        target = HostKVPool(spec, 6 * page_size, page_size, layout=other)
        target.set_from_flat_data_page(4 * page_size, page)
        assert torch.equal(bits(target.get_data_page(4 * page_size)), bits(page))
        native = target.get_data_page(4 * page_size, flat=False)
        for name in spec.names:
            want = native_order(logical_page(dev, name, 5 * page_size, page_size), other)
            assert torch.equal(bits(native[name]), bits(want))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_page_buffer_meta_spans_hold_native_bytes(spec_name, layout, page_size):
    spec = SPECS[spec_name]
    host_pages, dev_pages = [4, 1, 2], [0, 6, 3]
    dev, host = filled_host(spec, layout, page_size, host_pages, dev_pages)
    ptrs, sizes = host.get_page_buffer_meta(slots(host_pages, page_size))
    expected = []
    for dp in dev_pages:
        pages = {n: logical_page(dev, n, dp * page_size, page_size) for n in spec.names}  # (slot, layer, head, dim)
        if layout == "layer_first":  # per page, per layer, per component: (slot, head, dim)
            expected += [raw(pages[n][:, layer]) for layer in range(spec.layer_num) for n in spec.names]
        else:  # per page, per component: the whole page in native order
            expected += [raw(native_order(pages[n], layout)) for n in spec.names]
    assert sizes == [len(e) for e in expected]
    assert [read(p, s) for p, s in zip(ptrs, sizes)] == expected
    if host.page_format == "comp-layer-slot-head-dim":  # page_first_direct spans are flat pages
        per_page = len(spec.names)
        for i, dp in enumerate(dev_pages):
            joined = b"".join(expected[i * per_page:(i + 1) * per_page])
            assert joined == raw(flat_page(dev, dp * page_size, page_size))


@pytest.mark.parametrize("split_factor", [1, 2])
@pytest.mark.parametrize("spec_name", ["mha", "asym", "three_even"])
def test_split_heads_spans_hold_each_head_group(spec_name, split_factor):
    from kvtier import Component, KVSpec

    spec = SPECS.get(spec_name) or KVSpec(2, (Component("k", 2, 8), Component("v", 4, 4), Component("i", 2, 6)),
                                          torch.float16)
    page_size = 4
    dev, host = filled_host(spec, "page_head", page_size, [5, 2], [1, 7])
    assert host.supports_split_heads
    ptrs, sizes = host.get_split_heads_page_buffer_meta(slots([5, 2], page_size), split_factor)
    expected = []
    for dp in (1, 7):
        for g in range(split_factor):
            for c in spec.components:
                hg = c.head_num // split_factor
                page = logical_page(dev, c.name, dp * page_size, page_size)[:, :, g * hg:(g + 1) * hg]
                expected.append(raw(page.permute(2, 0, 1, 3)))  # (head, slot, layer, dim)
    assert sizes == [len(e) for e in expected]
    assert [read(p, s) for p, s in zip(ptrs, sizes)] == expected


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_split_heads_elsewhere_raises_unsupported_layout(layout):
    host = HostKVPool(SPECS["asym"], 8, 4, layout=layout)
    assert not host.supports_split_heads
    with pytest.raises(UnsupportedLayoutError, match="page_head"):
        host.get_split_heads_page_buffer_meta(slots([0], 4), 2)
    with pytest.raises(NotImplementedError):
        host.get_split_heads_page_buffer_meta(slots([0], 4), 2)


def test_split_factor_must_divide_every_head_count():
    host = HostKVPool(SPECS["asym"], 8, 4, layout="page_head")  # 4 heads
    with pytest.raises(ValueError, match="4 heads.*split_factor 3"):
        host.get_split_heads_page_buffer_meta(slots([0], 4), 3)
    with pytest.raises(ValueError, match="split_factor"):
        host.get_split_heads_page_buffer_meta(slots([0], 4), 0)
    mla = HostKVPool(SPECS["mla"], 8, 4, layout="page_head")
    with pytest.raises(ValueError, match="1 heads"):
        mla.get_split_heads_page_buffer_meta(slots([0], 4), 2)


def test_page_format_names_the_native_byte_order():
    formats = {lay: HostKVPool(SPECS["mha"], 4, 4, layout=lay).page_format for lay in LAYOUT_ORDERS}
    assert formats["page_first_direct"] == "comp-layer-slot-head-dim"  # same bytes as the flat page
    assert len(set(formats.values())) == 4
