"""HostKVPool.from_buffers: an engine's own host tensors, wrapped in place (no copy)."""

import pytest
import torch

from kvtier import HostKVPool, KVSpec
from tests.support.pools import LAYOUT_ORDERS, SPECS, bits, fill_random, flat_page, random_device_pool, slots

PAGE_SIZE = 4
PAGES = 5


def engine_buffers(spec, layout, pages=PAGES, page_size=PAGE_SIZE, shared=True):
    """Tensors laid out as an engine would allocate them: in ``layout`` order, either
    carved from one allocation (``shared``) or one allocation per component."""
    sizes = {"page": pages, "slot": page_size, "layer": spec.layer_num}
    shapes = {c.name: tuple({**sizes, "head": c.head_num, "dim": c.head_dim}[a] for a in LAYOUT_ORDERS[layout])
              for c in spec.components}
    if not shared:
        return {n: torch.zeros(s, dtype=spec.dtype) for n, s in shapes.items()}
    numels = [torch.Size(s).numel() for s in shapes.values()]
    flat = torch.zeros(sum(numels), dtype=spec.dtype)
    return {n: t.view(s) for (n, s), t in zip(shapes.items(), flat.split(numels))}


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_wrapped_pool_reads_and_writes_the_engine_tensors_in_place(spec_name, layout):
    spec = SPECS[spec_name]
    buffers = engine_buffers(spec, layout)
    pool = HostKVPool.from_buffers(spec, buffers, PAGE_SIZE, layout=layout)
    assert (pool.size, pool.num_pages, pool.layout) == (PAGES * PAGE_SIZE, PAGES, layout)
    for name, buf in buffers.items():
        assert pool.buffers[name].data_ptr() == buf.data_ptr()
    dev = random_device_pool(spec, 4 * PAGE_SIZE, PAGE_SIZE, seed=3)
    pool.backup_from_device_all_layer(dev, slots([4, 1], PAGE_SIZE), slots([2, 0], PAGE_SIZE))
    # the bytes landed in the engine's tensors: a pool allocated by kvtier agrees
    reference = HostKVPool(spec, PAGES * PAGE_SIZE, PAGE_SIZE, layout=layout)
    reference.raw.zero_()
    reference.backup_from_device_all_layer(dev, slots([4, 1], PAGE_SIZE), slots([2, 0], PAGE_SIZE))
    for name, buf in buffers.items():
        assert torch.equal(bits(buf), bits(reference.buffers[name]))
    assert torch.equal(bits(pool.get_data_page(4 * PAGE_SIZE)), bits(flat_page(dev, 2 * PAGE_SIZE, PAGE_SIZE)))
    # and writes made by the engine are seen by the pool
    gen = torch.Generator().manual_seed(5)
    for buf in buffers.values():
        fill_random(buf, gen)
    assert torch.equal(bits(pool.get_data_page(0)),
                       bits(torch.cat([v.all_layers[0].transpose(0, 1).reshape(-1) for v in pool.page_views.values()])))


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_page_buffer_meta_points_into_the_engine_tensors(layout):
    spec = SPECS["asym"]
    buffers = engine_buffers(spec, layout, shared=False)
    pool = HostKVPool.from_buffers(spec, buffers, PAGE_SIZE, layout=layout)
    ptrs, sizes = pool.get_page_buffer_meta(slots([2], PAGE_SIZE))
    lo_hi = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers.values()]
    for ptr, size in zip(ptrs, sizes):
        assert any(lo <= ptr and ptr + size <= hi for lo, hi in lo_hi)
    assert sum(sizes) == pool.page_bytes



def test_split_heads_spans_of_a_single_head_engine_tensor_stay_in_its_pages():
    """A single-head component (an MLA latent) may come with any stride on its size-1 head
    axis and still be contiguous. Its head-group spans are sized from the shapes: for
    one group, exactly its page span (before, from that stride: three pages' bytes,
    running past the tensor's memory)."""
    spec = KVSpec.mla(2, 8, 4, dtype=torch.bfloat16)  # one component "kv": 1 head of 12
    buf = torch.zeros(1, PAGES, PAGE_SIZE, spec.layer_num, 12, dtype=spec.dtype).transpose(0, 1)
    assert buf.is_contiguous() and buf.stride(1) != PAGE_SIZE * spec.layer_num * 12
    pool = HostKVPool.from_buffers(spec, {"kv": buf}, PAGE_SIZE, layout="page_head")
    page = slots([PAGES - 1], PAGE_SIZE)
    ptrs, sizes = pool.get_page_buffer_meta(page)
    assert pool.get_split_heads_page_buffer_meta(page, 1) == (ptrs, sizes)
    assert ptrs[0] + sizes[0] == buf.data_ptr() + buf.numel() * buf.element_size()  # the last page ends the tensor

def test_raw_is_the_shared_allocation_else_regions_list_each():
    spec = SPECS["asym"]
    shared = HostKVPool.from_buffers(spec, engine_buffers(spec, "page_first"), PAGE_SIZE)
    start = shared.buffers["k"].untyped_storage().data_ptr()
    assert shared.raw is not None and shared.raw.data_ptr() == start
    assert shared.regions == [(start, shared.raw.numel())]
    buffers = engine_buffers(spec, "page_first", shared=False)
    separate = HostKVPool.from_buffers(spec, buffers, PAGE_SIZE)
    assert separate.raw is None
    assert separate.regions == sorted((b.data_ptr(), b.numel() * b.element_size()) for b in buffers.values())
    allocated = HostKVPool(spec, 8, PAGE_SIZE)
    assert allocated.regions == [(allocated.raw.data_ptr(), allocated.raw.numel())]


@pytest.mark.parametrize("change, message", [
    (lambda b: b.pop("v"), "exactly the components"),
    (lambda b: b.update(k=b["k"][:, :2]), "has shape"),
    (lambda b: b.update(k=b["k"].float()), "dtype"),
    (lambda b: b.update(k=b["k"].transpose(0, 1).contiguous().transpose(0, 1)), "not contiguous"),
    (lambda b: b.update(k=b["k"][0]), "-D tensor"),
    (lambda b: b.update(v=b["v"][:2]), "has shape"),
])
def test_wrong_buffers_raise_naming_the_mismatch(change, message):
    spec = KVSpec.mha(2, 2, 8, v_head_dim=4)
    buffers = engine_buffers(spec, "page_first")
    change(buffers)
    with pytest.raises(ValueError, match=message):
        HostKVPool.from_buffers(spec, buffers, PAGE_SIZE, layout="page_first")


def test_unknown_layout_lists_the_supported_ones():
    spec = SPECS["mha"]
    with pytest.raises(ValueError, match="supported: layer_first"):
        HostKVPool.from_buffers(spec, engine_buffers(spec, "page_first"), PAGE_SIZE, layout="page_unified")
