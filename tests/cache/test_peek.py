"""``peek``: match_prefix's lengths without touching anything (no split, no LRU stamp,
no hit count, no statistic, no backup)."""

import pytest
import torch

from kvtier import CacheClosedError
from tests.support.cache_engine import make_cache, serve

A = list(range(100, 112))            # 3 pages
B = list(range(200, 208))            # 2 pages
C = list(range(300, 308))            # 2 pages


def hits(m):
    return (m.device_len, m.host_len, m.storage_len)


def snapshot(cache):
    """Everything a match may change: the cache's counters, the tree's nodes (LRU
    stamps and hit counts included) and its tenants."""
    cache.flush()
    stats = {k: v for k, v in cache.stats().items() if k != "storage"}  # the backend counts the probe itself
    nodes = sorted((n.serial, tuple(n.key), n.last_access, n.hits, n.lock_ref, n.dev_pages is not None,
                    n.host_ready, n.stored) for n in cache.tree.nodes())
    return stats, nodes, sorted(cache.tree.roots)


def peek_then_match(cache, tokens, salt=None):
    """Peek (checking it changed nothing), then match: both results."""
    before = snapshot(cache)
    peeked = cache.peek(tokens, salt)
    assert snapshot(cache) == before
    matched = cache.match_prefix(tokens, salt)
    assert peeked.peeked and not matched.peeked
    assert torch.equal(peeked.device_indices, matched.device_indices)
    return hits(peeked), hits(matched)


def test_peek_of_an_empty_cache_is_a_miss_and_makes_no_tenant():
    cache = make_cache()
    before = snapshot(cache)
    m = cache.peek(A, salt="tenant")
    assert hits(m) == (0, 0, 0) and m.device_indices.numel() == 0 and m.last_node is None
    assert snapshot(cache) == before


def test_peek_inside_a_device_node_does_not_split_it():
    cache = make_cache()
    serve(cache, A)                                       # one node of 3 pages
    assert len(list(cache.tree.nodes())) == 1
    m = cache.peek(A[:8] + [1, 2, 3, 4])
    assert hits(m) == (8, 0, 0) and m.device_indices.numel() == 8
    assert m.last_node.key.tolist() == A                   # the walked node, whole
    assert len(list(cache.tree.nodes())) == 1
    assert peek_then_match(cache, A[:8] + [1, 2, 3, 4]) == ((8, 0, 0), (8, 0, 0))
    assert len(list(cache.tree.nodes())) == 2              # match_prefix split it


def test_peek_agrees_with_match_prefix_across_tiers():
    cache = make_cache()
    serve(cache, A[:4])
    serve(cache, A)                                        # nodes of 1 and 2 pages
    serve(cache, B)
    cache.flush()                                          # write_through: every page has its host copy
    cache.evict_device(8)                                  # A's 2-page leaf (least recent) goes to the host
    assert peek_then_match(cache, A) == ((4, 8, 0), (4, 8, 0))
    assert peek_then_match(cache, A[:8]) == ((4, 4, 0), (4, 4, 0))      # ends inside a host-only node
    assert peek_then_match(cache, B + A) == ((8, 0, 0), (8, 0, 0))
    assert peek_then_match(cache, C) == ((0, 0, 0), (0, 0, 0))
    assert peek_then_match(cache, A, salt="other") == ((0, 0, 0), (0, 0, 0))
    cache.evict_device(64)
    assert peek_then_match(cache, B) == ((0, 8, 0), (0, 8, 0))
    assert peek_then_match(cache, A + [9]) == ((0, 12, 0), (0, 12, 0))
    assert cache.evict_host(8) == 8                        # B, now the least recent host leaf
    assert peek_then_match(cache, B) == ((0, 0, 0), (0, 0, 0))
    assert peek_then_match(cache, A) == ((0, 12, 0), (0, 12, 0))


def test_peek_probes_storage_after_a_match_that_ends_inside_a_node(store):
    first = make_cache(storage=store)
    serve(first, A[:8] + C)
    first.flush()
    second = make_cache(storage=store)
    serve(second, A)                                       # one node of 3 pages; the prompt leaves it after 2
    assert peek_then_match(second, A[:8] + C) == ((8, 0, 8), (8, 0, 8))
    assert peek_then_match(second, A + C) == ((12, 0, 0), (12, 0, 0))
    fresh = make_cache(storage=store)
    assert peek_then_match(fresh, A[:8] + C + [5]) == ((0, 0, 16), (0, 0, 16))
    for cache in (first, second, fresh):
        cache.close()


def test_peek_counts_no_hit_for_selective_backups():
    cache = make_cache(write_policy="write_through_selective")
    serve(cache, A)
    for _ in range(3):
        cache.peek(A)
    cache.flush()
    assert [n.hits for n in cache.tree.nodes()] == [0] and cache.stats()["host_tokens"] == 0
    cache.match_prefix(A)
    cache.match_prefix(A)                                  # the second hit backs it up
    cache.flush()
    assert [n.hits for n in cache.tree.nodes()] == [2] and cache.stats()["host_tokens"] == 12


def test_a_peek_result_cannot_be_locked_or_loaded():
    cache = make_cache()
    serve(cache, A)
    m = cache.peek(A[:8])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="use match_prefix"):
        cache.lock(m)
    with pytest.raises(ValueError, match="use match_prefix"):
        with cache.locked(m):
            pass
    with pytest.raises(ValueError, match="use match_prefix"):
        cache.load_back(m)
    assert snapshot(cache) == before
    cache.close()
    with pytest.raises(CacheClosedError):
        cache.peek(A)


@pytest.mark.parametrize("name", ["mimo", "long_window"])
def test_a_hybrid_peek_inside_a_node_gives_what_a_match_would(name):
    """A peek does not split the node its prefix ends inside, so that node reaches past
    the prefix: each sliding window must be looked up by where the path's nodes sit, not
    from the node's end. Prefixes ending inside a cached prompt's node (not resume points:
    their windows are freed) and at its end: peek and match give the same lengths."""
    import random

    from tests.support.cache_hybrid_engine import HybridEngine
    from tests.support.cache_hybrid_engine import make_cache as make_hybrid
    from tests.support.pools import HYBRID_SPECS

    spec = HYBRID_SPECS[name]
    sizes = {g.name: 1024 for g in spec.groups}
    rng = random.Random(1)
    a = [rng.randrange(10_000) for _ in range(64)]
    for cut in (8, 20, 36, 48, 60, 64):
        cache = make_hybrid(spec, 4, sizes, sizes)
        HybridEngine(cache).serve(a)
        tokens = a[:cut] + [rng.randrange(10_000, 20_000) for _ in range(4)]
        peeked, matched = peek_then_match(cache, tokens)
        assert peeked == matched, (cut, peeked, matched)
        assert (matched[0] == 64) == (cut == 64)  # only the cached prompt's end resumes here
        cache.close()


@pytest.mark.parametrize("cut", [8, 16, 20])
def test_a_hybrid_peek_with_storage_keys_the_prompt_from_where_it_leaves_a_node(tmp_path, cut):
    """A hybrid peek asks storage for the prompt's pages after its resident ones, keyed
    from the last resident page. Ending inside a cached prompt's node, which a peek does
    not split, those keys must start from the prompt's own pages, not the node's: peek
    and match then agree (before, the peek took the node's later keys as the prompt's
    and found the cached prompt's stored pages, a storage hit of 32 tokens where the
    match found none)."""
    import kvtier.storage
    from tests.support.cache_hybrid_engine import HybridEngine
    from tests.support.cache_hybrid_engine import make_cache as make_hybrid
    from tests.support.pools import HYBRID_SPECS

    spec = HYBRID_SPECS["oss"]
    sizes = {g.name: 64 for g in spec.groups}
    cache = make_hybrid(spec, 4, sizes, sizes, kvtier.storage.open(f"file://{tmp_path}"), synchronous=True)
    cached = list(range(1000, 1032))  # 8 pages: one node, stored whole
    HybridEngine(cache).commit_whole(cached, resume_at=(cut - cut % 4,))
    cache.flush()
    tokens = cached[:cut] + list(range(5000, 5024))
    peeked, matched = peek_then_match(cache, tokens)
    assert peeked == matched and matched[2] == 0, (peeked, matched)
    cache.close()
