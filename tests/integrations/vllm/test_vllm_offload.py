"""kvtier's vLLM manager and worker driven through vLLM's own offloading classes, with
no model: store -> lookup -> load round trips, offloaded blocks of several vLLM blocks,
eviction order, resets."""

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import torch  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ScheduleEndContext  # noqa: E402

from kvtier.integrations.vllm.blocks import block_format  # noqa: E402
from tests.support.vllm_rig import BLOCK, CPU_GQA, FA_GQA, LAYERS, MLA, UNKNOWN, Rig, context, keys  # noqa: E402

END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


@pytest.mark.parametrize("geometry", [CPU_GQA, FA_GQA, MLA, UNKNOWN], ids=["cpu", "flash", "mla", "opaque"])
def test_store_lookup_load_round_trip_is_byte_exact(geometry):
    rig = Rig(geometry)
    ks = keys("a", "b", "c")
    before = rig.engine.blocks([3, 7, 1])
    assert [rig.manager.lookup(k, context()) for k in ks] == [LookupResult.MISS] * 3
    out = rig.store(ks, [3, 7, 1])
    assert out.keys_to_store == ks and out.evicted_keys == []
    assert [rig.manager.lookup(k, context()) for k in ks] == [LookupResult.HIT] * 3
    rig.engine.wipe([3, 7, 1])
    rig.load(ks, [9, 10, 11])
    for layer, want in zip(rig.engine.kv, before):
        assert torch.equal(layer[[9, 10, 11]], want)


@pytest.mark.parametrize("geometry", [CPU_GQA, UNKNOWN], ids=["cpu", "opaque"])
def test_offloaded_blocks_of_three_vllm_blocks_round_trip_from_their_middle(geometry):
    """blocks_per_chunk 3: a key holds three vLLM blocks; a load may start and end inside one
    (vLLM's sliding window loads do), never span fewer keys than its blocks need."""
    rig = Rig(geometry, host_blocks=3, per_key=3)
    ks = keys("a", "b")
    blocks = [4, 9, 2, 11, 0, 6]
    before = rig.engine.blocks(blocks)
    rig.store(ks, blocks)
    assert len(rig.manager.prepare_load(ks, context()).pages) == 6
    rig.manager.complete_load(ks, context())
    rig.engine.wipe(blocks)
    spec = rig.manager.prepare_load(ks, context())
    targets = [12, 13, 14, 15]  # the last four vLLM blocks: request blocks 2..5 (block_indices 2)
    assert rig.worker.submit_load(1, spec, GPULoadStoreSpec(targets, group_sizes=[4], block_indices=[2]))
    for layer, want in zip(rig.engine.kv, before):
        assert torch.equal(layer[targets], want[2:])
    rig.engine.wipe(blocks + targets)
    assert rig.worker.submit_load(2, spec, GPULoadStoreSpec(targets, group_sizes=[4], block_indices=[1]))
    for layer, want in zip(rig.engine.kv, before):
        assert torch.equal(layer[targets], want[1:5])  # request blocks 1..4: inside both keys
    with pytest.raises(ValueError, match="2 vLLM blocks .skipping 0. for 6 host pages"):
        rig.worker.submit_load(3, spec, GPULoadStoreSpec(targets[:2], group_sizes=[2], block_indices=[0]))
    with pytest.raises(ValueError, match="5 vLLM blocks .skipping 2. for 6 host pages"):
        rig.worker.submit_load(4, spec, GPULoadStoreSpec(targets + [1], group_sizes=[5], block_indices=[2]))


def test_cpu_blocks_become_canonical_k_and_v_pages():
    """vLLM's CPU block is (head, K-or-V, slot, dim); the host page holds K and V by slot."""
    rig = Rig(CPU_GQA)
    assert rig.tier.format.canonical and rig.tier.format.spec.names == ("k", "v")
    rig.store(keys("a"), [5])
    heads, dim = CPU_GQA.num_kv_heads, CPU_GQA.head_size
    for layer in range(LAYERS):
        block = rig.engine.kv[layer][5].view(torch.bfloat16).view(heads, 2, BLOCK, dim)
        page = rig.tier.pool.get_data_page(0, flat=False)  # (head, slot, layer, dim) in page_head
        bits = torch.int16  # random bytes hold NaNs: compare bit patterns
        assert torch.equal(page["k"][:, :, layer].view(bits), block[:, 0].view(bits))
        assert torch.equal(page["v"][:, :, layer].view(bits), block[:, 1].view(bits))



@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"])
def test_gpu_blocks_become_the_k_and_v_vllms_kernels_read(backend, layout):
    """vLLM 0.32's GPU caches: a layer's logical ``(block, head, slot, C)``, ``C`` a head's
    K then V of one token, laid out in ``kv_cache_layout``'s order; the kernels read K
    and V as ``kv_cache.transpose(1, 2).split(head_size, -1)``. kvtier's canonical
    ``k`` and ``v`` are exactly those (before, K and V were taken as the outermost
    axis: what it called K mixed K and V of other heads and slots)."""
    from kvtier.integrations.vllm.blocks import Geometry

    heads, dim, blocks = 2, 8, 3
    fmt = block_format(Geometry(backend, layout, False, heads, dim, BLOCK, torch.bfloat16), 1,
                       BLOCK * heads * 2 * dim * 2)
    assert fmt.canonical and fmt.name.startswith("kv2.")
    shape = (blocks, BLOCK, heads, 2 * dim) if layout == "LBNHC" else (blocks, heads, BLOCK, 2 * dim)
    physical = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logical = physical.permute(0, 2, 1, 3) if layout == "LBNHC" else physical  # (block, head, slot, C)
    k, v = logical.transpose(1, 2).split(dim, -1)  # (block, slot, head, dim), as the kernels read them
    views = fmt.layer_views(physical.reshape(blocks, -1).view(torch.int8))
    assert torch.equal(views["k"], k) and torch.equal(views["v"], v)


def test_opaque_pages_are_named_by_their_dtype_and_heads():
    """Opaque bytes mean nothing without their dtype and heads: two deployments that
    differ in either (under one namespace) name their pages apart (before, a float16
    engine read a bfloat16 one's blocks as its own)."""
    from dataclasses import replace

    names = {block_format(replace(UNKNOWN, **kw), LAYERS, 8192).name
             for kw in ({}, {"dtype": torch.float16}, {"num_kv_heads": 4, "head_size": 16})}
    assert len(names) == 3 and all(n.startswith("opaque.") for n in names)

def test_formats_fall_back_to_opaque_pages_when_bytes_do_not_match():
    assert not block_format(UNKNOWN, LAYERS, 8192).canonical
    assert block_format(CPU_GQA, LAYERS, 8192).canonical
    assert not block_format(CPU_GQA, LAYERS, 8192 + 64).canonical  # e.g. a padded or scaled page
    assert block_format(CPU_GQA, LAYERS, 8192).name != block_format(FA_GQA, LAYERS, 8192).name or \
        block_format(CPU_GQA, LAYERS, 8192).spec == block_format(FA_GQA, LAYERS, 8192).spec


def test_lru_eviction_order_skips_pinned_and_storing_pages():
    rig = Rig(CPU_GQA, host_blocks=3)
    a, b, c, d, e, f, g = keys(*"abcdefg")
    rig.store([a, b, c], [0, 1, 2])
    rig.manager.touch([a], context())
    assert rig.tier.lru_order() == [b, c, a]
    assert rig.store([d], [3]).evicted_keys == [b]
    rig.manager.prepare_load([c], context())  # c: a load in flight
    assert rig.store([e], [4]).evicted_keys == [a]
    assert rig.tier.lru_order() == [d, c, e]  # a load is a use
    stored = rig.manager.prepare_store([f], context())  # f: being stored
    assert stored.evicted_keys == [d]
    rig.manager.prepare_load([e], context())
    free_before = rig.tier.free_keys()
    assert rig.manager.prepare_store([g], context()) is None  # nothing evictable: nothing changes
    assert rig.tier.lru_order() == [c, e] and rig.tier.free_keys() == free_before
    rig.manager.complete_load([c, e], context())
    assert rig.manager.prepare_store([g], context()).evicted_keys == [c]


def test_store_of_held_keys_copies_nothing_and_failed_store_frees():
    rig = Rig(CPU_GQA, host_blocks=4)
    a, b = keys("a", "b")
    rig.store([a], [0])
    out = rig.store([a, b], [0, 1])
    assert out.keys_to_store == [b]
    out = rig.manager.prepare_store(keys("c"), context())
    assert rig.manager.lookup(out.keys_to_store[0], context()) is LookupResult.HIT_PENDING  # stored, not readable yet
    rig.manager.complete_store(out.keys_to_store, context(), success=False)
    assert rig.manager.lookup(out.keys_to_store[0], context()) is LookupResult.MISS
    assert rig.tier.free_keys() == 2
    rig.manager.reset_cache()
    assert rig.tier.lru_order() == [] and rig.tier.free_keys() == 4


def test_reset_forgets_everything_and_frees_in_flight_pages_two_steps_later():
    rig = Rig(CPU_GQA, host_blocks=4)
    a, b, c = keys("a", "b", "c")
    rig.store([a, b], [0, 1])
    rig.manager.prepare_load([a], context())           # a load vLLM will drop at the reset
    rig.manager.prepare_store([c], context())          # a store vLLM will drop too
    rig.manager.reset_cache()
    assert [rig.manager.lookup(k, context()) for k in (a, b, c)] == [LookupResult.MISS] * 3
    assert rig.tier.free_keys() == 2  # b freed now; a and c wait for vLLM's flush
    rig.manager.on_schedule_end(END)
    assert rig.tier.free_keys() == 2
    rig.manager.on_schedule_end(END)
    assert rig.tier.free_keys() == 4
    rig.manager.complete_load([a], context())          # a late completion is ignored
    rig.store([a], [0])
    assert rig.manager.lookup(a, context()) is LookupResult.HIT


