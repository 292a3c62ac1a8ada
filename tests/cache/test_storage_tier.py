"""The cache with an L3 store: backup to storage, storage hits, prefetch and its stop policies."""

import threading
import time

import pytest

import kvtier.storage
from tests.support.cache_engine import check_prefix, make_cache, serve

A = list(range(100, 116))  # 4 pages


def hits(m):
    return (m.device_len, m.host_len, m.storage_len)


def test_pages_survive_into_a_fresh_cache_through_storage(store):
    first = make_cache(storage=store, namespace="m")
    serve(first, A)
    first.flush()
    assert first.stats()["stored_tokens"] == 16
    first.close()
    second = make_cache(storage=store, namespace="m", prefetch_policy="wait_complete")
    assert hits(second.match_prefix(A + [1])) == (0, 0, 16)
    handle = second.prefetch(A)
    assert handle.wait() == 16 and handle.done()
    assert hits(second.match_prefix(A)) == (0, 16, 0)
    load = second.load_back(second.match_prefix(A))
    load.wait()
    check_prefix(second, A, load.device_indices)
    assert second.stats()["prefetched_tokens"] == 16
    assert hits(make_cache(storage=store, namespace="other").match_prefix(A)) == (0, 0, 0)
    assert hits(second.match_prefix(A, salt="tenant-b")) == (0, 0, 0)
    second.close()


def test_storage_hit_continues_after_a_host_hit(store):
    first = make_cache(storage=store)
    serve(first, A)
    first.flush()
    second = make_cache(storage=store, prefetch_policy="wait_complete")
    serve(second, A[:8])                              # 2 pages cached locally
    assert hits(second.match_prefix(A)) == (8, 0, 8)  # the next 2 come from storage
    assert second.prefetch(A).wait() == 8
    assert hits(second.match_prefix(A)) == (8, 8, 0)
    load = second.load_back(second.match_prefix(A))
    load.wait()
    check_prefix(second, A, load.device_indices)


class SlowStore:
    """A storage whose ``op`` (gets: stop policies can be observed) waits for a gate."""

    def __init__(self, inner, op="batch_get"):
        self.inner, self.op, self.gate = inner, op, threading.Event()

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != self.op:
            return attr

        def gated(*args):
            self.gate.wait(10)
            return attr(*args)
        return gated


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_non_blocking_stop_policies_return_before_storage_answers(store, policy):
    long = list(range(500, 548))                    # 12 pages: two prefetch chunks (8 + 4 pages)
    first = make_cache(storage=store)
    serve(first, long)
    first.flush()
    slow = SlowStore(store)
    second = make_cache(storage=slow, prefetch_policy=policy, prefetch_timeout=0.05)
    handle = second.prefetch(long)
    assert handle.wait() == 0 and not handle.done()
    slow.gate.set()
    second.flush()
    assert handle.done()
    got = hits(second.match_prefix(long))
    if policy == "best_effort":
        assert got == (0, 48, 0)                    # the prefetch went on to the end
    else:
        assert got == (0, 32, 16)                   # cancelled at the timeout: the chunk in flight landed
    assert second.host_pool.available_size() + second.stats()["host_tokens"] == second.host_pool.size


def test_failed_storage_writes_are_counted_not_raised(tmp_path):
    store = kvtier.storage.open(f"file://{tmp_path}")
    (tmp_path / "kvtier-v5").rmdir()
    (tmp_path / "kvtier-v5").write_text("not a directory")
    cache = make_cache(storage=store)
    serve(cache, A)
    cache.flush()
    stats = cache.stats()
    assert stats["errors"] >= 1 and stats["stored_tokens"] == 0 and stats["storage"]["errors"] >= 1
    assert hits(cache.match_prefix(A)) == (16, 0, 0)


def test_acquire_attributes_reused_tokens_to_tiers(store):
    first = make_cache(storage=store)
    serve(first, A)                                   # 4 pages, all tiers
    first.flush()
    second = make_cache(storage=store, prefetch_policy="wait_complete")
    serve(second, A[:4])
    serve(second, A[:8])                              # 2 pages on this device, one node each
    second.flush()                                    # (a page being written to storage is locked)
    assert second.evict_device(4) == 4                # the second page is demoted to the host
    got = second.acquire(A)
    try:
        assert (got.device_hit, got.host_hit, got.storage_hit) == (4, 4, 8)
        assert got.load.done() and got.device_indices.numel() == 16
        check_prefix(second, A, got.device_indices)
        assert second.evict_device(64) == 0           # acquired pages are locked
    finally:
        second.release(got)
    assert second.evict_device(64) == 16


def test_storage_slower_than_the_writes_arriving_drops_them_counted_and_the_host_tier_serves(store):
    slow = SlowStore(store, op="batch_set")  # storage far slower than the writes arriving
    cache = make_cache(device_tokens=64, host_tokens=64, storage=slow)  # write backlog: 64 tokens
    prompts = [list(range(1000 + 16 * i, 1016 + 16 * i)) for i in range(8)]
    for p in prompts:  # 8 x 4 pages while the first write hangs in storage
        assert serve(cache, p)["inserted"]
    stats = cache.stats()
    assert stats["store_dropped_tokens"] > 0
    cache.check_integrity()  # a dropped write leaves no storage copy behind (no object, no write)
    assert not any(n.storage is not None and not n.stored and n.storing is None for n in cache.tree.nodes())
    assert hits(cache.match_prefix(prompts[-1])) == (16, 0, 0)
    slow.gate.set()
    cache.flush()
    stats = cache.stats()  # the rest lost their host copy before their turn (64 host tokens): not written
    assert stats["stored_tokens"] >= 16 and stats["stored_tokens"] + stats["store_dropped_tokens"] <= 8 * 16
    assert stats["errors"] == 0
    cache.close()


def test_a_write_queued_while_its_nodes_split_leaves_the_backlog_empty(tmp_path):
    """A queued storage write counts its tokens into the writer's backlog and out again
    when it starts. One of its nodes may lose its host copy meanwhile (leaving the write)
    and then be split: it is counted out as it was counted in. Before, the split node's
    shorter key was counted out, the backlog never emptied, and a later write as large as
    the backlog was dropped."""
    from tests.support.cache_engine import compute
    from tests.support.cache_faults import FaultyStore

    store = FaultyStore(kvtier.storage.open(f"file://{tmp_path}"))
    cache = make_cache(device_tokens=64, host_tokens=32, storage=store, write_policy="write_through")

    def put(tokens):
        slots = cache.alloc_device(len(tokens))
        compute(cache, tokens, slots, 0)
        cache.insert(tokens, slots)

    store.set_gate = threading.Event()
    put(list(range(100, 116)))  # its write starts and waits at the gate
    assert store.set_started.wait(5)
    queued = list(range(200, 216))
    put(queued)  # backed up; its write queued behind the first
    deadline = time.monotonic() + 30
    while not (cache.peek(queued).path[-1].storing is not None and cache.peek(queued).path[-1].host_ready):
        assert time.monotonic() < deadline, "the backup never queued its write"
        time.sleep(0.01)
    cache.evict_host(8)  # the queued write's node: split 8 + 8, the tail's host copy dropped
    cache.match_prefix(queued[:12])  # that tail split again
    store.set_gate.set()
    cache.flush()
    cache.evict_host(32)
    cache.flush()
    dropped = cache.stats()["store_dropped_tokens"]
    put(list(range(300, 332)))  # 32 tokens: the whole backlog
    cache.flush()
    assert cache.stats()["store_dropped_tokens"] == dropped
    assert hits(cache.match_prefix(list(range(300, 332)) + [0])) == (32, 0, 0)
    cache.evict_device(64)
    cache.evict_host(32)
    assert hits(cache.match_prefix(list(range(300, 332)) + [0]))[2] == 32  # written: a storage hit
    cache.check_integrity()
    cache.close()
