"""``LruIndex`` alone: per-tier least-recently-used order, lazy stale entries, rebuild.

The nodes are real :class:`~kvtier.cache.radix.Node` objects (the index reads
``last_access``, ``serial``, ``device`` and ``host``), detached from any tree: the
index never walks the tree, so one-page nodes with a tier copy set by hand are all
it needs. Their ``last_access`` is set explicitly, so that the order under test does
not depend on the global logical clock other tests advance.

The index's contract, as ``CacheState`` uses it: ``pop`` returns the entry with the
smallest ``(last_access, serial)``; an entry whose node was touched since its push
is pushed again with the node's current stamp when it surfaces; an entry whose node
``evictable`` refuses is dropped (the node stays as it is, and is offered again by
the next ``push``). Duplicate entries are filtered only by ``evictable``: the caller
takes the node out of the tier after a pop, and a stale entry for it is then refused.
"""

from __future__ import annotations

from array import array

import numpy as np
import torch

from kvtier.cache.lru import LruIndex, side_tier
from kvtier.cache.radix import Node
from kvtier.cache.residency import DeviceCopy, HostCopy


def node(name: int, stamp: int, device: bool = True, host: bool = False) -> Node:
    """A detached one-page node whose only token id is ``name`` (to tell nodes apart)."""
    n = Node(array("q", [name]), None)
    n.last_access = stamp
    if device:
        n.device = DeviceCopy(np.array([name], dtype=np.int64))
    if host:
        n.host = HostCopy(torch.tensor([name], dtype=torch.int64))
    return n


def name(n: Node | None) -> int | None:
    return None if n is None else n.key[0]


def always(_node) -> bool:
    return True


def on_device(n: Node) -> bool:
    """What ``CacheState._device_evictable`` asks first: a device copy."""
    return n.device is not None


def drain(lru: LruIndex, tier: str, evictable=always, evict: bool = False) -> list[int]:
    """Pop until empty; with ``evict``, take each popped node out of ``tier`` as
    ``CacheState.evict`` does."""
    out = []
    while (n := lru.pop(tier, evictable)) is not None:
        out.append(name(n))
        if evict:
            setattr(n, tier, None)
    return out


def test_pops_least_recently_used_first():
    lru = LruIndex()
    for n in (node(3, 30), node(1, 10), node(4, 40), node(2, 20)):
        lru.push(n)
    assert drain(lru, "device") == [1, 2, 3, 4]
    assert len(lru) == 0


def test_ties_go_by_creation_order_not_push_order():
    # a match stamps a whole path at once: equal stamps must pop the same way in every replay
    first, second, third = node(1, 5), node(2, 5), node(3, 5)
    assert first.serial < second.serial < third.serial
    lru = LruIndex()
    for n in (third, first, second):
        lru.push(n)
    assert drain(lru, "device") == [1, 2, 3]


def test_each_tier_has_its_own_order():
    lru = LruIndex()
    dev_only, both, host_only = node(1, 10), node(2, 20, host=True), node(3, 5, device=False, host=True)
    for n in (both, host_only, dev_only):
        lru.push(n)
    assert [lru.contains("device", n) for n in (dev_only, both, host_only)] == [True, True, False]
    assert [lru.contains("host", n) for n in (dev_only, both, host_only)] == [False, True, True]
    assert drain(lru, "host") == [3, 2]
    assert drain(lru, "device") == [1, 2]  # popping the host tier left the device entries alone


def test_a_touched_node_moves_to_most_recent():
    lru = LruIndex()
    a, b, c = node(1, 10), node(2, 20), node(3, 30)
    for n in (a, b, c):
        lru.push(n)
    a.last_access = 40  # a match touched it: its entry (stamp 10) is stale, not re-pushed
    assert name(lru.pop("device", always)) == 2
    lru.push(a)  # pushing it as well changes nothing: the same order, and no second pop of it
    assert drain(lru, "device", on_device, evict=True) == [3, 1]


def test_pushing_again_without_a_touch_keeps_the_place():
    lru = LruIndex()
    a, b = node(1, 10), node(2, 20)
    lru.push(a)
    lru.push(b)
    lru.push(a)  # e.g. unlocked, or a transfer settled: same stamp, so still the oldest
    assert drain(lru, "device", on_device, evict=True) == [1, 2]


def test_a_refused_node_is_skipped_and_its_entry_dropped():
    lru = LruIndex()
    a, b, c = node(1, 10), node(2, 20), node(3, 30)
    for n in (a, b, c):
        lru.push(n)
    locked = {1}
    assert name(lru.pop("device", lambda n: name(n) not in locked)) == 2
    # the refused node is untouched, but no longer indexed: whatever makes it
    # evictable again (an unlock) pushes it, as CacheState.unlock_node does
    assert a.device is not None and not lru.contains("device", a)
    assert lru.contains("device", c)
    lru.push(a)
    assert drain(lru, "device", on_device, evict=True) == [1, 3]


def test_a_stale_entry_is_not_returned_after_its_node_left_the_tier():
    lru = LruIndex()
    a, b = node(1, 10), node(2, 20)
    lru.push(a)
    lru.push(b)
    lru.push(a)  # two entries for a
    got = lru.pop("device", on_device)
    assert got is a
    a.device = None  # evicted: the second entry must not surface again
    assert drain(lru, "device", on_device) == [2]
    assert not lru.contains("device", a)


def test_dropping_duplicates_is_the_predicates_job():
    # NOTE: the index keeps no per-node state: a node pushed twice and still accepted
    # by ``evictable`` comes back twice. CacheState relies on every pop being followed
    # by the node leaving the tier (or gaining a backup mark), which its predicates refuse.
    lru = LruIndex()
    a = node(1, 10)
    lru.push(a)
    lru.push(a)
    assert drain(lru, "device") == [1, 1]


def test_a_node_that_lost_its_host_copy_is_not_popped_from_the_host():
    lru = LruIndex()
    a, b = node(1, 10, host=True), node(2, 20, host=True)
    lru.push(a)
    lru.push(b)
    a.host = None
    assert drain(lru, "host", lambda n: n.host is not None) == [2]
    assert drain(lru, "device") == [1, 2]  # its device entry is untouched


def test_rebuild_gives_the_order_of_the_original_pushes():
    stamps = [50, 10, 30, 10, 40, 20]
    nodes = [node(i, s, host=i % 2 == 0) for i, s in enumerate(stamps)]
    pushed, rebuilt = LruIndex(), LruIndex()
    for n in nodes:
        pushed.push(n)
        pushed.push(n)  # stale duplicates: what rebuild compacts
    rebuilt.rebuild(reversed(nodes))
    assert len(pushed) == 2 * len(nodes) and len(rebuilt) == len(nodes)
    for tier in ("device", "host"):
        assert all(rebuilt.contains(tier, n) == (getattr(n, tier) is not None) for n in nodes)
    want_device = [1, 3, 5, 2, 4, 0]  # stamps 10 (serials 1 < 3), 20, 30, 40, 50
    assert drain(pushed, "device") == [i for i in want_device for _ in range(2)]  # an entry per push
    assert drain(rebuilt, "device") == want_device
    assert drain(rebuilt, "host") == [2, 4, 0]


def test_the_bound_never_falls_below_the_fullest_heap():
    # the cache counts the heaps only once the bound passes its limit: a bound under the
    # true count would let stale entries pile up unseen
    rng = np.random.default_rng(3)
    nodes = [node(i, int(s), host=bool(h)) for i, (s, h) in enumerate(zip(rng.integers(0, 50, 40),
                                                                          rng.integers(0, 2, 40)))]
    lru = LruIndex()
    for step in range(400):
        op = rng.integers(0, 8)
        if op < 5:
            lru.push(nodes[rng.integers(0, len(nodes))])
        elif op < 7:
            lru.pop("device" if op == 5 else "host", lambda n: True)
        elif rng.integers(0, 4) == 0:
            lru.rebuild(nodes[:int(rng.integers(0, len(nodes)))])
        fullest = max(len(lru._heaps["device"]), len(lru._heaps["host"]))
        assert lru.bound >= fullest, step
    assert lru.longest() == lru.bound == fullest


def test_rebuild_forgets_nodes_not_given():
    lru = LruIndex()
    kept, gone = node(1, 10), node(2, 5)
    lru.push(kept)
    lru.push(gone)
    lru.rebuild([kept])
    assert not lru.contains("device", gone)
    assert drain(lru, "device") == [1]


def test_sliding_pages_have_a_heap_per_tier_and_group():
    lru = LruIndex(sides=("swa", "swb"))
    held, hole = node(1, 10, host=True), node(2, 5)
    held.device.side, held.device.held = {"swa": np.array([7], dtype=np.int64), "swb": np.array([-1])}, 1
    hole.device.side = {"swa": np.array([-1], dtype=np.int64), "swb": np.array([-1])}  # no sliding page here
    held.host.side, held.host.held = {"swa": np.array([-1], dtype=np.int64), "swb": np.array([3])}, 1
    lru.push(held)
    lru.push(hole)
    swa = side_tier("device", "swa")
    assert swa == "device:swa"
    assert lru.contains(swa, held) and not lru.contains(swa, hole)
    assert not lru.contains("device:swb", held)  # the copy holds a page, but of the other group
    assert lru.contains("host:swb", held) and not lru.contains("host:swa", held)
    assert drain(lru, swa) == [1]
    assert drain(lru, "device") == [2, 1]
    lru.rebuild([held, hole])
    assert lru.contains(swa, held) and not lru.contains(swa, hole)
    assert lru.contains("host:swb", held) and not lru.contains("device:swb", held)
    lru.push(held)  # pushes after a rebuild reach the rebuilt heaps
    assert drain(lru, "host:swb") == [1, 1]


def test_one_sliding_group_takes_every_copy_that_holds_a_sliding_page():
    lru = LruIndex(sides=("swa",))
    held, none = node(1, 10, host=True), node(2, 5, host=True)
    held.device.side, held.device.held = {"swa": np.array([-1, 4], dtype=np.int64)}, 1
    held.host.side, held.host.held = {"swa": np.array([-1, -1], dtype=np.int64)}, 0
    none.device.side = {"swa": np.array([-1], dtype=np.int64)}
    lru.push(held)
    lru.push(none)
    assert drain(lru, "device:swa") == [1]
    assert drain(lru, "host:swa") == []
    assert drain(lru, "device") == [2, 1]


def test_a_rebuild_of_the_sliding_heaps_alone_keeps_the_others():
    lru = LruIndex(sides=("swa",))
    held, plain = node(1, 10), node(2, 5)
    held.device.side, held.device.held = {"swa": np.array([4], dtype=np.int64)}, 1
    plain.device.side = {"swa": np.array([-1], dtype=np.int64)}
    lru.push(held)
    lru.push(plain)
    lru.push(plain)  # a duplicate in the device heap
    gone = node(3, 1)
    gone.device.side, gone.device.held = {"swa": np.array([5], dtype=np.int64)}, 1
    lru.push(gone)  # then removed from the tree: its entries are dead
    lru.rebuild([held, plain], sides_only=True)
    assert drain(lru, "device:swa") == [1]  # the dead entry is gone
    assert drain(lru, "device") == [3, 2, 2, 1]  # as pushed (pop drops what its caller refuses)
