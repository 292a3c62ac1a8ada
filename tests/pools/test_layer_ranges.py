"""``load_to_device_layers``: a range of layers in one copy gives the bytes the
per-layer loads of those layers give, and touches no other layer, page or pool.

Every geometry x layout x backend; pools of separate layer allocations (no all-layer
view) too; hybrid pools (a range of model layers spans groups); bad ranges refused
before any byte moves."""

import pytest
import torch

from kvtier import DeviceKVPool, HostKVPool, HybridHostPool
from kvtier.errors import UsageError
from tests.pools.test_hybrid_pools import PAGE, random_hybrid_device, sizes_of
from tests.support.pools import HYBRID_SPECS, LAYOUT_ORDERS, SPECS, bits, fill_random, random_device_pool, slots

RANGES = [range(0, 1), range(1, 3), range(0, 2)]  # the test specs have 2 layers at least


def _host(spec, layout, page_size, seed):
    src = random_device_pool(spec, 8 * page_size, page_size, seed=seed)
    host = HostKVPool(spec, 6 * page_size, page_size, layout=layout)
    host.backup_from_device_all_layer(src, slots([4, 1, 2, 0], page_size), slots([7, 3, 4, 0], page_size))
    return host


def _layers(pool, spec):
    return {(n, layer): bits(pool.buffer(n, layer)).clone() for n in spec.names for layer in range(spec.layer_num)}


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_a_range_of_layers_is_the_per_layer_loads_of_them(spec_name, layout, io_backend):
    spec, page_size = SPECS[spec_name], 16
    host = _host(spec, layout, page_size, seed=1)
    host_idx, dev_idx = slots([4, 1, 2, 0], page_size), slots([5, 0, 1, 3], page_size)
    for layers in RANGES:
        if layers.stop > spec.layer_num:
            continue
        want = random_device_pool(spec, 8 * page_size, page_size, seed=2)
        got = random_device_pool(spec, 8 * page_size, page_size, seed=2)
        before = _layers(got, spec)
        for layer in layers:
            host.load_to_device_per_layer(want, host_idx, dev_idx, layer, io_backend)
        host.load_to_device_layers(got, host_idx, dev_idx, layers, io_backend)
        for (n, layer), old in before.items():
            now = bits(got.buffer(n, layer))
            assert torch.equal(now, bits(want.buffer(n, layer))), (n, layer, layers)
            assert torch.equal(now, old) == (layer not in layers), (n, layer, layers)  # no other layer written


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_pools_of_separate_layer_allocations_copy_layer_by_layer(layout):
    """A device pool wrapped from per-layer tensors has no all-layer view: the range is
    copied one layer at a time, the same bytes."""
    spec, page_size = SPECS["asym"], 4
    host = _host(spec, layout, page_size, seed=3)
    gen = torch.Generator().manual_seed(4)
    buffers = {n: [torch.empty_like(random_device_pool(spec, 8 * page_size, page_size, seed=5).buffer(n, layer))
                   for layer in range(spec.layer_num)] for n in spec.names}
    for layer_buffers in buffers.values():
        for b in layer_buffers:
            fill_random(b, gen)
    got = DeviceKVPool.from_buffers(spec, buffers, page_size)
    want = DeviceKVPool.from_buffers(spec, {n: [b.clone() for b in bs] for n, bs in buffers.items()}, page_size)
    host_idx, dev_idx = slots([2, 0], page_size), slots([6, 1], page_size)
    host.load_to_device_layers(got, host_idx, dev_idx, range(0, spec.layer_num))
    for layer in range(spec.layer_num):
        host.load_to_device_per_layer(want, host_idx, dev_idx, layer)
    for n in spec.names:
        for layer in range(spec.layer_num):
            assert torch.equal(bits(got.buffer(n, layer)), bits(want.buffer(n, layer))), (n, layer)


@pytest.mark.parametrize("bad", [range(0, 0), range(1, 1), range(-1, 1), range(0, 3, 2), range(1, 0), (0, 1), 0,
                                 range(0, 99)])
def test_bad_ranges_are_refused_before_any_byte_moves(bad):
    spec, page_size = SPECS["mha"], 4
    host = _host(spec, "page_head", page_size, seed=6)
    dst = random_device_pool(spec, 8 * page_size, page_size, seed=7)
    before = _layers(dst, spec)
    with pytest.raises(UsageError, match=rf"layers must be a non-empty range\(start, stop\) of step 1 inside "
                                         rf"\[0, {spec.layer_num}\), got"):
        host.load_to_device_layers(dst, slots([0], page_size), slots([1], page_size), bad)
    assert all(torch.equal(bits(dst.buffer(n, layer)), old) for (n, layer), old in before.items())


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
@pytest.mark.parametrize("spec_name", list(HYBRID_SPECS))
def test_a_range_of_model_layers_spans_the_groups(spec_name, layout):
    """Model layers of several groups in one call: each group's layers of the range, from
    its own pages, the same bytes as the per-layer loads; other layers untouched."""
    spec = HYBRID_SPECS[spec_name]
    sizes = sizes_of(spec)
    src = random_hybrid_device(spec, sizes, seed=1)
    host = HybridHostPool(spec, sizes, PAGE, layout=layout)
    host_pages = {g.name: slots([3, 0] if g.attention.is_full else [1], PAGE) for g in spec.groups}
    host.backup_from_device_all_layer(src, host_pages, {g.name: slots([4, 2] if g.attention.is_full else [4], PAGE)
                                                        for g in spec.groups})
    dev_pages = {g.name: slots([0, 1] if g.attention.is_full else [3], PAGE) for g in spec.groups}
    layers = range(1, spec.layer_num)
    want, got = random_hybrid_device(spec, sizes, seed=2), random_hybrid_device(spec, sizes, seed=2)
    for layer in layers:
        host.load_to_device_per_layer(want, host_pages, dev_pages, layer)
    host.load_to_device_layers(got, host_pages, dev_pages, layers)
    untouched = random_hybrid_device(spec, sizes, seed=2)
    for g in spec.groups:
        for n in g.spec.names:
            for layer in g.layers:
                assert torch.equal(bits(got.buffer(n, layer)), bits(want.buffer(n, layer))), (g.name, n, layer)
                if layer not in layers:
                    assert torch.equal(bits(got.buffer(n, layer)), bits(untouched.buffer(n, layer)))
    with pytest.raises(UsageError, match="layers must be a non-empty range"):
        host.load_to_device_layers(got, host_pages, dev_pages, range(0, spec.layer_num + 1))
