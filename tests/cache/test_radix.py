"""The radix tree alone against a reference model: a prefix-closed set of page tuples.

Token ids come from a tiny alphabet so that children whose first pages start with the
same id (keyed by their whole first page, see ``kvtier.cache.radix.Node``) are common.
"""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cache.radix import RadixTree


def _pages(tokens, ps):
    return [tuple(tokens[i:i + ps]) for i in range(0, len(tokens) - len(tokens) % ps, ps)]


def _reference_match(cached: set, tokens, ps) -> int:
    pages, n = _pages(tokens, ps), 0
    while n < len(pages) and tuple(pages[:n + 1]) in cached:
        n += 1
    return n * ps


def _insert(tree: RadixTree, tokens: array, ps: int) -> None:
    usable = len(tokens) - len(tokens) % ps
    path, matched, _ = tree.match(tokens[:usable], b"")
    if matched < usable:
        tree.add_child(path[-1] if path else tree.root(b""), tokens[matched:usable])


def _check_structure(tree: RadixTree, ps: int) -> None:
    for node in [*tree.roots.values(), *tree.nodes()]:
        first_pages = set()
        collisions = 0
        for edge, child in node.children.items():
            assert child.parent is node and child.edge == edge
            assert len(child.key) and len(child.key) % ps == 0
            if isinstance(edge, bytes):
                collisions += 1
                assert edge == child.key[:ps].tobytes()
            else:
                assert edge == child.key[0]
            first = tuple(child.key[:ps])
            assert first not in first_pages, "two children share a first page"
            first_pages.add(first)
        assert collisions == node.collisions


def _remove_leaves(tree: RadixTree, cached: set, ps: int, picks: list[int]) -> None:
    for pick in picks:
        leaves = [n for n in tree.nodes() if not n.children]
        if not leaves:
            return
        leaf = leaves[pick % len(leaves)]
        before = [p for node in leaf.path()[:-1] for p in _pages(node.key, ps)]
        own = _pages(leaf.key, ps)
        tree.remove(leaf)
        for j in range(1, len(own) + 1):
            cached.discard(tuple(before + own[:j]))


sequences = st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=14), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(ps=st.integers(1, 3), inserts=sequences, queries=sequences,
       removals=st.lists(st.integers(0, 100), max_size=4))
def test_walk_matches_the_reference(ps, inserts, queries, removals):
    tree, cached = RadixTree(ps), set()
    for seq in inserts:
        _insert(tree, array("q", seq), ps)
        pages = _pages(seq, ps)
        cached.update(tuple(pages[:j]) for j in range(1, len(pages) + 1))
        _check_structure(tree, ps)
    _remove_leaves(tree, cached, ps, removals)
    _check_structure(tree, ps)
    for seq in queries + inserts:
        tokens = array("q", seq)
        path, matched, inner = tree.walk(tokens, b"")
        assert matched == _reference_match(cached, seq, ps), (seq, matched)
        assert sum(len(n.key) for n in path[:-1]) + (inner if path else 0) == matched
        assert [p for n in path for p in _pages(n.key, ps)][:matched // ps] == _pages(seq, ps)[:matched // ps]
        for a, b in zip(path, path[1:]):
            assert b.parent is a


def test_children_with_one_first_id_are_told_apart_by_their_first_page():
    tree = RadixTree(2)
    for seq in ([5, 1, 7, 7], [5, 2, 8, 8], [5, 3]):
        _insert(tree, array("q", seq), 2)
    root = tree.root(b"")
    assert root.collisions == 2 and sorted(len(c.key) for c in root.children.values()) == [2, 4, 4]
    assert tree.walk(array("q", [5, 2, 8, 8, 9]), b"")[1] == 4
    assert tree.walk(array("q", [5, 3, 1, 1]), b"")[1] == 2
    assert tree.walk(array("q", [5, 4]), b"")[1] == 0
    # the int-keyed child leaves: the others are still found by their first pages
    tree.remove(root.children[5])
    assert tree.walk(array("q", [5, 2, 8, 8]), b"")[1] == 4
    assert tree.walk(array("q", [5, 1, 7, 7]), b"")[1] == 0
    _insert(tree, array("q", [5, 1, 6, 6]), 2)  # takes the free int key
    assert tree.walk(array("q", [5, 1, 6, 6]), b"")[1] == 4
    assert tree.walk(array("q", [5, 2, 8, 8]), b"")[1] == 4
    _check_structure(tree, 2)


def test_a_match_ending_inside_a_node_stamps_only_the_part_it_used():
    tree = RadixTree(2)
    _insert(tree, array("q", [1, 2, 3, 4, 5, 6, 7, 8]), 2)
    (whole,) = tree.root(b"").children.values()
    before = whole.last_access
    path, matched, made = tree.match(array("q", [1, 2, 3, 4, 9, 9]), b"")
    assert matched == 4 and made == path and list(path[0].key) == [1, 2, 3, 4]
    assert path[0].last_access > before
    assert list(whole.key) == [5, 6, 7, 8] and whole.last_access == before  # the unmatched tail was not used


def test_a_match_given_its_walk_stamps_only_the_part_it_used_too():
    tree = RadixTree(2)
    _insert(tree, array("q", [1, 2, 3, 4, 5, 6]), 2)
    (whole,) = tree.root(b"").children.values()
    before = whole.last_access
    tokens = array("q", [1, 2, 9, 9])
    path, matched, made = tree.match(tokens, b"", tree.walk(tokens, b""))
    assert matched == 2 and path[0].last_access > before and whole.last_access == before


def test_device_slots_of_a_split_chain_are_its_nodes_slots_in_order():
    """A node split into one node per page, its tail evicted and loaded back into new
    slots: the match's device slots are still each node's own, in path order."""
    import torch

    from tests.support.cache_engine import PAGE, make_cache

    cache = make_cache(device_tokens=64, host_tokens=64, write_policy="write_through")
    tokens = list(range(100, 124))  # 6 pages
    cache.insert(tokens, cache.alloc_device(len(tokens)))
    for i in range(1, 6):  # a sibling after every page: the chain is split at every page boundary
        branch = tokens[:i * PAGE] + [900 + i] * PAGE
        slots = cache.alloc_device(len(branch))
        cache.free_device(slots[:cache.insert(branch, slots)])
    cache.flush()
    def expected(m):  # each node's pages, expanded to token slots by hand
        pages = [p for n in m.path if n.dev_pages is not None for p in n.dev_pages.tolist()]
        return torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)], dtype=torch.int64)

    match = cache.match_prefix(tokens)
    assert len(match.path) == 6 and torch.equal(match.device_indices, expected(match))
    for _ in range(2):  # the siblings go first, then the chain's last pages: host-only now
        cache.evict_device(3 * PAGE)
    got = cache.acquire(tokens)  # loads the chain's tail back into new slots
    try:
        match = cache.match_prefix(tokens)
        assert match.device_len == len(tokens) and torch.equal(match.device_indices, expected(match))
        assert torch.equal(got.device_indices, match.device_indices)
    finally:
        cache.release(got)
    cache.check_integrity()
    cache.close()


def test_device_slots_expand_the_same_on_an_accelerator():
    """With slot tensors on an accelerator the page numbers are expanded there (torch ops);
    run on the CPU, that branch must give the numpy expansion's slots."""
    import torch

    from tests.support.cache_engine import PAGE, make_cache

    cache = make_cache(device_tokens=64, host_tokens=64)
    tokens = list(range(100, 124))
    cache.insert(tokens, cache.alloc_device(len(tokens)))
    branch = tokens[:2 * PAGE] + [7] * PAGE
    slots = cache.alloc_device(len(branch))
    cache.free_device(slots[:cache.insert(branch, slots)])
    on_cpu = [cache.match_prefix(t).device_indices for t in (tokens, branch, [5] * PAGE)]
    cache._state._offsets = torch.arange(PAGE)  # the accelerator branch, run on the CPU
    elsewhere = [cache.match_prefix(t).device_indices for t in (tokens, branch, [5] * PAGE)]
    assert [t.tolist() for t in elsewhere] == [t.tolist() for t in on_cpu] and on_cpu[0].numel() == len(tokens)
    assert all(t.dtype == torch.int64 for t in elsewhere)
    cache.close()


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "numpy"])
def test_device_slots_of_a_path_over_several_allocations(native, monkeypatch):
    """A path whose nodes were inserted from separate allocations expands run by run: the
    match's slots are each node's own, in path order, on both paths; a run that is not
    contiguous int64 takes numpy's way and gives the same slots."""
    import torch

    from tests.support.cache_engine import PAGE, make_cache

    if not native:
        monkeypatch.setenv("KVTIER_NATIVE", "0")
    cache = make_cache(device_tokens=96, host_tokens=64)
    tokens = list(range(100, 100 + 6 * PAGE))
    for end in (PAGE, 3 * PAGE, 6 * PAGE):  # three inserts, each adding pages from its own allocation
        slots = cache.alloc_device(end)
        cache.free_device(slots[:cache.insert(tokens[:end], slots)])
    match = cache.match_prefix(tokens)
    nodes = [n for n in match.path if n.dev_pages is not None]
    assert len({id(n.device.base) for n in nodes}) == 3
    want = [p * PAGE + i for n in nodes for p in n.dev_pages.tolist() for i in range(PAGE)]
    assert match.device_indices.tolist() == want and match.device_indices.dtype == torch.int64
    odd = [n.dev_pages.astype(np.int32) for n in nodes]  # numpy's way, whatever the switch
    assert cache._state.slots_of(odd).tolist() == want
    assert cache._state.slots_of([]).numel() == 0
    cache.close()
