"""Deterministic scenarios: exact hit lengths per tier, eviction order, demotion and promotion."""

import gc
import weakref

import pytest
import torch

from tests.support.cache_engine import PAGE, SPEC, check_prefix, compute, make_cache, serve

A = list(range(100, 112))            # 3 pages
B = list(range(200, 208))            # 2 pages
C = list(range(300, 304))            # 1 page


def hits(m):
    return (m.device_len, m.host_len, m.storage_len)


def test_match_lengths_are_page_granular_and_salted():
    cache = make_cache()
    serve(cache, A + [1, 2])                       # 14 tokens: 3 full pages cached
    assert hits(cache.match_prefix(A + [7])) == (12, 0, 0)
    assert hits(cache.match_prefix(A[:6])) == (4, 0, 0)   # the match stops at a page boundary
    assert hits(cache.match_prefix(A[:4] + [0] * 8)) == (4, 0, 0)
    assert hits(cache.match_prefix([5] + A[1:])) == (0, 0, 0)
    assert hits(cache.match_prefix(A, salt="tenant-b")) == (0, 0, 0)
    cache.flush()                                  # backups run on a worker
    assert cache.stats()["host_tokens"] == 12     # write_through backed every page up
    cache.close()


def test_lru_eviction_order_and_demotion_to_host():
    cache = make_cache()
    for prompt in (A, B, C):
        serve(cache, prompt)
    cache.flush()
    cache.match_prefix(A)                          # A is now the most recently used
    assert cache.evict_device(PAGE) == 4           # B goes first, one page at a time: its last page
    assert hits(cache.match_prefix(B)) == (4, 4, 0)
    assert cache.evict_device(2 * PAGE) == 8       # then C, then A's last page (B was touched since)
    assert hits(cache.match_prefix(C)) == (0, 4, 0)
    assert hits(cache.match_prefix(B)) == (4, 4, 0)
    assert hits(cache.match_prefix(A)) == (8, 4, 0)
    assert cache.stats()["device_evicted_tokens"] == 12


def test_children_leave_the_device_before_parents():
    cache = make_cache()
    serve(cache, A[:8])
    serve(cache, A)                                # A[:8] then a child page A[8:12]
    assert cache.evict_device(PAGE) == 4           # the child page, though the parent is older
    assert hits(cache.match_prefix(A)) == (8, 4, 0)


def test_promotion_loads_identical_kv_layer_by_layer():
    cache = make_cache()
    serve(cache, A)
    cache.evict_device(64)
    m = cache.match_prefix(A)
    assert hits(m) == (0, 12, 0)
    with cache.locked(m):
        handle = cache.load_back(m)
        for layer in range(SPEC.layer_num):
            assert handle.wait_layer(layer, timeout=10)
        assert handle.wait(timeout=10) and handle.done() and handle.error is None
        check_prefix(cache, A, handle.device_indices)
    assert hits(cache.match_prefix(A)) == (12, 0, 0)
    assert cache.stats()["loaded_tokens"] == 12


def test_write_back_copies_to_host_only_on_eviction():
    cache = make_cache(write_policy="write_back")
    serve(cache, A)
    assert cache.stats()["host_tokens"] == 0
    cache.evict_device(12)
    assert hits(cache.match_prefix(A)) == (0, 12, 0) and cache.stats()["backed_up_tokens"] == 12
    handle = cache.load_back(cache.match_prefix(A))
    handle.wait()
    check_prefix(cache, A, handle.device_indices)


def test_write_through_selective_waits_for_the_second_hit():
    cache = make_cache(write_policy="write_through_selective")
    serve(cache, A)                                # insert: no backup
    cache.flush()
    assert cache.stats()["host_tokens"] == 0
    cache.match_prefix(A)                          # hit 1 (serve's own match was hit 0 of a new node)
    cache.flush()
    assert cache.stats()["host_tokens"] == 0
    cache.match_prefix(A)                          # hit 2: backed up
    cache.flush()
    assert cache.stats()["host_tokens"] == 12
    cache.evict_device(12)
    assert hits(cache.match_prefix(A)) == (0, 12, 0)



@pytest.mark.parametrize("call", ["match_prefix", "acquire"])
def test_a_selective_backup_that_evicts_part_of_the_hit_leaves_its_slots_whole(call):
    """The second hit of a node starts its backup, whose host space is made by evicting
    the least recently used host copy: here half of the very prefix being matched. The
    matched path is locked meanwhile, so the eviction takes nothing of it, and the hit's
    device slots are those of its tokens (before, ``match_prefix``'s eviction split a node
    of the path and the slots came out shifted: the KV of other tokens; ``acquire``
    held its first match's lock already, which covers this path)."""
    cache = make_cache(device_tokens=32, host_tokens=8, write_policy="write_through_selective", synchronous=True)
    a = list(range(100, 108))  # two pages
    ab = a + list(range(200, 204))  # and one more
    slots = cache.alloc_device(8)
    compute(cache, a, slots, 0)
    cache.insert(a, slots)
    slots = torch.cat([cache.match_prefix(a).device_indices, cache.alloc_device(4)])
    compute(cache, ab, slots, 8)
    cache.insert(ab, slots)
    cache.match_prefix(a)
    cache.match_prefix(a)  # a's second hit: backed up, the host is full
    cache.match_prefix(ab)  # the last page's first hit
    if call == "match_prefix":
        got = cache.match_prefix(ab)  # its second: its backup evicts the host copy of a
    else:
        acquired = cache.acquire(ab)
        got = acquired.match
    assert got.device_len == 12
    check_prefix(cache, ab, got.device_indices)
    if call == "acquire":
        cache.release(acquired)
    cache.flush()
    cache.check_integrity(engine_device_slots=0)

def test_without_a_host_copy_eviction_drops_pages():
    cache = make_cache(write_policy="write_through_selective")
    serve(cache, B)
    assert cache.evict_device(8) == 8
    assert hits(cache.match_prefix(B)) == (0, 0, 0)
    assert cache.device_pool.available_size() == 64


def test_the_lru_index_lets_evicted_pages_go():
    """A tier's LRU heap only indexes nodes with a copy in that tier: a heap that is
    never popped (no host evictions here) must not keep dropped nodes and their keys."""
    cache = make_cache(write_policy="write_through_selective")
    keys = []
    for k in range(40):
        tokens = [1000 + 8 * k + i for i in range(2 * PAGE)]
        slots = cache.alloc_device(2 * PAGE)  # a full pool: evicts an earlier prompt's pages
        cache.insert(tokens, slots)
        (node,) = cache.peek(tokens).path  # a peek stamps nothing: no new LRU entry
        keys.append(weakref.ref(node.key))
    del node
    gc.collect()
    # the 8 prompts the pool holds; an entry left in any heap would keep its node's key alive
    assert [k for k, key in enumerate(keys) if key() is not None] == list(range(32, 40))
    cache.check_integrity(engine_device_slots=0)
    cache.close()


def test_locked_pages_are_never_evicted():
    cache = make_cache()
    serve(cache, A)
    serve(cache, B)
    m = cache.match_prefix(A)
    lease = cache.lock(m)
    assert cache.evict_device(64) == 8             # only B could go
    assert cache.evict_host(64) == 8               # B's host copy (a host-only leaf); A is locked
    assert hits(cache.match_prefix(A)) == (12, 0, 0)
    cache.unlock(lease)
    assert cache.evict_device(64) == 12
    assert cache.evict_host(64) == 12
    assert hits(cache.match_prefix(A)) == (0, 0, 0)
    assert cache.host_pool.available_size() == 64 and cache.device_pool.available_size() == 64


def test_evicting_the_host_copy_of_a_device_page_keeps_it_on_device():
    cache = make_cache()
    serve(cache, A)
    cache.flush()
    assert cache.evict_host(12) == 12
    assert hits(cache.match_prefix(A)) == (12, 0, 0) and cache.stats()["host_tokens"] == 0


def test_insert_reports_cached_prefix_and_adopts_recomputed_host_pages():
    cache = make_cache()
    serve(cache, A)
    cache.evict_device(64)                          # A only on the host now
    slots = cache.alloc_device(12)
    from tests.support.cache_engine import compute

    compute(cache, A, slots, 0)                     # the engine recomputed A instead of loading it
    assert cache.insert(A, slots) == 0
    assert hits(cache.match_prefix(A)) == (12, 0, 0)
    assert torch.equal(cache.match_prefix(A).device_indices, slots)
    dup = cache.alloc_device(8)
    compute(cache, A[:8], dup, 0)
    assert cache.insert(A[:8], dup) == 8            # already cached: dup is the caller's to free
    cache.free_device(dup)


def test_alloc_device_evicts_for_the_engine():
    cache = make_cache(device_tokens=16, host_tokens=64)
    serve(cache, A)                                 # 12 of 16 device slots
    cache.flush()
    slots = cache.alloc_device(8)
    assert slots is not None and slots.numel() == 8
    assert hits(cache.match_prefix(A)) == (8, 4, 0)   # eviction demotes exactly the page needed: A's last



def test_more_slots_than_the_whole_pool_evict_nothing():
    """An allocation larger than the whole device pool fails (``None``, counted) without
    evicting: no eviction could make room for it, and before, every unlocked device
    page went first. The cached prompt is still a device hit."""
    cache = make_cache(device_tokens=16, host_tokens=64)
    serve(cache, A)
    cache.flush()
    assert cache.alloc_device(20) is None
    assert cache.stats()["device_alloc_failures"] == 1
    assert hits(cache.match_prefix(A)) == (12, 0, 0)

@pytest.mark.parametrize("kwargs, match", [
    ({"write_policy": "write_around"}, "unknown write_policy 'write_around'; supported: write_through"),
    ({"prefetch_policy": "eager"}, "unknown prefetch_policy 'eager'"),
    ({"io_backend": "dma"}, "unknown io_backend 'dma'"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_cache(**kwargs)


def test_bad_insert_and_mismatched_pools():
    from kvtier import DeviceKVPool, HierarchicalCache, HostKVPool, KVSpec

    cache = make_cache()
    with pytest.raises(ValueError, match="at least 8 slots"):
        cache.insert(A[:8], torch.arange(4))
    with pytest.raises(ValueError, match="differ"):
        HierarchicalCache(DeviceKVPool(SPEC, 16, PAGE), HostKVPool(KVSpec.mha(2, 2, 6), 16, PAGE))


def test_alloc_failures_are_counted_when_everything_is_locked():
    cache = make_cache(device_tokens=16, host_tokens=64)
    serve(cache, A)
    m = cache.match_prefix(A)
    with cache.locked(m):
        assert cache.alloc_device(8) is None
    assert cache.stats()["device_alloc_failures"] == 1
    assert cache.alloc_device(8) is not None


def test_write_back_eviction_frees_a_deep_chain():
    cache = make_cache(device_tokens=32, host_tokens=32, write_policy="write_back")
    chain = list(range(400, 424))                  # 6 pages, inserted one page deeper each time: 6 nodes
    for n in range(PAGE, len(chain) + 1, PAGE):
        serve(cache, chain[:n])
    assert cache.stats()["host_tokens"] == 0
    assert cache.evict_device(64) == 24            # each level waits for its backup, then its parent goes
    assert hits(cache.match_prefix(chain)) == (0, 24, 0)
    got = cache.acquire(chain)
    check_prefix(cache, chain, got.device_indices)
    cache.release(got)
