"""Least-recently-used order per tier without scanning the tree.

One heap per tier of ``(last_access, serial, seq, node)``: ties in ``last_access``
(a match stamps a whole path at once) go by the node's creation order, never by
which thread happened to push first, so replays evict in the same order. Entries go stale when a match
touches a node; a stale entry is pushed again with the node's current stamp when
it reaches the top, so the heap's minimum is always the true LRU node among the
entries. A node is pushed whenever it may have become evictable (created, split,
unlocked, a transfer settled, a child left the tier); an entry whose node is not
evictable when it surfaces is dropped.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable

TIERS = ("device", "host")
_heappush = heapq.heappush


class LruIndex:
    def __init__(self) -> None:
        self._heaps: dict[str, list] = {t: [] for t in TIERS}
        self._heap_list = list(self._heaps.values())
        self._seq = itertools.count()

    def __len__(self) -> int:
        return max(len(h) for h in self._heaps.values())

    def push(self, node) -> None:
        # NOTE: one entry shared by both heaps: entries are immutable, and a single
        # counter value keeps each heap's order exactly as with one value per heap
        # (values only need to grow with every push).
        entry = (node.last_access, node.serial, next(self._seq), node)
        for heap in self._heap_list:
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

    def rebuild(self, nodes: Iterable) -> None:
        """Drop every entry and index ``nodes`` afresh (compaction)."""
        entries = [(n.last_access, n.serial, next(self._seq), n) for n in nodes]
        for tier in TIERS:
            self._heaps[tier] = list(entries)
            heapq.heapify(self._heaps[tier])
        self._heap_list = list(self._heaps.values())

    def contains(self, tier: str, node) -> bool:
        """Whether ``node`` has an entry in ``tier`` (integrity checks only: a scan)."""
        return any(entry[-1] is node for entry in self._heaps[tier])
