"""Least-recently-used order per tier without scanning the tree.

One heap per tier of ``(last_access, serial, seq, node)``: ties in ``last_access``
(a match stamps a whole path at once) go by the node's creation order, never by
which thread happened to push first, so replays evict in the same order. Entries go stale when a match
touches a node; a stale entry is pushed again with the node's current stamp when
it reaches the top, so the heap's minimum is always the true LRU node among the
entries. A node is pushed whenever it may have become evictable (created, split,
unlocked, a transfer settled, a child left the tier); an entry whose node is not
evictable when it surfaces is dropped. The cache rebuilds the index once the fullest
heap holds more than four entries a live node and 1,024 more (counted once the
index's running ``bound`` passes that), checked as nodes are
added and after every unlock (a stream of full hits adds no node, and evicts nothing).
"""

from __future__ import annotations

import heapq
import itertools
import sys
from typing import Callable, Iterable

from .sides import highest

TIERS = ("device", "host")
_heappush = heapq.heappush


def _has_side(copy, group: str) -> bool:
    """Whether ``copy`` (a node's device or host copy, or ``None``) holds a page of
    sliding group ``group``: never when it holds none of any group (most copies)."""
    return copy is not None and copy.held > 0 and highest(copy.side[group]) >= 0


def side_tier(tier: str, group: str) -> str:
    """The heap name of sliding group ``group``'s pages in ``tier`` (hybrid caches)."""
    return f"{tier}:{group}"


class LruIndex:
    """``sides``: the sliding groups of a hybrid cache, whose pages are evicted apart
    from the full pages (one heap per tier and group, ``side_tier``)."""

    def __init__(self, sides: tuple[str, ...] = ()) -> None:
        self._sides = sides
        self._heaps: dict[str, list] = {t: [] for t in TIERS}
        for g in sides:
            for t in TIERS:
                self._heaps[side_tier(t, g)] = []
        self._seq = itertools.count()
        #: at least the fullest heap's entries: a push adds at most one to each heap, and
        #: :meth:`longest` makes it exact (what the cache checks at every node added)
        self.bound = 0
        self._bind()

    def _bind(self) -> None:
        """Keep direct references to the heaps :meth:`push` fills (after any rebuild)."""
        self._device, self._host = self._heaps["device"], self._heaps["host"]
        self._side_heaps = {t: [(g, self._heaps[side_tier(t, g)]) for g in self._sides] for t in TIERS}
        # with one sliding group (every preset), its heap in each tier: a copy holding some
        # sliding page holds one of that group
        one = len(self._sides) == 1
        self._device_side = self._side_heaps["device"][0][1] if one else None
        self._host_side = self._side_heaps["host"][0][1] if one else None

    def __len__(self) -> int:
        return self.longest()

    def longest(self) -> int:
        """Entries of the fullest heap, stale ones included; :attr:`bound` becomes it."""
        self.bound = max(map(len, self._heaps.values()))
        return self.bound

    def push(self, node) -> None:
        """Index ``node`` in the heap of each tier it has a copy in (only such a node
        can be evicted from a tier, and every way of gaining a copy pushes it again)."""
        # NOTE: one entry shared by both heaps: entries are immutable, and a single
        # counter value keeps each heap's order exactly as with one value per heap
        # (values only need to grow with every push). A heap never gets a node that has
        # no copy in its tier: such entries would never surface there (a tier with no
        # evictions never pops), and would keep evicted nodes and their keys alive.
        entry = (node.last_access, node.serial, next(self._seq), node)
        self.bound += 1
        device, host = node.device, node.host
        if device is not None:
            _heappush(self._device, entry)
            if device.held:
                if self._device_side is not None:
                    _heappush(self._device_side, entry)
                else:
                    self._push_sides(entry, device, self._side_heaps["device"])
        if host is not None:
            _heappush(self._host, entry)
            if host.held:
                if self._host_side is not None:
                    _heappush(self._host_side, entry)
                else:
                    self._push_sides(entry, host, self._side_heaps["host"])

    @staticmethod
    def _push_sides(entry, copy, heaps) -> None:
        """``entry`` into the heap of each sliding group that ``copy`` (which holds some
        sliding page) holds a page of."""
        for g, heap in heaps:
            if highest(copy.side[g]) >= 0:
                _heappush(heap, entry)

    def pop(self, tier: str, evictable: Callable[[object], bool]):
        """The least recently used node that ``evictable`` accepts, taken out of the
        index; ``None`` when there is none."""
        heap = self._heaps[tier]
        while heap:
            stamp, _, _, node = heap[0]
            if not evictable(node):
                heapq.heappop(heap)
            elif node.last_access != stamp:
                heapq.heapreplace(heap, (node.last_access, node.serial, next(self._seq), node))
            else:
                heapq.heappop(heap)
                return node
        return None

    def rebuild(self, nodes: Iterable, sides_only: bool = False) -> None:
        """Drop every entry and index ``nodes`` afresh (compaction); ``sides_only``: only
        the sliding groups' heaps (the others pop at every eviction of their tier)."""
        if sides_only:
            entries = [(n.last_access, n.serial, next(self._seq), n) for n in nodes
                       if (n.device is not None and n.device.held) or (n.host is not None and n.host.held)]
        else:
            entries = [(n.last_access, n.serial, next(self._seq), n) for n in nodes]
            self._heaps["device"] = [e for e in entries if e[-1].device is not None]
            self._heaps["host"] = [e for e in entries if e[-1].host is not None]
        for g in self._sides:
            for t in TIERS:
                self._heaps[side_tier(t, g)] = [e for e in entries if _has_side(getattr(e[-1], t), g)]
        for name, heap in self._heaps.items():
            if not sides_only or name not in TIERS:
                heapq.heapify(heap)
        self._bind()
        self.longest()

    def memory_bytes(self) -> int:
        """Host bytes of the heaps and their entries (an entry two heaps share counted
        once; the nodes are the tree's)."""
        entries = {id(e): e for heap in self._heaps.values() for e in heap}
        return (sys.getsizeof(self._heaps) + sum(map(sys.getsizeof, self._heaps.values()))
                + sum(map(sys.getsizeof, entries.values())))

    def contains(self, tier: str, node) -> bool:
        """Whether ``node`` has an entry in ``tier`` (integrity checks only: a scan)."""
        return any(entry[-1] is node for entry in self._heaps[tier])
