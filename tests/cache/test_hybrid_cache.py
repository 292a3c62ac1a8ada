"""The cache on hybrid specs (the reuse rule of docs/hybrid.md): exact reuse of every group from device,
host and storage; sliding pages kept only in resume points' windows; a missing
page of any group ends the hit before it."""

from __future__ import annotations

import random
import threading

import pytest
import torch

import kvtier.storage
from kvtier.storage.groups import GroupedStorage
from kvtier.storage.keys import page_keys
from kvtier import HierarchicalCache, HybridDevicePool, HybridHostPool, KVSpec
from kvtier.cache.tokens import token_array
from tests.support.cache_hybrid_engine import HybridEngine, make_cache, prefix_hashes
from tests.support.pools import HYBRID_SPECS

SERVED = ("mimo", "oss", "all_swa", "long_window")
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def sizes(spec, full: int, swa: int) -> dict:
    return {g.name: full if g.attention.is_full else swa for g in spec.groups}


class CountingStore:
    """A real store that records every key written."""

    def __init__(self, inner) -> None:
        self.inner, self.written = inner, []

    def batch_exists(self, keys):
        return self.inner.batch_exists(keys)

    def exists_each(self, keys):
        return self.inner.exists_each(keys)

    def batch_get(self, keys, host_pool, host_indices):
        return self.inner.batch_get(keys, host_pool, host_indices)

    def batch_set(self, keys, host_pool, host_indices):
        self.written += list(keys)
        return self.inner.batch_set(keys, host_pool, host_indices)

    def stats(self):
        return self.inner.stats()

    def group_pages(self, tag: str) -> int:
        return sum(1 for k in self.written if f"~{tag}." in k)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10_000) for _ in range(n)]


def evict_all(cache: HierarchicalCache) -> None:
    cache.flush()
    cache.evict_device(10 ** 9)
    cache.evict_host(10 ** 9)
    assert cache.stats()["device_tokens"] == cache.stats()["host_tokens"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", SERVED)
def test_every_group_is_reused_exactly_from_device_host_and_storage(name, layout, tmp_path):
    spec = HYBRID_SPECS[name]
    store = kvtier.storage.open(f"file://{tmp_path}")
    cache = make_cache(spec, 4, sizes(spec, 256, 128), sizes(spec, 512, 256), store, layout,
                       prefetch_policy="wait_complete")
    eng, rng = HybridEngine(cache), random.Random(1)
    a = prompt(rng, 50)
    b = a + prompt(rng, 30)
    assert eng.serve(a) == 0
    assert eng.serve(a, keep="tail") == 48  # device (every check is byte-exact, per group)
    assert eng.serve(b, keep="tail") == 48
    cache.flush()
    cache.evict_device(10 ** 9)
    assert eng.serve(b) == 80  # host, loaded back
    evict_all(cache)
    assert eng.serve(a) == 48  # storage, prefetched
    assert eng.serve(b) == 80
    assert cache.stats()["errors"] == 0
    cache.close()


@pytest.mark.parametrize("page_size", [1, 2, 8])
@pytest.mark.parametrize("name", SERVED)
def test_windows_of_every_size_against_the_page(name, page_size, tmp_path):
    """Windows smaller than a page, not a multiple of it, and several pages long."""
    spec = HYBRID_SPECS[name]
    store = kvtier.storage.open(f"file://{tmp_path}")
    cache = make_cache(spec, page_size, sizes(spec, 512, 256), sizes(spec, 512, 256), store,
                       prefetch_policy="wait_complete")
    eng, rng = HybridEngine(cache), random.Random(page_size)
    a = prompt(rng, 61)
    full = 61 // page_size * page_size
    eng.serve(a, keep="tail")
    assert eng.serve(a) == full
    cache.flush()
    cache.evict_device(10 ** 9)
    assert eng.serve(a) == full
    evict_all(cache)
    assert eng.serve(a) == full
    cache.close()


def test_sliding_pages_outside_every_window_are_freed_and_never_stored(tmp_path):
    spec = HYBRID_SPECS["mimo"]  # window 6: with pages of 4, two pages before each resume point
    store = CountingStore(kvtier.storage.open(f"file://{tmp_path}"))
    cache = make_cache(spec, 4, sizes(spec, 256, 256), sizes(spec, 512, 256), store)
    eng, rng = HybridEngine(cache), random.Random(2)
    a = prompt(rng, 80)
    eng.serve(a)  # the engine hands over all 20 sliding pages
    cache.flush()
    held = cache.stats()["sliding_pages"]["swa"]
    assert held == {"device": 2, "host": 2}
    assert store.group_pages("swa") == 2 and store.group_pages("full") == 20
    assert cache.device_pool["swa"].available_size() == 256 - 2 * 4  # the other 18 went back at commit
    cache.close()


def test_memory_bytes_count_the_sliding_pages():
    spec = HYBRID_SPECS["mimo"]
    cache = make_cache(spec, 4, sizes(spec, 256, 256), sizes(spec, 512, 256))
    eng, rng = HybridEngine(cache), random.Random(3)
    eng.serve(prompt(rng, 40))
    evict_all(cache)
    empty = cache.memory_bytes()  # the root made, and the child map it grew
    eng.serve(prompt(rng, 40))
    held = cache.memory_bytes()
    groups = len(cache.stats()["sliding_pages"])
    assert held - empty >= 8 * 40 + 8 * 10 * (1 + groups)  # the key's ids, its pages, each group's page numbers
    evict_all(cache)
    # NOTE: not back to ``empty`` exactly: a sliding group's LRU heap keeps the entries of
    # nodes that full-page eviction removed until a sliding eviction or a compaction pops them
    assert cache.memory_bytes() < held
    cache.close()


def test_nodes_that_full_page_eviction_removed_do_not_pile_up_in_the_sliding_heaps():
    """Full pages evicted over and over while the sliding pool never runs short (so no
    sliding eviction pops its heap): the entries of removed nodes, each holding its
    node and key, stay a bounded share of the live tree (half of it, and 64 more), not
    the 4x that the duplicate bound alone allows."""
    spec = HYBRID_SPECS["mimo"]
    cache = make_cache(spec, 4, sizes(spec, 48, 4096), sizes(spec, 48, 4096))
    eng, rng = HybridEngine(cache), random.Random(5)
    state, worst = cache._state, 0
    for _ in range(600):
        eng.serve(prompt(rng, 40))
        live = sum(1 for _ in state.tree.nodes())
        dead = {id(e[-1]) for name, heap in state.lru._heaps.items() if ":" in name for e in heap
                if not state.tree.attached(e[-1])}
        worst = max(worst, len(dead) - (live // 2 + 64))
    assert cache.stats()["host_evicted_tokens"] > 40 * 500  # full pages churned: nodes left the tree
    assert worst <= 0
    cache.close()


def test_retention_interval_keeps_a_window_every_interval(tmp_path):
    spec = HYBRID_SPECS["mimo"]
    store = CountingStore(kvtier.storage.open(f"file://{tmp_path}"))
    cache = make_cache(spec, 4, sizes(spec, 256, 256), sizes(spec, 512, 256), store, retention_interval=16)
    eng, rng = HybridEngine(cache), random.Random(3)
    a = prompt(rng, 64)
    eng.serve(a)
    cache.flush()
    # resume points 16, 32, 48 and the end (64): two pages each
    assert cache.stats()["sliding_pages"]["swa"]["device"] == 8
    assert store.group_pages("swa") == 8
    for cut in (16, 32, 48):  # a shared prefix that stops at a retention point is a hit
        assert eng.serve(a[:cut] + prompt(rng, 9)) == cut
    assert eng.serve(a[:40] + prompt(rng, 9)) == 32  # between points: back to the last one
    with pytest.raises(ValueError, match="retention_interval"):
        make_cache(spec, 4, 64, 64, retention_interval=6)
    cache.close()


def test_a_load_moves_only_the_window_it_resumes_with():
    spec = HYBRID_SPECS["mimo"]
    cache = make_cache(spec, 4, sizes(spec, 256, 256), sizes(spec, 512, 256), retention_interval=16)
    eng, rng = HybridEngine(cache), random.Random(8)
    a = prompt(rng, 64)
    eng.serve(a)
    cache.flush()
    assert cache.stats()["sliding_pages"]["swa"] == {"device": 8, "host": 8}  # windows before 16, 32, 48, 64
    cache.evict_device(10 ** 9)
    got = cache.acquire(a)
    assert got.device_indices.numel() == 64 and got.host_hit == 64
    assert cache.stats()["sliding_pages"]["swa"]["device"] == 2  # the window before 64, not the other three
    eng.check_prefix(a, got.device_indices, got.groups, "load")
    cache.release(got)
    got = cache.acquire(a[:32] + prompt(rng, 5))  # another resume point of the same nodes: its window alone
    assert got.device_indices.numel() == 32 and cache.stats()["sliding_pages"]["swa"]["device"] == 4
    eng.check_prefix(a, got.device_indices, got.groups, "partial load")
    cache.release(got)
    cache.close()


def test_resume_at_keeps_more_points_resumable():
    spec = HYBRID_SPECS["mimo"]
    cache = make_cache(spec, 4, sizes(spec, 256, 256), sizes(spec, 256, 256))
    eng, rng = HybridEngine(cache), random.Random(10)
    a = prompt(rng, 48)
    eng.commit_whole(a, resume_at=(20,))
    assert eng.serve(a[:20] + prompt(rng, 7)) == 20  # the extra point
    assert eng.serve(a[:28] + prompt(rng, 7)) == 20  # none between it and the end
    with pytest.raises(ValueError, match="resume_at"):
        cache.insert(a, cache.alloc_device(48), resume_at=(6,))
    cache.close()


def test_a_nodes_own_sliding_page_given_back_outside_every_window_stays_the_nodes():
    # a page kept for an earlier commit's resume point (8), handed back at its place by a
    # commit that does not resume there: it is the node's, not the engine's, to free
    spec = HYBRID_SPECS["mimo"]  # window 6 tokens, pages of 4: the window before 8 is pages 0 and 1
    cache = make_cache(spec, 4, sizes(spec, 64, 64), sizes(spec, 64, 64))
    tokens = list(range(16))
    got = cache.acquire(tokens)
    cache.release(cache.commit(got, tokens, cache.alloc_device(16), groups={"swa": cache.alloc_device(16, group="swa")},
                               resume_at=[8]).acquired)
    got = cache.acquire(tokens[:8])
    window = got.groups["swa"].clone()
    cache.release(got)
    got = cache.acquire(tokens[:4] + [999] * 12)
    assert got.device_indices.numel() == 4
    given = cache.alloc_device(12, group="swa")
    given[0:4] = window[4:8]  # page 1: the node's own, at the same place
    cache.release(cache.commit(got, tokens, cache.alloc_device(12), groups={"swa": given}).acquired)  # checked
    got = cache.acquire(tokens[:8])
    assert got.device_indices.numel() == 8 and torch.equal(got.groups["swa"], window)
    fresh = []  # every page the pool still hands out (the node's stays locked, so nothing is evicted)
    while (slots := cache.alloc_device(4, group="swa")) is not None:
        fresh += slots.tolist()
    assert not set(fresh) & set(window[4:8].tolist()), "the node's page was handed out again"
    cache.release(got)
    cache.close()


def test_a_branch_point_keeps_its_window():
    spec = HYBRID_SPECS["oss"]
    cache = make_cache(spec, 4, sizes(spec, 512, 256), sizes(spec, 512, 256))
    eng, rng = HybridEngine(cache), random.Random(4)
    system = prompt(rng, 32)
    assert eng.serve(system + prompt(rng, 20)) == 0
    # the first request kept only its end's window: the system prompt is not resumable yet
    assert eng.serve(system + prompt(rng, 20)) == 0
    # the second made 32 a branch point, and its own pages fill that window
    assert eng.serve(system + prompt(rng, 20)) == 32
    cache.flush()
    cache.evict_device(10 ** 9)  # the window was backed up after the node's host copy: it outlives the device
    assert eng.serve(system + prompt(rng, 20)) == 32
    cache.close()


def test_a_missing_sliding_or_full_page_ends_the_hit_before_it(tmp_path):
    spec = HYBRID_SPECS["mimo"]  # window 6, pages of 4: resuming after 48 needs sliding pages 10 and 11
    store = kvtier.storage.open(f"file://{tmp_path}")
    cache = make_cache(spec, 4, sizes(spec, 256, 256), sizes(spec, 512, 256), store, retention_interval=16,
                       prefetch_policy="wait_complete")
    eng, rng = HybridEngine(cache), random.Random(5)
    a = prompt(rng, 48)
    eng.commit_whole(a, lose=range(44, 48))  # the engine lost the sliding page just before the end
    assert cache.match_prefix(a).cached_len == 32  # the last retention point whose window is whole
    assert cache.peek(a).cached_len == 32
    evict_all(cache)
    assert cache.match_prefix(a).storage_len == 32  # storage never got the page either
    keys = page_keys(a, 4, cache.namespace)
    grouped = GroupedStorage(store, spec, 4)
    store.delete(grouped.keys("swa", [keys[6]]))  # in the window before 32
    assert cache.match_prefix(a).storage_len == 16
    store.delete(grouped.keys("full", [keys[2]]))
    assert cache.match_prefix(a).storage_len == 0  # 16 needs full pages 0-3
    assert eng.serve(a) == 0
    assert eng.serve(a) == 48  # recomputed whole: every window is back
    cache.close()


def test_an_all_sliding_model_needs_no_full_slots(tmp_path):
    """Mistral-like: every layer sliding. The tree's own slots hold no KV; commit and
    insert take None for them."""
    spec = HYBRID_SPECS["all_swa"]  # window 3: the page before each resume point (pages of 4)
    store = kvtier.storage.open(f"file://{tmp_path}")
    cache = make_cache(spec, 4, 64, 64, store, prefetch_policy="wait_complete")
    eng, rng = HybridEngine(cache), random.Random(9)
    a = prompt(rng, 30)
    got = cache.acquire(a)
    side = cache.alloc_device(28, group="swa")
    eng.write("swa", side, prefix_hashes(a)[:28])
    done = cache.commit(got, a, None, groups={"swa": side})
    assert done.cached_tokens == 28 and done.acquired.device_indices.numel() == 28
    cache.release(done.acquired)
    assert cache.stats()["sliding_pages"]["swa"]["device"] == 1
    assert eng.serve(a) == 28
    evict_all(cache)
    assert eng.serve(a) == 28  # from storage: one object
    assert cache.insert(prompt(rng, 8), None) == 0
    cache.close()



def test_an_all_sliding_call_refused_after_its_placeholders_leaves_them_free():
    """An all-sliding model's commit and insert take ``None`` for the tree's slots and
    allocate placeholders for them. A call refused for its other arguments (groups,
    resume points), before or after the placeholders are allocated (a released lease is
    judged under the cache's lock), frees them: the pool is as it was, and the integrity
    check finds no slot leaked (before, each refusal kept its placeholders for good)."""
    spec = HYBRID_SPECS["all_swa"]
    cache = make_cache(spec, 4, {"swa": 32}, {"swa": 32}, synchronous=True)
    tokens = list(range(16))
    free = cache.allocator.available_size()
    with pytest.raises(ValueError, match="groups\\['swa'\\] must be"):
        cache.insert(tokens, None, groups={"swa": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="resume_at holds \\[3\\]"):
        cache.insert(tokens, None, resume_at=[3])
    got = cache.acquire(tokens)
    with pytest.raises(ValueError, match="resume_at holds \\[5\\]"):
        cache.commit(got, tokens, None, resume_at=[5])
    cache.release(got)
    with pytest.raises(ValueError, match="already released"):
        cache.commit(got, tokens, None)
    assert cache.allocator.available_size() == free
    cache.check_integrity(engine_device_slots=0)
    assert cache.insert(tokens, None) == 0 and cache.allocator.available_size() == free - 16
    cache.close()


def test_more_sliding_slots_than_the_whole_group_pool_evict_nothing():
    """A sliding group's allocation larger than its whole pool fails without evicting
    that group's pages: the cached prompt stays a hit."""
    spec = HYBRID_SPECS["oss"]
    cache = make_cache(spec, 4, {g.name: 64 for g in spec.groups}, {g.name: 64 for g in spec.groups},
                       synchronous=True)
    eng = HybridEngine(cache)
    a = list(range(100, 132))
    eng.commit_whole(a)
    sliding = cache.stats()["sliding_pages"]["swa"]["device"]
    assert cache.match_prefix(a).device_len == 32 and sliding > 0
    assert cache.alloc_device(68, group="swa") is None
    assert cache.match_prefix(a).device_len == 32
    assert cache.stats()["sliding_pages"]["swa"]["device"] == sliding
    cache.close()

def test_misuse_is_refused_before_anything_changes():
    spec = HYBRID_SPECS["mimo"]
    cache = make_cache(spec, 4, sizes(spec, 64, 64), sizes(spec, 64, 64))
    tokens = list(range(16))
    got = cache.acquire(tokens)
    new = cache.alloc_device(16)
    with pytest.raises(ValueError, match="not a sliding group"):
        cache.alloc_device(4, group="full")
    with pytest.raises(ValueError, match="16 slots"):
        cache.commit(got, tokens, new, groups={"swa": torch.arange(8)})
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        cache.commit(got, tokens, new, groups={"swa": torch.arange(1, 17)})
    with pytest.raises(ValueError, match="neither a whole page nor all -1"):
        cache.commit(got, tokens, new, groups={"swa": torch.tensor([-1, -1, -1, 3, *range(4, 16)])})
    with pytest.raises(ValueError, match=r"groups\['swa'\]: device slot 0 is not allocated"):
        cache.commit(got, tokens, new, groups={"swa": torch.arange(16)})
    swa = cache.alloc_device(4, group="swa")  # its first page allocated: the error names the next one's
    with pytest.raises(ValueError, match=rf"device slot {4 if int(swa[0]) == 0 else 0} is not allocated"):
        cache.commit(got, tokens, new, groups={"swa": torch.arange(16)})
    cache.free_device(swa, group="swa")
    with pytest.raises(ValueError, match=rf"group 'swa''s slot {int(swa[0])} is not allocated"):
        cache.free_device(swa, group="swa")  # a second free of the same page
    with pytest.raises(ValueError, match="groups="):
        cache.commit(got, tokens, new, groups={"nope": torch.arange(16)})
    assert cache.stats()["device_tokens"] == 0
    cache.commit(got, tokens, new)  # no sliding pages: cached, but no window: no hit
    assert cache.match_prefix(tokens).cached_len == 0
    one = KVSpec.mha(1, 1, 4)
    uniform = HierarchicalCache(HybridDevicePool(one, 16, 4), HybridHostPool(one, 16, 4))
    got = uniform.acquire(tokens)
    with pytest.raises(ValueError, match="uniform"):
        uniform.commit(got, tokens, uniform.alloc_device(16), groups={"swa": torch.arange(16)})
    uniform.close()
    cache.close()


def test_sliding_pools_smaller_than_the_working_set_evict_per_group():
    spec = HYBRID_SPECS["mimo"]
    cache = make_cache(spec, 4, sizes(spec, 256, 32), sizes(spec, 256, 32))
    eng, rng = HybridEngine(cache), random.Random(6)
    prompts = [prompt(rng, 40) for _ in range(12)]
    for p in prompts * 2:
        eng.serve(p, keep=rng.choice(["all", "tail"]))
    assert cache.stats()["errors"] == 0
    cache.close()


@pytest.mark.parametrize("name", SERVED)
def test_threads_share_a_hybrid_cache(tmp_path, name):
    spec = HYBRID_SPECS[name]
    store = kvtier.storage.open(f"file://{tmp_path}")
    cache = make_cache(spec, 4, sizes(spec, 192, 64), sizes(spec, 256, 96), store, check=False,
                       retention_interval=16)
    eng = HybridEngine(cache)
    shared = prompt(random.Random(7), 24)
    errors = []

    def run(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(25):
                eng.serve(shared + prompt(rng, rng.randrange(0, 24)), keep=rng.choice(["all", "tail"]))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    cache.flush()
    cache.check_integrity(engine_device_slots=0)
    cache.close()


@pytest.mark.parametrize("name", ["mimo", "long_window"])
def test_a_path_of_one_node_per_page_resumes_with_its_window(name):
    """Every page of a prompt has a diverging sibling, so its path crosses one node per
    page (the window is found from the path's end by each node's depth): a full hit
    hands back the window's KV exactly, and so does a hit that ends at a branch point
    inside the path (the cut from the end)."""
    spec = HYBRID_SPECS[name]
    cache = make_cache(spec, 4, sizes(spec, 1024, 1024), sizes(spec, 1024, 1024))
    eng, rng = HybridEngine(cache), random.Random(13)
    a = prompt(rng, 64)
    eng.serve(a)
    for i in range(1, 16):
        eng.serve(a[:4 * i] + prompt(rng, 4))  # a branch point after every page
    assert len(cache.match_prefix(a).path) == 16
    assert eng.serve(a) == 64  # its check_prefix compares every group's window with what was written
    assert eng.serve(a[:36] + prompt(rng, 8)) == 36
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("name", ["mimo", "long_window"])
def test_a_match_hands_back_the_windows_its_check_found(name, native, monkeypatch):
    """A full device hit reuses the window pieces its check found for its groups' slots:
    they equal what a fresh walk of the same path gives, for hits on one node, on a path
    of a node per page, and ending at a branch point inside the path (which walks); the
    compiled fill and numpy's give the same slots."""
    if not native:
        monkeypatch.setenv("KVTIER_NATIVE", "0")
    spec = HYBRID_SPECS[name]
    cache = make_cache(spec, 4, sizes(spec, 1024, 1024), sizes(spec, 1024, 1024))
    eng, rng = HybridEngine(cache), random.Random(5)
    a, b = prompt(rng, 64), prompt(rng, 40)
    eng.serve(b)
    eng.serve(a)
    for i in range(1, 16, 3):
        eng.serve(a[:4 * i] + prompt(rng, 4))
    for tokens in (a, b, a[:36], a[:36] + prompt(rng, 8), b[:20] + prompt(rng, 8)):
        m = cache.match_prefix(tokens)
        assert m.groups is not None and set(m.groups) == {g.name for g in spec.groups if not g.attention.is_full}
        walked = cache._state.side_slots(list(m.path), m.device_len)
        assert {g: t.tolist() for g, t in m.groups.items()} == {g: t.tolist() for g, t in walked.items()}
        assert all(t.numel() == m.device_len and (t >= 0).any() == (m.device_len > 0) for t in m.groups.values())
    assert eng.serve(a) == 64 and eng.serve(b) == 40  # every group's window compared with what was written
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("name", SERVED)
def test_a_miss_gets_new_empty_slot_tensors_for_every_group(name):
    """A miss's groups (and full slots) are empty int64 tensors, new for each result:
    one resized by its caller changes no other."""
    spec, rng = HYBRID_SPECS[name], random.Random(4)
    cache = make_cache(spec, 4, sizes(spec, 256, 128), sizes(spec, 256, 128))
    HybridEngine(cache).serve(prompt(rng, 16))
    first, second = (cache.match_prefix([999] * 12) for _ in range(2))
    for m in (first, second):
        assert m.device_len == 0 and set(m.groups) == {g.name for g in spec.groups if not g.attention.is_full}
        assert all(t.dtype == torch.int64 and t.shape == (0,) for t in (m.device_indices, *m.groups.values()))
    for t in (first.device_indices, *first.groups.values()):
        t.resize_(4).fill_(7)
    assert all(t.shape == (0,) for t in (second.device_indices, *second.groups.values()))
    assert all(t.shape == (0,) for t in cache.match_prefix([999] * 12).groups.values())
    cache.close()


@pytest.mark.parametrize("name", ["mimo", "long_window"])
def test_the_window_pieces_found_in_the_last_node_are_the_walks(name):
    """A window within the path's last node is taken from it alone: for every node's
    path and every prefix of it, the pieces equal those of the walk over the path
    from its end (windows in one node, across nodes, and past a short last node)."""
    spec = HYBRID_SPECS[name]
    cache = make_cache(spec, 4, sizes(spec, 1024, 1024), sizes(spec, 1024, 1024))
    eng, rng = HybridEngine(cache), random.Random(8)
    a = prompt(rng, 64)
    eng.serve(a)
    for cut in (4, 8, 24, 28, 52):
        eng.serve(a[:cut] + prompt(rng, 4 * rng.randrange(1, 5)))
    state, checked = cache._state, 0
    for node in state.tree.nodes():
        path = node.path()
        for p in range(node.depth // 4 + 1):
            for g in state.sides.names:
                w = state.sides.window_pages(g, p * 4)
                walked = [(lo, n.device.side[g][span]) for n, lo, span in state._window_spans(path, w)
                          if n.device is not None]
                got = state._window_pieces(path, g, w)
                assert [(lo, h.tolist()) for lo, h in got] == [(lo, h.tolist()) for lo, h in walked]
                checked += bool(walked)
    assert checked > 50
    cache.close()


@pytest.mark.parametrize("name", SERVED)
def test_match_slots_is_match_then_device_slots_on_hybrid_trees(name):
    """The full hit's short route (``match_slots``: every node and every window on the
    device) and the general one give the same path, lengths, slots, probe and groups'
    slots, and leave the same tree and LRU order, whatever each prompt finds."""
    spec, rng = HYBRID_SPECS[name], random.Random(5)
    a = prompt(rng, 40)
    b, c = a + prompt(rng, 24), a[:20] + prompt(rng, 30)
    queries = [a, b, c, a[:20], a[:30], b[:48], c[:44], b + prompt(rng, 9), prompt(rng, 16), a[:3]]
    for i, query in enumerate(queries):
        got = []
        for route in ("match_slots", "match"):
            cache = make_cache(spec, 4, sizes(spec, 256, 128), sizes(spec, 512, 256))
            eng = HybridEngine(cache)
            eng.serve(a, keep="tail")  # a[:20] then ends a node (c splits it) with its window gone
            eng.serve(b, keep="tail")
            cache.flush()
            cache.evict_device(24)  # some nodes, or some windows, on the host only
            eng.serve(c, keep="tail")
            state, probe = cache._state, []
            with state.lock:
                tokens = token_array(query)
                if route == "match_slots":
                    path, device_len, host_len, slots = state.match_slots(tokens, b"", probe)
                else:
                    path, device_len, host_len = state.match(tokens, b"", probe)
                    slots = state.device_slots(path)
                groups = state.side_slots(path, device_len, probe[0])
                lru = sorted(state.tree.nodes(), key=lambda n: (n.last_access, n.key.tolist()))
                # NOTE: not the probe's windows: a full hit's route leaves the groups' slots there instead
                got.append(([n.key.tolist() for n in path], device_len, host_len, slots.tolist(),
                            probe[0].pages, {g: s.tolist() for g, s in groups.items()},
                            sorted(n.key.tolist() for n in state.tree.nodes()), [n.key.tolist() for n in lru]))
            cache.check_integrity(engine_device_slots=0)
            cache.close()
        assert got[0] == got[1], f"query {i}"


def test_freeing_a_sliding_page_the_tree_holds_is_refused_naming_it():
    """``free_device(..., group=)`` of a sliding page a node holds, between pages the
    caller owns: a ``ValueError`` naming the held page's first slot, and nothing is freed."""
    spec = HYBRID_SPECS["oss"]
    cache = make_cache(spec, 4, {g.name: 64 for g in spec.groups}, {g.name: 64 for g in spec.groups},
                       synchronous=True)
    a = list(range(100, 132))
    HybridEngine(cache).commit_whole(a)
    held = cache.match_prefix(a).groups["swa"]
    held = held[held >= 0][:4]  # one whole sliding page of the tree's
    assert held.numel() == 4
    mine = cache.alloc_device(8, group="swa")
    free_before = cache.stats()["sliding_pages"]["swa"]["device"]
    with pytest.raises(ValueError, match=rf"slot {int(held[0])} of group 'swa' holds a cached page"):
        cache.free_device(torch.cat([mine[:4], held, mine[4:]]), group="swa")
    cache.free_device(mine, group="swa")  # still the caller's: the refused call freed nothing
    assert cache.stats()["sliding_pages"]["swa"]["device"] == free_before
    assert cache.match_prefix(a).device_len == 32
    cache.close()
