"""``CacheState`` driven directly, with no ``HierarchicalCache`` around it and no
worker threads (``tests.support.cache_state_rig``): inserting, matching, locks,
eviction order, and the device <-> host transitions, each checked by the exact
slots and nodes involved and by ``check_integrity`` after every step.

Backups and loads are started by the state and run here the way ``Mover`` runs
them (the copy, then ``finish_backup`` / ``finish_load`` under the lock). Storage
writes and prefetches need the mover's storage guard: they stay with the
``HierarchicalCache`` tests (``test_storage_tier.py``, ``test_threads.py``).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.cache.tokens import token_array
from tests.support.cache_engine import SPEC
from tests.support.cache_state_rig import StateRig, fill, read, run, same

A = run(100, 2)                # 2 pages
B = run(200, 2)
C = run(300, 2)
X = run(500, 1)                # a page to extend A with


def cache_extension(rig: StateRig, prefix_slots: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Insert ``tokens`` (cached ``prefix_slots``, then one new page); returns its slots."""
    new = rig.alloc(len(tokens) - prefix_slots.numel())
    got = rig.insert(tokens, torch.cat([prefix_slots, new]))
    assert got == (prefix_slots.numel(), new.numel()), got
    return new


def test_insert_makes_nodes_that_own_the_slots():
    rig = StateRig()
    a3 = run(100, 3)
    slots = rig.alloc(12)
    assert slots.tolist() == list(range(12))  # a fresh pool hands out its lowest pages first
    assert rig.insert(a3, slots) == (0, 12)
    node = rig.node(a3)
    assert node.key.tolist() == a3 and node.device.pages.tolist() == [0, 1, 2] and node.host is None
    assert rig.state.owned(slots).tolist() == [True, True, True]
    assert rig.state.owned(torch.arange(12, 24)).tolist() == [False, False, False]
    rig.check()

    shares_two = a3[:8] + run(300, 1)
    mine = rig.alloc(12)  # pages 3, 4, 5: the engine computed the shared pages again
    assert rig.insert(shares_two, mine) == (8, 4)
    assert rig.keys() == sorted([a3[:8], a3[8:], shares_two[8:]])  # the first node split at the fork
    assert rig.node(a3[:8]).device.pages.tolist() == [0, 1]
    assert rig.node(a3).device.pages.tolist() == [2]
    assert rig.node(shares_two).device.pages.tolist() == [5]
    rig.check(engine_device_slots=8)  # pages 3 and 4 are duplicates, still the engine's
    rig.device.free(mine[:8])
    rig.check(engine_device_slots=0)


def test_inserting_the_cached_slots_again_adds_nothing():
    rig = StateRig()
    slots = rig.cache(A)
    assert rig.insert(A, slots) == (8, 0)
    assert rig.keys() == [A]
    rig.check()


def test_insert_refuses_slots_it_may_not_adopt():
    rig = StateRig()
    slots = rig.cache(A)
    with pytest.raises(ValueError, match=r"device slot 0 \(page 0 of the prompt\) already holds another cached"):
        rig.insert(B, slots)
    with pytest.raises(ValueError, match="device slot 8 is not allocated"):
        rig.insert(B, torch.arange(8, 16))
    assert rig.keys() == [A]  # checked before anything moved
    assert rig.node(A).device.pages.tolist() == [0, 1]
    rig.check()


def test_match_finds_the_longest_prefix_in_whole_pages():
    rig = StateRig()
    a3 = run(100, 3)
    slots = rig.cache(a3)
    path, device_len, host_len = rig.match(a3[:10])  # 2.5 pages: the half page does not count
    assert (device_len, host_len) == (8, 0)
    assert [n.key.tolist() for n in path] == [a3[:8]]  # the node split where the match ended
    assert rig.state.device_slots(path).tolist() == slots[:8].tolist()
    assert rig.match(a3[:6] + [999, 999])[1] == 4  # diverges inside the second page
    assert rig.match(a3 + X)[1:] == (12, 0)
    assert rig.match([999] + a3[1:]) == ([], 0, 0)
    assert rig.match(a3, salt=b"another tenant") == ([], 0, 0)
    assert rig.keys() == sorted([a3[:4], a3[4:8], a3[8:]])
    assert rig.state.device_slots(rig.match(a3)[0]).tolist() == slots.tolist()
    rig.check()


def test_a_miss_gets_a_new_empty_slot_tensor_each_time():
    """A miss's device slots (and, hybrid, its groups': ``test_hybrid_cache``) are an
    empty int64 tensor on the index device, never one shared between results: a caller
    may resize its own."""
    rig = StateRig()
    rig.cache(run(100, 3))
    first, second = (rig.state.device_slots(rig.match([999] * 8)[0]) for _ in range(2))
    for got in (first, second):
        assert got.dtype == torch.int64 and got.shape == (0,) and got.device == rig.state._no_slots.device
    first.resize_(4).fill_(7)
    assert second.shape == (0,) and rig.state.device_slots([]).shape == (0,)
    rig.check()


def test_eviction_under_pressure_frees_the_least_recently_used_slots():
    rig = StateRig(device_tokens=24)
    slots = {"A": rig.cache(A), "B": rig.cache(B), "C": rig.cache(C)}
    assert rig.free_pages() == 0
    rig.match(A)  # touched: the order is now B, C, A
    assert rig.alloc(8).tolist() == slots["B"].tolist()
    assert rig.keys() == sorted([A, C])
    rig.check(engine_device_slots=8)
    # half a node: it is split, and its tail (the least useful part of a prefix) goes
    assert rig.alloc(4).tolist() == slots["C"][4:].tolist()
    assert rig.keys() == sorted([A, C[:4]])
    assert rig.node(C[:4]).device.pages.tolist() == [int(slots["C"][0]) // 4]
    assert rig.stats.snapshot()["device_evicted_tokens"] == 12
    rig.check(engine_device_slots=12)


def test_a_locked_node_is_never_evicted():
    rig = StateRig(device_tokens=24)
    sa, sb, sc = rig.cache(A), rig.cache(B), rig.cache(C)
    a, b = rig.node(A), rig.node(B)
    with rig.state.lock:
        rig.state.lock_node(a)
        rig.state.lock_node(b)
    assert rig.alloc(8).tolist() == sc.tolist()  # A and B are older, but locked
    assert rig.alloc(4) is None
    assert rig.state.owned(torch.cat([sa, sb])).all()
    assert rig.keys() == sorted([A, B])
    rig.check(engine_device_slots=8)
    with rig.state.lock:
        rig.state.unlock_node(a)  # offered to the LRU index again
    assert rig.alloc(4).tolist() == sa[4:].tolist()
    assert rig.node(B).lock_ref == 1 and rig.state.owned(sb).all()
    rig.check(engine_device_slots=12)


def test_a_lock_counts_on_the_whole_path_and_a_bad_unlock_moves_nothing():
    rig = StateRig()
    cache_extension(rig, rig.cache(A), A + X)
    a, x = rig.node(A), rig.node(A + X)
    root = a.parent

    def counts():
        return x.lock_ref, a.lock_ref, root.lock_ref

    assert counts() == (0, 0, 1)  # a root holds one lock of its own: it is never evicted
    with rig.state.lock:
        rig.state.lock_node(x)
        assert counts() == (1, 1, 2)
        rig.state.unlock_node(x)
        assert counts() == (0, 0, 1)
        with pytest.raises((RuntimeError, ValueError), match="unlock without a matching lock"):
            rig.state.unlock_node(x)
        assert counts() == (0, 0, 1)
        rig.state.lock_node(a)  # the parent alone: unlocking the child is refused before any count moves
        with pytest.raises((RuntimeError, ValueError), match="unlock without a matching lock"):
            rig.state.unlock_node(x)
        assert counts() == (0, 1, 2)
        rig.state.unlock_node(a)
    rig.check()


def test_a_child_leaves_the_device_before_its_parent():
    rig = StateRig(device_tokens=12)
    sa = rig.cache(A)
    sx = cache_extension(rig, sa, A + X)
    assert rig.node(A).last_access < rig.node(A + X).last_access  # the parent is the LRU one
    assert rig.alloc(4).tolist() == sx.tolist()
    assert rig.keys() == [A]
    rig.check(engine_device_slots=4)
    assert rig.alloc(4).tolist() == sa[4:].tolist()  # re-offered once its child went
    assert rig.keys() == [A[:4]]
    rig.check(engine_device_slots=8)


def test_a_slot_is_returned_to_the_allocator_once():
    rig = StateRig()
    sa = rig.cache(A)
    assert rig.state.owned(sa).all()  # what HierarchicalCache.free_device refuses to free
    with rig.state.lock:
        assert rig.state.evict("device", 8) == 8
    assert not rig.state.owned(sa).any() and rig.keys() == []
    free = rig.device.available_size()
    assert free == rig.device.size
    with pytest.raises((RuntimeError, ValueError), match="double free"):
        rig.state.allocator.free(sa)
    assert rig.device.available_size() == free
    rig.check()


def test_a_backup_makes_the_node_host_resident_and_a_load_brings_it_back():
    rig = StateRig()
    a3 = run(100, 3)
    sa = rig.cache(a3)
    kv = fill(rig.device, sa, seed=1)
    node = rig.node(a3)
    with rig.state.lock:
        assert rig.state.begin_backup(node)
    [mark] = rig.take("backup")
    host_slots = node.host.slots.tolist()
    assert len(host_slots) == 12 and mark.host.tolist() == host_slots and mark.device.tolist() == sa.tolist()
    assert node.backup is mark and rig.state.backups == {mark} and not node.host_ready
    rig.check()
    with rig.state.lock:
        assert rig.state.evict("device", 12) == 0  # the device copy is being read
    assert node.device is not None

    rig.run_backup(mark)
    assert node.host_ready and mark.done.is_set() and not rig.state.backups
    assert rig.stats.snapshot()["backed_up_tokens"] == 12
    with rig.state.lock:
        rig.state.finish_backup(mark, ok=True)  # settled twice: the mark is off every node, nothing moves
    assert node.host.slots.tolist() == host_slots and rig.stats.snapshot()["backed_up_tokens"] == 12
    rig.check()

    with rig.state.lock:
        assert rig.state.evict("device", 12) == 12
    assert node.device is None and node.host.slots.tolist() == host_slots and rig.keys() == [a3]
    assert rig.device.available_size() == rig.device.size
    path, device_len, host_len = rig.match(a3)
    assert path == [node] and (device_len, host_len) == (0, 12)  # a host hit
    rig.check()

    for name in SPEC.names:  # the device pages the KV came from are gone: only the host has it
        for layer in range(SPEC.layer_num):
            rig.device.buffer(name, layer).zero_()
    with rig.state.lock:
        handle, load = rig.state.begin_load(path, SPEC.layer_num)
    assert load is not None and node.loading is load and load.nodes == [node]
    assert handle.device_indices.tolist() == rig.device_slots(node) == list(range(12, 24))  # the ring's oldest
    rig.check(engine_device_slots=0)
    rig.run_load(load)
    assert node.loading is None and node.lock_ref == 0 and node.host_ready
    assert same(read(rig.device, handle.device_indices), kv)
    assert rig.match(a3)[1:] == (12, 0)
    assert rig.stats.snapshot()["loaded_tokens"] == 12
    rig.check()


def test_a_failed_backup_gives_the_host_slots_back():
    rig = StateRig()
    sa = rig.cache(A)
    node = rig.node(A)
    with rig.state.lock:
        assert rig.state.begin_backup(node)
    [mark] = rig.take("backup")
    assert rig.host.available_size() == rig.host.size - 8
    rig.run_backup(mark, ok=False)
    assert node.host is None and node.device.pages.tolist() == (sa[::4] // 4).tolist()
    assert rig.host.available_size() == rig.host.size and not rig.state.backups
    assert rig.stats.snapshot()["backup_errors"] == 1
    rig.check()  # evictable again, so indexed again
    with rig.state.lock:
        assert rig.state.evict("device", 8) == 8
    assert rig.keys() == []
    rig.check()


def test_a_failed_load_leaves_the_node_host_only():
    rig = StateRig()
    rig.cache(A)
    node = rig.node(A)
    with rig.state.lock:
        rig.state.begin_backup(node)
    rig.run_backup(rig.take("backup")[0])
    with rig.state.lock:
        rig.state.evict("device", 8)
        _, load = rig.state.begin_load(rig.match(A)[0], SPEC.layer_num)
        assert node.lock_ref == 1  # the load pins its path
        rig.state.fail_load(load)
    assert node.device is None and node.host_ready and node.lock_ref == 0 and load.done.is_set()
    assert rig.device.available_size() == rig.device.size
    assert rig.stats.snapshot()["load_errors"] == 1
    assert rig.match(A)[1:] == (0, 8)
    rig.check()


def test_write_back_evicts_a_page_only_once_its_host_copy_landed():
    rig = StateRig(write_policy="write_back")
    sa = rig.cache(A)
    assert rig.scheduled == []  # write_back backs up on eviction, not on insert
    node = rig.node(A)
    with rig.state.lock:
        assert rig.state.evict("device", 8) == 0
    [mark] = rig.take("backup")
    assert mark.device.tolist() == sa.tolist() and node.backup is mark and node.device is not None
    rig.check()
    rig.run_backup(mark)
    with rig.state.lock:
        assert rig.state.evict("device", 8) == 8  # what HierarchicalCache._evict retries after waiting
    assert node.device is None and node.host_ready
    assert rig.match(A)[1:] == (0, 8)
    rig.check()


def test_write_through_backs_up_each_new_node_once():
    rig = StateRig(write_policy="write_through")
    sa = rig.cache(A)
    [first] = rig.take("backup")
    assert first.nodes == [rig.node(A)] and first.device.tolist() == sa.tolist()
    sx = cache_extension(rig, sa, A + X)
    [second] = rig.take("backup")  # A's copy is already on its way: only the new page
    assert second.nodes == [rig.node(A + X)] and second.device.tolist() == sx.tolist()
    rig.check()
    for mark in (first, second):
        rig.run_backup(mark)
    assert rig.node(A).host_ready and rig.node(A + X).host_ready
    rig.check()


def test_a_host_only_parent_leaves_the_host_after_its_child():
    rig = StateRig(device_tokens=24, host_tokens=12)
    sa = rig.cache(A)
    cache_extension(rig, sa, A + X)
    a, x = rig.node(A), rig.node(A + X)
    with rig.state.lock:
        assert rig.state.begin_backup(a) and rig.state.begin_backup(x)
    for mark in rig.take("backup"):
        rig.run_backup(mark)
    with rig.state.lock:
        assert rig.state.evict("device", 12) == 12
    assert a.device is None and x.device is None and rig.host.available_size() == 0
    rig.check()
    x_slots = x.host.slots.tolist()
    with rig.state.lock:
        got = rig.state.alloc("host", 4)
    assert got.tolist() == x_slots  # the older parent waits for its leaf
    assert rig.keys() == [A] and rig.match(A + X)[1:] == (0, 8)
    assert rig.stats.snapshot()["host_evicted_tokens"] == 4
    rig.host.free(got)
    rig.check()


def test_the_integrity_check_finds_an_evictable_node_missing_from_the_lru():
    rig = StateRig()
    rig.cache(A)
    rig.check()
    rig.state.lru.rebuild([])
    with pytest.raises((RuntimeError, ValueError), match="evictable but not in the device LRU"):
        rig.check()
    rig.state.lru.rebuild(rig.state.tree.nodes())
    rig.check()


def _tree_with_every_kind_of_path() -> tuple[StateRig, list[int]]:
    """A device node (a3 = A + a page), its child on the device (a3 + X), and a
    host-only node (B, backed up then evicted from the device); ``a3``."""
    rig = StateRig(device_tokens=40, host_tokens=24)
    a3 = run(100, 3)
    rig.cache(B)
    node = rig.node(B)
    with rig.state.lock:
        assert rig.state.begin_backup(node)
    [mark] = rig.take("backup")
    rig.run_backup(mark)
    with rig.state.lock:
        assert rig.state.evict("device", 8) == 8
    assert node.device is None and node.host_ready
    sa = rig.cache(a3)
    cache_extension(rig, sa, a3 + X)
    rig.check()
    return rig, a3


def _lru_order(rig: StateRig) -> list[list[int]]:
    return [n.key.tolist() for n in sorted(rig.state.tree.nodes(), key=lambda n: (n.last_access, n.key.tolist()))]


@pytest.mark.parametrize("query", ["whole node", "node and child", "inside a node", "half a page", "host only",
                                   "past the tree", "no match", "other tenant"])
def test_match_slots_is_match_then_device_slots(query):
    """The uniform full hit's short route (``match_slots``) and the general one give the
    same path, lengths and slots, and leave the same tree (splits) and LRU order."""
    got = []
    for route in ("match_slots", "match"):
        rig, a3 = _tree_with_every_kind_of_path()
        tokens, salt = {"whole node": (a3, b""), "node and child": (a3 + X, b""), "inside a node": (a3[:8], b""),
                        "half a page": (a3 + X[:2], b""), "host only": (B, b""), "past the tree": (a3 + X + C, b""),
                        "no match": (C, b""), "other tenant": (a3, b"t")}[query]
        with rig.state.lock:
            if route == "match_slots":
                path, device_len, host_len, slots = rig.state.match_slots(token_array(tokens), salt)
            else:
                path, device_len, host_len = rig.state.match(token_array(tokens), salt)
                slots = rig.state.device_slots(path)
        rig.check()
        got.append(([n.key.tolist() for n in path], device_len, host_len, slots.tolist(), rig.keys(), _lru_order(rig)))
    assert got[0] == got[1]
    path, device_len, host_len, slots = got[0][:4]
    assert len(slots) == device_len and device_len + host_len == sum(len(k) for k in path)
