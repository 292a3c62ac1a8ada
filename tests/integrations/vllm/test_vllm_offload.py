"""kvtier's vLLM manager and worker driven through vLLM's own offloading classes, with
no model: store -> lookup -> load round trips, eviction order, storage prefetches."""

import time

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")  # a bare `vllm` may be this test folder

import torch  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext  # noqa: E402
from vllm_helpers import (BLOCK, CPU_GQA, FA_GQA, LAYERS, MLA, UNKNOWN, Rig, context, keys,  # noqa: E402
                          offloading_config)

import kvtier.storage  # noqa: E402
from kvtier.integrations.vllm import KVTierOffloadingSpec, UnsupportedVLLMSetupError  # noqa: E402
from kvtier.integrations.vllm.blocks import block_format  # noqa: E402

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
    free_before = rig.tier.pool.available_size()
    assert rig.manager.prepare_store([g], context()) is None  # nothing evictable: nothing changes
    assert rig.tier.lru_order() == [c, e] and rig.tier.pool.available_size() == free_before
    rig.manager.complete_load([c, e], context())
    assert rig.manager.prepare_store([g], context()).evicted_keys == [c]


def test_store_of_held_keys_copies_nothing_and_failed_store_frees():
    rig = Rig(CPU_GQA, host_blocks=4)
    a, b = keys("a", "b")
    rig.store([a], [0])
    out = rig.store([a, b], [0, 1])
    assert out.keys_to_store == [b]
    out = rig.manager.prepare_store(keys("c"), context())
    assert rig.manager.lookup(out.keys_to_store[0], context()) is LookupResult.MISS  # not readable yet
    rig.manager.complete_store(out.keys_to_store, context(), success=False)
    assert rig.tier.pool.available_size() == 2 * BLOCK
    rig.manager.reset_cache()
    assert rig.tier.lru_order() == [] and rig.tier.pool.available_size() == 4 * BLOCK


def test_reset_forgets_everything_and_frees_in_flight_pages_two_steps_later():
    rig = Rig(CPU_GQA, host_blocks=4)
    a, b, c = keys("a", "b", "c")
    rig.store([a, b], [0, 1])
    rig.manager.prepare_load([a], context())           # a load vLLM will drop at the reset
    rig.manager.prepare_store([c], context())          # a store vLLM will drop too
    rig.manager.reset_cache()
    assert [rig.manager.lookup(k, context()) for k in (a, b, c)] == [LookupResult.MISS] * 3
    assert rig.tier.pool.available_size() == 2 * BLOCK  # b freed now; a and c wait for vLLM's flush
    rig.manager.on_schedule_end(END)
    assert rig.tier.pool.available_size() == 2 * BLOCK
    rig.manager.on_schedule_end(END)
    assert rig.tier.pool.available_size() == 4 * BLOCK
    rig.manager.complete_load([a], context())          # a late completion is ignored
    rig.store([a], [0])
    assert rig.manager.lookup(a, context()) is LookupResult.HIT


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
    second.load(ks, [5, 6, 7])
    for mine, theirs in zip(second.engine.kv, first.engine.kv):
        assert torch.equal(mine[[5, 6, 7]], theirs[[0, 1, 2]])
    assert second.tier.stats["fetched"] == 3 and second.tier.stats["written"] == 0


def test_corrupt_storage_objects_are_misses(tmp_path):
    _, ks = _stored_rig(tmp_path, ["a", "b"])
    for f in sorted(p for p in tmp_path.rglob("*") if p.is_file()):
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
    """A storage whose every call takes ``delay`` seconds."""

    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name.startswith("batch_"):
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
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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


@pytest.mark.parametrize("extra, message", [
    ({"host_bytes": 1 << 20, "host_byte": 1}, "unknown kv_connector_extra_config keys \\['host_byte'\\]"),
    ({}, "needs host_bytes"),
    ({"host_bytes": -1}, "host_bytes must be a positive int"),
    ({"host_bytes": 1 << 20, "storage": "ftp://x/y"}, "unknown storage scheme 'ftp'"),
    ({"host_bytes": 1 << 20, "storage": "file://host/dir"}, "use file:///absolute/path"),
    ({"host_bytes": 1 << 20, "storage": "nonsense"}, "storage must be a URL"),
    ({"host_bytes": 100}, "holds no block"),
])
def test_bad_extra_config_fails_at_construction(extra, message):
    with pytest.raises(ValueError, match=message):
        KVTierOffloadingSpec(offloading_config(extra, block_bytes=3 * 8192))


@pytest.mark.parametrize("kw", [{"blocks_per_chunk": 2}, {"world_size": 2}, {"groups": 2}])
def test_unsupported_setups_say_what_to_change(kw):
    with pytest.raises(UnsupportedVLLMSetupError):
        KVTierOffloadingSpec(offloading_config({"host_bytes": 1 << 20}, **kw))


def test_spec_builds_tier_keyed_by_model_and_format(tmp_path):
    from vllm_helpers import Engine

    spec = KVTierOffloadingSpec(offloading_config({"host_bytes": 1 << 20, "storage": f"file://{tmp_path}"}))
    engine = Engine(CPU_GQA)
    worker = spec.get_worker(engine.caches)
    manager = spec.get_manager()
    tier = spec.tier
    assert tier is not None and manager.tier is tier
    assert tier.key_prefix.startswith("vllm%3A%2Fmodels%2Ftiny-llama%40unversioned%3Abfloat16/")
    named = KVTierOffloadingSpec(offloading_config({"host_bytes": 1 << 20, "namespace": "team-a/llama"}))
    assert named.namespace() == "team-a/llama"
    worker.shutdown()
    assert spec.tier is None and manager.lookup(keys("a")[0], context()) is LookupResult.MISS
