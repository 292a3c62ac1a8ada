"""vLLM 0.32's own offloading unit tests, re-expressed for kvtier's spec: the rows of
``tests/v1/kv_offload/cpu/test_manager.py`` (look-ups of stores in flight, evictions
that keep what the same call keeps, events, failed stores, key order),
``test_gpu_worker.py`` (offloaded blocks of one and of three vLLM blocks, starting
inside one) and ``RequestRunner`` (vLLM's scheduler and OffloadingConnector driving the
spec). Where vLLM's tests check only vLLM's own choices (its chunk ids, its tail-first
eviction order inside an accessed prefix), these check kvtier's: its pages and its
plain LRU."""

import random

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import torch  # noqa: E402
from vllm.v1.kv_offload.base import (GPULoadStoreSpec, LookupResult, Medium, make_offload_key)

from kvtier.testing.checkpoints import save_llama  # noqa: E402
from tests.support.vllm_rig import CPU_GQA, UNKNOWN, Rig, context  # noqa: E402


def to_keys(ints):
    return [make_offload_key(str(i).encode(), 0) for i in ints]


def _events(manager):
    return [(set(e.keys), e.removed) for e in manager.take_events() if e.medium is Medium.CPU]


def test_the_manager_sequence_of_vllms_cpu_manager_test():
    rig = Rig(CPU_GQA, host_blocks=4, events=True)
    m, ctx = rig.manager, context()
    out = m.prepare_store(to_keys([1, 2]), ctx)
    assert out.keys_to_store == to_keys([1, 2]) and out.evicted_keys == []
    assert [m.lookup(k, ctx) for k in to_keys([1, 2])] == [LookupResult.HIT_PENDING] * 2  # write in flight
    assert _events(m) == []
    m.complete_store(to_keys([1, 2]), ctx)
    assert _events(m) == [(set(to_keys([1, 2])), False)]
    assert [m.lookup(k, ctx) for k in to_keys([1, 2, 3])] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]

    out = m.prepare_store(to_keys([2, 3, 4, 5]), ctx)
    assert out.keys_to_store == to_keys([3, 4, 5]) and out.evicted_keys == to_keys([1])
    assert _events(m) == [(set(to_keys([1])), True)]
    assert m.prepare_store(to_keys([1, 6]), ctx) is None  # no room: 2 ready, 3-5 being written
    m.complete_store(to_keys([2, 3, 4, 5]), ctx)
    assert [m.lookup(k, ctx) for k in to_keys([1, 2, 3, 4, 5, 0])] == \
        [LookupResult.MISS] + [LookupResult.HIT] * 4 + [LookupResult.MISS]

    load = m.prepare_load(to_keys([2, 3]), context("load-2-3"))
    assert m.prepare_store(to_keys([6, 7, 8]), ctx) is None  # 2 and 3 are being loaded
    m.complete_load(to_keys([2, 3]), context("load-2-3"))
    assert len(load.pages) == 2
    out = m.prepare_store(to_keys([6, 7, 8]), ctx)
    assert out.keys_to_store == to_keys([6, 7, 8]) and out.evicted_keys == to_keys([4, 5, 2])  # kvtier: plain LRU
    m.complete_store(to_keys([6, 7, 8]), ctx)
    m.touch(to_keys([3, 6, 7]), ctx)
    out = m.prepare_store(to_keys([9]), ctx)
    assert out.keys_to_store == to_keys([9]) and out.evicted_keys == to_keys([8])
    m.complete_store(to_keys([7, 9]), ctx, success=False)  # 7 was stored before: it stays; 9 goes
    assert m.lookup(to_keys([7])[0], ctx) is LookupResult.HIT and m.lookup(to_keys([9])[0], ctx) is LookupResult.MISS
    assert _events(m) == [(set(to_keys([3, 4, 5])), False), (set(to_keys([4, 5, 2])), True),
                          (set(to_keys([6, 7, 8])), False), (set(to_keys([8])), True)]


def test_a_block_the_same_prepare_store_keeps_is_never_evicted():
    rig = Rig(CPU_GQA, host_blocks=4, events=True)
    m, ctx = rig.manager, context()
    m.prepare_store(to_keys([1, 2]), ctx)
    m.complete_store(to_keys([1, 2]), ctx)
    m.touch(to_keys([1]), ctx)  # 2 is now the least recently used
    out = m.prepare_store(to_keys([2, 3, 4, 5]), ctx)
    assert out.keys_to_store == to_keys([3, 4, 5]) and out.evicted_keys == to_keys([1])
    m.complete_store(to_keys([2, 3, 4, 5]), ctx)
    assert [m.lookup(k, ctx) for k in to_keys([2, 3, 4, 5])] == [LookupResult.HIT] * 4


def test_an_eviction_is_announced_before_the_store_that_reuses_its_pages():
    rig = Rig(CPU_GQA, host_blocks=2, events=True)
    m, ctx = rig.manager, context()
    m.prepare_store(to_keys([1, 2]), ctx)
    m.complete_store(to_keys([1, 2]), ctx)
    list(m.take_events())
    m.prepare_store(to_keys([3]), ctx)
    m.complete_store(to_keys([3]), ctx)
    events = list(m.take_events())
    assert [e.removed for e in events] == [True, False]
    assert all(e.medium is Medium.CPU for e in events)
    assert events[0].keys == to_keys([1]) and all(isinstance(k, bytes) for k in events[0].keys)


def test_no_events_unless_vllm_publishes_them():
    rig = Rig(CPU_GQA, host_blocks=2)
    rig.store(to_keys([1, 2]), [0, 1])
    assert list(rig.manager.take_events()) == []


def test_prepare_load_pages_follow_the_order_of_the_keys():
    rig = Rig(CPU_GQA, host_blocks=4)
    m, ctx = rig.manager, context()
    keys = to_keys([0, 1, 2])
    out = m.prepare_store(keys, ctx)
    page_of = {k: int(p) for k, p in zip(out.keys_to_store, out.store_spec.pages)}
    m.complete_store(keys, ctx)
    for order in (keys, [keys[1], keys[2], keys[0]]):
        assert m.prepare_load(order, ctx).pages.tolist() == [page_of[k] for k in order]
        m.complete_load(order, ctx)


@pytest.mark.parametrize("geometry", [CPU_GQA, UNKNOWN], ids=["canonical", "opaque"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
@pytest.mark.parametrize("to_host", [True, False], ids=["store", "load"])
def test_worker_transfers_of_vllms_gpu_worker_test(geometry, blocks_per_chunk, to_host):
    """Random vLLM blocks and host pages; with 3 vLLM blocks per offloaded block the
    first two are skipped (the job starts inside an offloaded block). Sources do not
    change, destinations change exactly where the job says, sizes are reported."""
    rng = random.Random(0)
    rig = Rig(geometry, host_blocks=5, per_key=blocks_per_chunk, seed=1)
    keys = to_keys(range(3))
    out = rig.manager.prepare_store(keys, context())
    pages = out.store_spec.pages.tolist()
    skip = blocks_per_chunk - 1
    gpu = rng.sample(range(16), 3 * blocks_per_chunk)[skip:]
    host_pages = pages[skip:]
    for t in rig.tier.pool.buffers.values():  # the host pool starts random too
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    gpu_before = [t.clone() for t in rig.engine.kv]
    host_before = {n: v.all_layers.clone() for n, v in rig.tier.pool.page_views.items()}
    spec = GPULoadStoreSpec(gpu, group_sizes=[len(gpu)], block_indices=[skip])
    if to_host:
        assert rig.worker.submit_store(1, spec, out.store_spec)
    else:
        assert rig.worker.submit_load(1, out.store_spec, spec)
    (result,) = rig.worker.get_finished()
    assert result.job_id == 1 and result.success
    assert result.transfer_size == len(gpu) * rig.engine.page_bytes * len(rig.engine.kv)
    assert result.transfer_time > 0
    # the other direction, done by kvtier, brings the bytes back: compare at block granularity
    views = rig.tier.pool.page_views
    for layer, (now, before) in enumerate(zip(rig.engine.kv, gpu_before)):
        if to_host:
            assert torch.equal(now, before)  # the source is untouched
        else:
            untouched = [b for b in range(16) if b not in gpu]
            assert torch.equal(now[untouched], before[untouched])
    for name, view in views.items():
        others = [p for p in range(view.all_layers.shape[0]) if p not in host_pages]
        if to_host:
            assert torch.equal(view.all_layers[others].view(torch.uint8), host_before[name][others].view(torch.uint8))
        else:
            assert torch.equal(view.all_layers.view(torch.uint8), host_before[name].view(torch.uint8))
    again = Rig(geometry, host_blocks=5, per_key=blocks_per_chunk, seed=2)  # read back through a fresh engine
    for name in views:
        again.tier.pool.page_views[name].all_layers.copy_(views[name].all_layers)
    back = list(range(len(gpu)))
    assert again.worker.submit_load(2, out.store_spec, GPULoadStoreSpec(back, [len(back)], [skip]))
    for layer, mine in zip(again.engine.kv, rig.engine.kv):
        assert torch.equal(layer[back], mine[gpu])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(save_llama(tmp_path_factory.mktemp("tiny-llama"), layers=2, heads=4, kv_heads=2))


@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_vllms_scheduler_stores_then_loads_the_same_bytes(tiny_model, tmp_path, blocks_per_chunk):
    """vLLM's scheduler and OffloadingConnector with kvtier's spec: a request's full
    blocks are stored; after the GPU prefix cache is reset, the same prompt's blocks are
    loaded from kvtier, holding what the first request's blocks held."""
    from tests.support.vllm_scheduler_rig import SchedulerRig

    rig = SchedulerRig(tiny_model, str(tmp_path), blocks_per_chunk=blocks_per_chunk)
    tokens = [random.Random(5).randrange(3, 400) for _ in range(6 * 32 * blocks_per_chunk + 10)]
    rig.scramble(1)
    first = {}
    rig.run(tokens, on_prefill=lambda rid: first.update(blocks=rig.blocks_of(rid),
                                                        data=rig.block_bytes(rig.blocks_of(rid))))
    tier = rig.manager.tier
    assert tier.stats["stored"] == 6 and tier.stats["loaded"] == 0
    assert rig.scheduler.reset_prefix_cache()
    rig.scramble(2)
    second = {}
    rig.run(tokens, on_prefill=lambda rid: second.update(blocks=rig.blocks_of(rid)))
    assert tier.stats["loaded"] == 6
    loaded = second["blocks"][:6 * blocks_per_chunk]
    for now, then in zip(rig.block_bytes(loaded), first["data"]):
        assert torch.equal(now.view(torch.int16), then[:6 * blocks_per_chunk].view(torch.int16))
    rig.shutdown()
