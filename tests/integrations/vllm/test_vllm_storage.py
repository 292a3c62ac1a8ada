"""kvtier's vLLM host tier with storage behind it, no model: blocks only in storage
answer RETRY, then HIT once read and verified, byte-exact; corrupt, foreign, slow,
down, short-answering, raising and hanging storage are misses and counted errors that
never pin a host page; a storage slower than the stores arriving drops writes
(counted) while the host tier keeps serving; tensor-parallel shards of any size read
each other's blocks."""

import threading
import time

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import torch  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

import kvtier.storage  # noqa: E402
from kvtier import HostKVPool  # noqa: E402
from kvtier.integrations.vllm import KVTierOffloadingManager, KVTierOffloadingWorker  # noqa: E402
from kvtier.integrations.vllm.blocks import Geometry, block_format  # noqa: E402
from kvtier.integrations.vllm.tier import HostTier  # noqa: E402
from tests.support.storage import object_files  # noqa: E402
from tests.support.vllm_rig import BLOCK, CPU_GQA, LAYERS, Rig, context, gpu_spec, keys  # noqa: E402

END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def _stored_rig(tmp_path, names, **kw):
    """A rig whose blocks of ``names`` went through the host tier into file storage."""
    first = Rig(CPU_GQA, storage=kvtier.storage.open(f"file://{tmp_path}"), **kw)
    ks = keys(*names)
    first.store(ks, list(range(len(ks))))
    first.tier.flush()
    assert first.tier.stats["written"] == len(ks)
    return first, ks


def _settle(manager, req, ks, timeout=10.0):
    """Look ``ks`` up each scheduler step until no answer is pending; returns the answers."""
    end = time.monotonic() + timeout
    while True:
        got = [manager.lookup(k, req) for k in ks]
        manager.on_schedule_end(END)
        if not {LookupResult.RETRY, LookupResult.HIT_PENDING} & set(got) or time.monotonic() > end:
            return got
        time.sleep(0.005)


def test_storage_only_blocks_answer_pending_then_load_byte_exact(tmp_path):
    first, ks = _stored_rig(tmp_path, ["a", "b", "c"])
    second = Rig(CPU_GQA, storage=kvtier.storage.open(f"file://{tmp_path}"), seed=1)
    req = context()
    assert [second.manager.lookup(k, req) for k in ks] == [LookupResult.RETRY] * 3
    assert second.manager.has_pending_work()
    second.manager.on_schedule_end(END)
    assert _settle(second.manager, req, ks + keys("zz")) == [LookupResult.HIT] * 3 + [LookupResult.MISS]
    assert not second.manager.has_pending_work()
    assert second.manager.get_load_source(ks[0], req) is CacheHitSource.DISK
    second.load(ks, [5, 6, 7])
    for mine, theirs in zip(second.engine.kv, first.engine.kv):
        assert torch.equal(mine[[5, 6, 7]], theirs[[0, 1, 2]])
    assert second.tier.stats["fetched"] == 3 and second.tier.stats["written"] == 0
    assert second.manager.get_load_source(ks[0], req) is CacheHitSource.HOST  # loaded once: a host block now
    stats = second.manager.get_stats().reduce()  # what vLLM's /metrics gets
    block = second.tier.shard_page_bytes
    assert stats["vllm:kv_offload_tiering_read_bytes:('file',)"] == 3 * block
    assert stats["vllm:kv_offload_tiering_chunk_hits:('file',)"] == 3
    assert stats["vllm:kv_offload_tiering_chunk_queries:('file',)"] == 4
    assert stats["vllm:kv_offload_tiering_lookup_async_delay_seconds:('file',)_count"] >= 1
    assert stats["vllm:kv_offload_cpu_cache_usage_perc"] == 3 / 8
    again = second.manager.get_stats().reduce()  # counters report what changed since the last report
    assert "vllm:kv_offload_tiering_read_bytes:('file',)" not in again


def test_corrupt_storage_objects_are_misses(tmp_path):
    _, ks = _stored_rig(tmp_path, ["a", "b"])
    for f in object_files(tmp_path):
        raw = bytearray(f.read_bytes())
        raw[-5] ^= 0xFF
        f.write_bytes(bytes(raw))
    second = Rig(CPU_GQA, storage=kvtier.storage.open(f"file://{tmp_path}"))
    assert _settle(second.manager, context(), ks) == [LookupResult.MISS] * 2
    assert second.tier.stats["fetch_failed"] == 2 and second.tier.lru_order() == []


def test_other_namespace_or_geometry_never_reads_the_blocks(tmp_path):
    _, ks = _stored_rig(tmp_path, ["a"])
    other = Rig(CPU_GQA, storage=kvtier.storage.open(f"file://{tmp_path}"), key_prefix="another-model")
    assert _settle(other.manager, context(), ks) == [LookupResult.MISS]


class _SlowStorage:
    """A storage whose ``ops`` each take ``delay`` seconds."""

    def __init__(self, inner, delay, ops=("batch_exists", "exists_each", "batch_get", "batch_set")):
        self.inner, self.delay, self.ops = inner, delay, ops

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in self.ops:
            def slow(*a, **kw):
                time.sleep(self.delay)
                return attr(*a, **kw)
            return slow
        return attr


def test_slow_storage_never_blocks_lookups_and_times_out_into_misses(tmp_path):
    _, ks = _stored_rig(tmp_path, ["a", "b"])
    slow = _SlowStorage(kvtier.storage.open(f"file://{tmp_path}"), delay=1.0)
    rig = Rig(CPU_GQA, storage=slow, timeout_s=0.2)
    req = context()
    start = time.monotonic()
    got = _settle(rig.manager, req, ks, timeout=5.0)
    assert got == [LookupResult.MISS] * 2
    assert time.monotonic() - start < 0.9  # answered before storage did
    rig.tier.flush()


def test_down_storage_is_a_miss(tmp_path):
    from tests.support.services import free_port

    port = free_port()  # nothing listens on it
    try:
        store = kvtier.storage.open(f"redis://127.0.0.1:{port}/0?socket_connect_timeout=0.2")
    except ValueError as e:  # no redis client in this environment
        pytest.skip(str(e))
    rig = Rig(CPU_GQA, storage=store)
    req = context()
    assert _settle(rig.manager, req, keys("a")) == [LookupResult.MISS]
    out = rig.store(keys("a"), [0])
    assert out is not None and rig.manager.lookup(keys("a")[0], req) is LookupResult.HIT
    rig.tier.flush()
    assert rig.tier.stats["write_failed"] == 1


class _Faulty:
    """A file store whose ``batch_get`` / ``batch_set`` answer short, raise or hang."""

    def __init__(self, inner, how: str, op: str):
        self.inner, self.how, self.op = inner, how, op
        self.release = threading.Event()
        self.calls = 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != self.op:
            return attr

        def faulty(*args):
            self.calls += 1
            if self.how == "short":
                return attr(*args)[:-1]
            if self.how == "raise":
                raise ConnectionError("storage went away")
            self.release.wait(30)
            return attr(*args)
        return faulty


@pytest.mark.parametrize("how", ["short", "raise", "hang"])
def test_faulty_storage_reads_are_misses_and_pin_nothing(tmp_path, how):
    _, ks = _stored_rig(tmp_path, ["a", "b", "c"])
    faulty = _Faulty(kvtier.storage.open(f"file://{tmp_path}"), how, "batch_get")
    rig = Rig(CPU_GQA, host_blocks=4, storage=faulty, timeout_s=0.3)
    assert _settle(rig.manager, context(), ks) == [LookupResult.MISS] * 3
    assert faulty.calls == 1
    if how != "hang":
        rig.tier.flush(5)
        assert rig.tier.stats["fetch_failed"] == 3 and rig.tier.stats["storage_read_errors"] == 1
        reported = rig.manager.get_stats().reduce()
        assert reported["vllm:kv_offload_kvtier_storage_errors:('file', 'storage_read')"] == 1
        assert reported["vllm:kv_offload_tiering_promotion_job_failures:('file',)"] == 3
    assert rig.tier.free_keys() == 4 and rig.tier.pins() == 0  # no host page is held by the read
    out = rig.store(keys("x", "y", "z", "w"), [0, 1, 2, 3])  # the whole host tier still serves
    assert out is not None and out.keys_to_store == keys("x", "y", "z", "w")
    faulty.release.set()
    rig.tier.flush(5)
    assert rig.tier.pins() == 0


@pytest.mark.parametrize("how", ["short", "raise", "hang"])
def test_faulty_storage_lookups_are_misses_and_read_nothing(tmp_path, how):
    """Storage is asked per key (a sliding group's keys come from the request's end
    backwards); an answer of the wrong length, a raise or a hang is a miss for all."""
    _, ks = _stored_rig(tmp_path, ["a", "b", "c"])
    faulty = _Faulty(kvtier.storage.open(f"file://{tmp_path}"), how, "exists_each")
    rig = Rig(CPU_GQA, host_blocks=4, storage=faulty, timeout_s=0.3)
    assert _settle(rig.manager, context(), ks) == [LookupResult.MISS] * 3
    assert faulty.calls == 1
    rig.tier.flush(5)
    assert rig.tier.stats["storage_exists_errors"] == 1 and rig.tier.stats["fetched"] == 0
    assert rig.tier.free_keys() == 4 and rig.tier.pins() == 0
    faulty.release.set()


@pytest.mark.parametrize("how", ["short", "raise", "hang"])
def test_faulty_storage_writes_keep_blocks_host_only_and_pin_nothing(tmp_path, how):
    faulty = _Faulty(kvtier.storage.open(f"file://{tmp_path}"), how, "batch_set")
    rig = Rig(CPU_GQA, host_blocks=4, storage=faulty, buffer_pages=2)
    rig.store(keys("a", "b"), [0, 1])
    if how != "hang":
        rig.tier.flush(5)
        assert rig.tier.stats["write_failed"] == 2 and rig.tier.stats["written"] == 0
    else:
        deadline = time.monotonic() + 5
        while faulty.calls == 0 and time.monotonic() < deadline:  # the write is stuck in storage
            time.sleep(0.01)
        assert faulty.calls == 1
    assert rig.tier.pins() == 0  # its pages were staged: nothing holds the host pages
    assert [rig.manager.lookup(k, context()) for k in keys("a", "b")] == [LookupResult.HIT] * 2
    # the host tier keeps storing (evicting a and b); the hung write holds the staging buffer,
    # so these blocks are not written but dropped, counted
    assert rig.store(keys("c", "d", "e", "f"), [2, 3, 4, 5]).evicted_keys == keys("a", "b")
    if how == "hang":
        assert rig.tier.stats["write_dropped"] == 4
    faulty.release.set()
    rig.tier.flush(5)
    assert rig.tier.pins() == 0 and rig.tier.stats.get("storage_read_errors", 0) == 0


def test_storage_slower_than_stores_drops_writes_and_the_host_tier_keeps_serving(tmp_path):
    slow = _SlowStorage(kvtier.storage.open(f"file://{tmp_path}"), 0.3, ops=("batch_set",))
    rig = Rig(CPU_GQA, host_blocks=8, storage=slow, buffer_pages=2)
    names = [f"k{i}" for i in range(24)]
    for i in range(0, len(names), 2):  # 12 stores of 2 blocks, much faster than one write
        out = rig.store(keys(*names[i:i + 2]), [i % 16, (i + 1) % 16])
        assert out is not None and len(out.keys_to_store) == 2
        assert all(rig.manager.lookup(k, context()) is LookupResult.HIT for k in keys(*names[i:i + 2]))
    rig.tier.flush(10)
    stats = rig.tier.stats
    assert stats["write_dropped"] > 0 and stats["written"] > 0
    assert stats["written"] + stats["write_dropped"] == len(names)
    reported = rig.manager.get_stats().reduce()
    assert reported["vllm:kv_offload_tiering_backpressure_blocks_dropped:('file',)"] == stats["write_dropped"]
    assert rig.tier.pins() == 0 and rig.tier.free_keys() == 0


def test_offloaded_blocks_of_three_vllm_blocks_through_storage(tmp_path):
    url = f"file://{tmp_path}"
    first = Rig(CPU_GQA, per_key=3, storage=kvtier.storage.open(url))
    ks, blocks = keys("a", "b"), [4, 9, 2, 11, 0, 6]
    first.store(ks, blocks)
    first.tier.flush(5)
    assert first.tier.stats["written"] == 2
    second = Rig(CPU_GQA, per_key=3, storage=kvtier.storage.open(url), seed=3)
    assert _settle(second.manager, context(), ks) == [LookupResult.HIT] * 2
    second.load(ks, [1, 3, 5, 7, 8, 10])
    for mine, theirs in zip(second.engine.kv, first.engine.kv):
        assert torch.equal(mine[[1, 3, 5, 7, 8, 10]], theirs[blocks])
    one = Rig(CPU_GQA, per_key=1, storage=kvtier.storage.open(url))  # another block span: other keys
    assert _settle(one.manager, context(), ks) == [LookupResult.MISS] * 2


HEADS, DIM = 4, 32


class _Ranks:
    """One tier over ``tp`` ranks' pools (as the pool files give the scheduler), each rank
    with its own engine blocks of its heads, cut from one full-model KV."""

    def __init__(self, tp, full, storage, prefix="tp"):
        self.tp, self.full = tp, full  # full: (layers, blocks, heads, kv, slot, dim) bf16
        self.engines, pools, self.workers = [], [], []
        for r in range(tp):
            local = max(1, HEADS // tp)
            g = Geometry("CPU_ATTN", "LBHNC", False, local, DIM, BLOCK, torch.bfloat16, HEADS, r, tp)
            first = r * HEADS // tp  # more ranks than heads: each pair of ranks holds one head
            rows = [full[layer][:, first:first + local].reshape(full.shape[1], -1).view(torch.int8).clone()
                    for layer in range(LAYERS)]
            fmt = block_format(g, LAYERS, rows[0].shape[1])
            assert fmt.canonical
            pool = HostKVPool(fmt.spec, 8 * BLOCK, BLOCK, layout="page_head")
            pools.append(pool)
            self.engines.append(rows)
            self.workers.append(KVTierOffloadingWorker.single(pool, fmt, rows))
        self.tier = HostTier(pools, fmt, storage=storage, key_prefix=prefix, buffer_pages=8)
        self.manager = KVTierOffloadingManager(lambda: self.tier)

    def store(self, ks, blocks):
        out = self.manager.prepare_store(ks, context())
        for w in self.workers:
            assert w.submit_store(1, gpu_spec(blocks), out.store_spec)
        self.manager.complete_store(ks, context())

    def load(self, ks, blocks):
        spec = self.manager.prepare_load(ks, context())
        for w in self.workers:
            assert w.submit_load(2, spec, gpu_spec(blocks))
        self.manager.complete_load(ks, context())


def _full_kv(seed):
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**15, 2**15 - 1, (LAYERS, 16, HEADS, 2, BLOCK, DIM), dtype=torch.int16, generator=gen)
    return bits.view(torch.bfloat16)


@pytest.mark.parametrize("writer, reader", [(2, 1), (1, 2), (2, 4), (4, 2), (8, 1), (2, 8)])
def test_tensor_parallel_ranks_read_each_others_blocks(tmp_path, writer, reader):
    url = f"file://{tmp_path}"
    full = _full_kv(0)
    ks, blocks = keys("a", "b", "c"), [3, 7, 1]
    w = _Ranks(writer, full, kvtier.storage.open(url))
    w.store(ks, blocks)
    w.tier.flush(5)
    assert w.tier.stats["written"] == 3
    r = _Ranks(reader, torch.zeros_like(full), kvtier.storage.open(url))
    assert _settle(r.manager, context(), ks) == [LookupResult.HIT] * 3
    r.load(ks, [10, 11, 12])
    for rank, rows in enumerate(r.engines):
        local = max(1, HEADS // reader)
        first = rank * HEADS // reader
        for layer in range(LAYERS):
            want = full[layer][blocks][:, first:first + local].reshape(3, -1).view(torch.int8)
            assert torch.equal(rows[layer][[10, 11, 12]], want)


def test_a_fetch_finishing_mid_step_evicts_no_block_that_answered_hit(tmp_path):
    """vLLM looks a block up (HIT) and pins it (``prepare_load``) later in the same
    scheduler step, while a storage fetch sent at the last step's end may finish on an
    I/O thread and need host pages. It evicts no block that answered HIT this step: the
    pin works (before, the fetch evicted it and ``prepare_load`` raised in vLLM's
    scheduler, which ends the engine), and the fetch takes other pages or fewer blocks."""
    first = Rig(CPU_GQA, storage=kvtier.storage.open(f"file://{tmp_path}"))
    ab = keys("a", "b")
    first.store(ab, [0, 1])
    first.tier.flush()

    class Gated:  # the store, whose reads wait for a gate: the fetch's thread runs when the test says
        def __init__(self, inner):
            self.inner, self.gate = inner, threading.Event()

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def batch_get(self, *args, **kwargs):
            assert self.gate.wait(30)
            return self.inner.batch_get(*args, **kwargs)

    store = Gated(kvtier.storage.open(f"file://{tmp_path}"))
    rig = Rig(CPU_GQA, host_blocks=2, storage=store, seed=1, buffer_pages=4)
    xy = keys("x", "y")
    rig.store(xy, [2, 3])
    rig.tier.flush()  # the host tier: full of READY blocks x and y
    r1, r2 = context("r1"), context("r2")
    assert [rig.manager.lookup(k, r2) for k in ab] == [LookupResult.RETRY] * 2  # only in storage
    rig.manager.on_schedule_end(END)  # r2's look-up goes to storage
    assert rig.manager.lookup(xy[0], r1) == LookupResult.HIT  # the next step
    store.gate.set()
    rig.tier.flush()  # r2's fetch lands while r1 waits for its pin
    want = rig.engine.blocks([2])
    rig.engine.wipe([7])
    rig.load([xy[0]], [7], r1)  # prepare_load (the pin), the copy, complete_load
    assert all(torch.equal(a, b) for a, b in zip(rig.engine.blocks([7]), want))
    stats = rig.tier.snapshot()
    assert stats["fetched"] == 1 and stats["fetch_dropped"] == 1  # y's page only: x answered HIT
