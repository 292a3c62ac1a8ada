"""Device -> host -> device round trips for every geometry x layout x backend x page size."""

import pytest
import torch

from kvtier import DeviceKVPool, HostKVPool
from tests.support.pools import LAYOUT_ORDERS, SPECS, bits, fill_random, random_device_pool, record_copy_threads, slots

BACKENDS = ["direct", "kernel", "auto"]
PAGE_SIZES = [1, 16]


def host_bytes(host: HostKVPool) -> dict[str, torch.Tensor]:
    return {n: bits(b).clone() for n, b in host.buffers.items()}


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("io_backend", BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_round_trip_without_stray_writes(spec_name, layout, io_backend, page_size):
    spec = SPECS[spec_name]
    src = random_device_pool(spec, 8 * page_size, page_size, seed=1)
    host = HostKVPool(spec, 6 * page_size, page_size, layout=layout)
    gen = torch.Generator().manual_seed(2)
    for buf in host.buffers.values():
        fill_random(buf, gen)  # sentinel content: must survive outside the target pages
    host_pages, dev_pages = [4, 1, 2, 0], [7, 3, 4, 0]  # 1->2 and 3->4 coalesce; the rest do not
    before = host_bytes(host)
    host.backup_from_device_all_layer(src, slots(host_pages, page_size), slots(dev_pages, page_size),
                                      io_backend=io_backend)

    after = host_bytes(host)
    for name, buf in after.items():
        page_axis = LAYOUT_ORDERS[layout].index("page")
        for p in range(6):
            untouched = torch.equal(buf.select(page_axis, p), before[name].select(page_axis, p))
            assert untouched == (p not in host_pages), (name, p)

    dst = random_device_pool(spec, 8 * page_size, page_size, seed=3)
    dst_before = {n: [bits(dst.buffer(n, l)).clone() for l in range(spec.layer_num)] for n in spec.names}
    load_pages = [5, 2, 6, 1]
    for layer in range(spec.layer_num):
        host.load_to_device_per_layer(dst, slots(host_pages, page_size), slots(load_pages, page_size), layer,
                                      io_backend=io_backend)
    for name in spec.names:
        for layer in range(spec.layer_num):
            got, orig, old = bits(dst.buffer(name, layer)), bits(src.buffer(name, layer)), dst_before[name][layer]
            for dp in range(8):
                want = orig[dev_pages[load_pages.index(dp)] * page_size:][:page_size] if dp in load_pages \
                    else old[dp * page_size:(dp + 1) * page_size]
                assert torch.equal(got[dp * page_size:(dp + 1) * page_size], want), (name, layer, dp)


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_load_one_layer_leaves_other_layers(layout):
    spec = SPECS["asym"]
    src = random_device_pool(spec, 32, 4, seed=5)
    host = HostKVPool(spec, 32, 4, layout=layout)
    idx = host.alloc(32)
    host.backup_from_device_all_layer(src, idx, idx)
    dst = DeviceKVPool(spec, 32, 4)
    for name in spec.names:
        for layer in range(spec.layer_num):
            dst.buffer(name, layer).fill_(0.5)
    host.load_to_device_per_layer(dst, idx, idx, 1)
    for name in spec.names:
        assert torch.equal(bits(dst.buffer(name, 1)), bits(src.buffer(name, 1)))
        for layer in (0, 2):
            assert bool((dst.buffer(name, layer) == 0.5).all())


def test_kept_layer_pairs_serve_each_device_pool_and_die_with_it():
    """A per-layer load keeps its layer's view pairs per device pool: a second device pool
    gets its own (its bytes, not the first's), and a device pool that is gone leaves
    nothing behind (the kept pairs view its memory)."""
    import gc

    spec = SPECS["asym"]
    src = random_device_pool(spec, 32, 4, seed=5)
    host = HostKVPool(spec, 32, 4, layout="page_first")
    idx = host.alloc(32)
    host.backup_from_device_all_layer(src, idx, idx)
    firsts = []
    for seed in (6, 7):
        dst = random_device_pool(spec, 32, 4, seed=seed)
        host.load_to_device_per_layer(dst, idx, idx, 1)
        for name in spec.names:
            assert torch.equal(bits(dst.buffer(name, 1)), bits(src.buffer(name, 1)))
        firsts.append(dst)
    assert len(host._load_pairs) == 2  # one per device pool
    del dst, firsts
    gc.collect()
    assert len(host._load_pairs) == 0


def test_a_device_pool_that_cannot_be_a_key_still_loads():
    """A DeviceKVPool subclass that defines ``__eq__`` alone is unhashable: its per-layer
    loads take ``copy_pages``' path, with the same bytes."""
    class Compared(DeviceKVPool):
        def __eq__(self, other):
            return self is other

    spec = SPECS["asym"]
    src = random_device_pool(spec, 32, 4, seed=5)
    host = HostKVPool(spec, 32, 4, layout="page_head")
    idx = host.alloc(32)
    host.backup_from_device_all_layer(src, idx, idx)
    dst = Compared(spec, 32, 4)
    for layer in range(spec.layer_num):
        host.load_to_device_per_layer(dst, idx, idx, layer)
    for name in spec.names:
        for layer in range(spec.layer_num):
            assert torch.equal(bits(dst.buffer(name, layer)), bits(src.buffer(name, layer)))
    assert len(host._load_pairs) == 0


def test_from_buffers_separate_and_strided_engine_tensors():
    """Engine tensors: separate allocations (no all-layer view) and slices of one block."""
    spec = SPECS["asym"]
    src = random_device_pool(spec, 16, 4, seed=7)
    separate = {n: [src.buffer(n, l).clone() for l in range(spec.layer_num)] for n in spec.names}
    blocks = {n: torch.stack(separate[n]) for n in spec.names}
    sliced = {n: list(blocks[n].unbind(0)) for n in spec.names}
    for buffers in (separate, sliced):
        dev = DeviceKVPool.from_buffers(spec, buffers, 4)
        assert (dev.page_views["k"].all_layers is None) == (buffers is separate)
        host = HostKVPool(spec, 16, 4, layout="page_head")
        host.backup_from_device_all_layer(dev, slots([0, 1], 4), slots([3, 1], 4))
        out = DeviceKVPool.from_buffers(spec, {n: [torch.zeros_like(t) for t in buffers[n]] for n in spec.names}, 4)
        for layer in range(spec.layer_num):
            host.load_to_device_per_layer(out, slots([0, 1], 4), slots([3, 1], 4), layer)
        for n in spec.names:
            for layer in range(spec.layer_num):
                assert torch.equal(bits(out.buffer(n, layer))[4:8], bits(buffers[n][layer])[4:8])
                assert torch.equal(bits(out.buffer(n, layer))[12:16], bits(buffers[n][layer])[12:16])
                assert not out.buffer(n, layer)[:4].any()


def test_threaded_copy_splits_work_and_stays_exact(monkeypatch):
    """With the threading threshold at 0 every copy splits across threads; bytes must not change."""
    started, compiled = record_copy_threads(monkeypatch)
    spec, page_size = SPECS["asym"], 16
    host = HostKVPool(spec, 16 * page_size, page_size, layout="page_head", copy_threads=3)
    src = random_device_pool(spec, 16 * page_size, page_size, seed=9)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()
    host.backup_from_device_all_layer(src, slots(perm, page_size), slots(list(range(16)), page_size))
    # 3 threads for all components at once: the compiled call's own, or 2 started + the calling one
    if compiled:
        assert compiled == [3] and not started
    else:
        assert len(started) == 2
    dst = DeviceKVPool(spec, 16 * page_size, page_size)
    for layer in range(spec.layer_num):
        host.load_to_device_per_layer(dst, slots(perm, page_size), slots(list(range(16)), page_size), layer)
    for n in spec.names:
        for layer in range(spec.layer_num):
            assert torch.equal(bits(dst.buffer(n, layer)), bits(src.buffer(n, layer)))
