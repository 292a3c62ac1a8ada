"""Pools of hybrid models: one pool per layer group, per-group indices, model layer ids.

Bytes are compared exactly (as ints): device -> host -> device per group and per
layer, and flat pages carried between the groups' pools in different layouts."""

import pytest
import torch

from kvtier import DeviceKVPool, HostKVPool, HybridDevicePool, HybridHostPool, HybridSpec
from tests.support.pools import HYBRID_SPECS, LAYOUT_ORDERS, SPECS, bits, fill_random, slots

PAGE = 4


def random_hybrid_device(spec: HybridSpec, sizes, seed: int) -> HybridDevicePool:
    pool = HybridDevicePool(spec, sizes, PAGE)
    gen = torch.Generator().manual_seed(seed)
    for g in spec.groups:
        for name in g.spec.names:
            for layer in g.layers:
                fill_random(pool.buffer(name, layer), gen)
    return pool


def sizes_of(spec: HybridSpec) -> dict[str, int]:
    """Smaller pools for sliding groups, as a window-aware cache sizes them."""
    return {g.name: (8 if g.attention.is_full else 5) * PAGE for g in spec.groups}


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("spec_name", list(HYBRID_SPECS))
def test_backup_then_per_layer_loads_move_each_groups_pages_exactly(spec_name, layout):
    spec = HYBRID_SPECS[spec_name]
    sizes = sizes_of(spec)
    src = random_hybrid_device(spec, sizes, seed=1)
    host = HybridHostPool(spec, sizes, PAGE, layout=layout)
    assert host.sizes == sizes and host.available_size() == sizes
    picks = {g.name: ([3, 0] if g.attention.is_full else [1], [4, 2] if g.attention.is_full else [4])
             for g in spec.groups}  # group -> (host pages, device pages)
    host.backup_from_device_all_layer(src, {n: slots(h, PAGE) for n, (h, _) in picks.items()},
                                      {n: slots(d, PAGE) for n, (_, d) in picks.items()})
    dst = random_hybrid_device(spec, sizes, seed=2)
    before = {(n, layer): bits(dst.buffer(n, layer)).clone()
              for g in spec.groups for n in g.spec.names for layer in g.layers}
    targets = {n: [0, 1] if len(h) == 2 else [3] for n, (h, _) in picks.items()}
    for layer in range(spec.layer_num):  # model layer ids, in model order
        host.load_to_device_per_layer(dst, {n: slots(h, PAGE) for n, (h, _) in picks.items()},
                                      {n: slots(t, PAGE) for n, t in targets.items()}, layer)
    for g in spec.groups:
        _, dev_pages = picks[g.name]
        for name in g.spec.names:
            for layer in g.layers:
                got, want, old = bits(dst.buffer(name, layer)), bits(src.buffer(name, layer)), before[(name, layer)]
                for page in range(sizes[g.name] // PAGE):
                    rows = slice(page * PAGE, (page + 1) * PAGE)
                    if page in targets[g.name]:
                        source = dev_pages[targets[g.name].index(page)]
                        assert torch.equal(got[rows], want[source * PAGE:(source + 1) * PAGE]), (g.name, layer)
                    else:
                        assert torch.equal(got[rows], old[rows]), (g.name, layer, page)  # no stray write


def test_a_layer_of_a_group_left_out_copies_nothing():
    spec = HYBRID_SPECS["mimo"]
    src = random_hybrid_device(spec, 8 * PAGE, seed=3)
    host = HybridHostPool(spec, 8 * PAGE, PAGE)
    host.backup_from_device_all_layer(src, {"full": slots([0], PAGE)}, {"full": slots([1], PAGE)})
    dst = random_hybrid_device(spec, 8 * PAGE, seed=4)
    before = bits(dst.buffer("k", 1)).clone()
    host.load_to_device_per_layer(dst, {"full": slots([0], PAGE)}, {"full": slots([2], PAGE)}, 1)  # a sliding layer
    assert torch.equal(bits(dst.buffer("k", 1)), before)
    host.load_to_device_per_layer(dst, {"full": slots([0], PAGE)}, {"full": slots([2], PAGE)}, 5)  # full layer 5
    assert torch.equal(bits(dst.buffer("k", 5))[2 * PAGE:3 * PAGE], bits(src.buffer("k", 5))[PAGE:2 * PAGE])
    # where nothing moves, bad arguments are still refused, as a plain pool refuses them with no slots
    with pytest.raises(ValueError, match="unknown io_backend 'bogus'"):
        host.load_to_device_per_layer(dst, {"full": slots([0], PAGE)}, {"full": slots([2], PAGE)}, 1,
                                      io_backend="bogus")
    with pytest.raises(ValueError, match="page_size"):
        host.load_to_device_per_layer(HybridDevicePool(spec, 8 * 2 * PAGE, 2 * PAGE), {}, {}, 1)


@pytest.mark.parametrize("spec_name", list(HYBRID_SPECS))
def test_flat_pages_carry_between_layouts_per_group(spec_name):
    spec = HYBRID_SPECS[spec_name]
    src = random_hybrid_device(spec, 4 * PAGE, seed=5)
    a = HybridHostPool(spec, 4 * PAGE, PAGE, layout="page_first")
    b = HybridHostPool(spec, 4 * PAGE, PAGE, layout="page_head")
    every = {g.name: slots([0, 1, 2, 3], PAGE) for g in spec.groups}
    a.backup_from_device_all_layer(src, every, every)
    for name, pool in a:
        for page in range(4):
            b[name].set_from_flat_data_page(page * PAGE, pool.get_data_page(page * PAGE, flat=True))
    dst = HybridDevicePool(spec, 4 * PAGE, PAGE)
    for layer in range(spec.layer_num):
        b.load_to_device_per_layer(dst, every, every, layer)
    for g in spec.groups:
        for name in g.spec.names:
            for layer in g.layers:
                assert torch.equal(bits(dst.buffer(name, layer)), bits(src.buffer(name, layer)))
        assert b[g.name].supports_split_heads and not a[g.name].supports_split_heads
        if all(c.head_num % 2 == 0 for c in g.spec.components):
            ptrs, sizes = b[g.name].get_split_heads_page_buffer_meta(slots([1], PAGE), 2)
            assert len(ptrs) == 2 * len(g.spec.components) and sum(sizes) == b[g.name].page_bytes


def test_engine_tensors_are_wrapped_per_group_without_a_copy():
    spec = HYBRID_SPECS["mimo"]
    tensors = {g.name: {c.name: [torch.zeros(3 * PAGE, c.head_num, c.head_dim, dtype=g.spec.dtype)
                                 for _ in g.layers] for c in g.spec.components} for g in spec.groups}
    pool = HybridDevicePool.from_buffers(spec, tensors, PAGE)
    assert pool.buffer("v", 4).data_ptr() == tensors["swa"]["v"][3].data_ptr()  # layer 4 is swa's 4th
    assert pool.buffer("k", 5).data_ptr() == tensors["full"]["k"][1].data_ptr()
    assert pool.sizes == {"full": 3 * PAGE, "swa": 3 * PAGE}


def test_a_plain_spec_is_one_group():
    spec = SPECS["asym"]
    host = HybridHostPool(spec, 2 * PAGE, PAGE, layout="layer_first")
    assert host.spec == HybridSpec.of(spec) and isinstance(host["kv"], HostKVPool)
    dev = HybridDevicePool(spec, 2 * PAGE, PAGE)
    assert isinstance(dev["kv"], DeviceKVPool) and dev.buffer("k", 2).shape == (2 * PAGE, 4, 12)


def test_bad_input_is_refused_before_any_byte_moves():
    spec = HYBRID_SPECS["mimo"]
    src = random_hybrid_device(spec, 4 * PAGE, seed=6)
    host = HybridHostPool(spec, 4 * PAGE, PAGE)
    before = {(name, n): bits(b).clone() for name, p in host for n, b in p.buffers.items()}
    with pytest.raises(ValueError, match=r"groups \['nope'\]"):
        host.backup_from_device_all_layer(src, {"nope": slots([0], PAGE)}, {"nope": slots([0], PAGE)})
    # the second group's slots are bad: the first group moves nothing either
    with pytest.raises(ValueError, match="outside the pool"):
        host.backup_from_device_all_layer(src, {"full": slots([0], PAGE), "swa": slots([9], PAGE)},
                                          {"full": slots([0], PAGE), "swa": slots([0], PAGE)})
    with pytest.raises(ValueError, match=r"host_indices names groups \['full'\], device_indices \['swa'\]"):
        host.backup_from_device_all_layer(src, {"full": slots([0], PAGE)}, {"swa": slots([0], PAGE)})
    assert all(torch.equal(bits(b), before[(name, n)]) for name, p in host for n, b in p.buffers.items())
    with pytest.raises(ValueError, match=r"layer 6 is out of range \[0, 6\)"):
        host.load_to_device_per_layer(src, {}, {}, 6)
    with pytest.raises(ValueError, match="sizes must name exactly the groups"):
        HybridHostPool(spec, {"full": 4 * PAGE}, PAGE)
    with pytest.raises(ValueError, match="HybridDevicePool of spec"):
        host.backup_from_device_all_layer(HybridDevicePool(HYBRID_SPECS["oss"], 4 * PAGE, PAGE), {}, {})
    full = {"full": slots([0], PAGE)}
    with pytest.raises(ValueError, match=f"device pool page_size {2 * PAGE} != host pool page_size {PAGE}"):
        host.backup_from_device_all_layer(HybridDevicePool(spec, 8 * PAGE, 2 * PAGE), full, full)
    with pytest.raises(ValueError, match="io_backend"):
        host.load_to_device_layers(src, full, full, range(0, 6), io_backend="nope")
    assert all(torch.equal(bits(b), before[(name, n)]) for name, p in host for n, b in p.buffers.items())
    with pytest.raises(ValueError, match="one page size"):
        HybridHostPool.from_pools(spec, {"full": HostKVPool(spec.group("full").spec, 8, 4),
                                         "swa": HostKVPool(spec.group("swa").spec, 8, 8)})
    with pytest.raises(ValueError, match="pool of group 'swa' has spec"):
        HybridDevicePool.from_pools(spec, {"full": DeviceKVPool(spec.group("full").spec, 8, 4),
                                           "swa": DeviceKVPool(spec.group("full").spec, 8, 4)})
