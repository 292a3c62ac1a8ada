"""Allocation and LRU eviction per tier. A mixin of ``HierarchicalCache``."""

from __future__ import annotations

import heapq

import torch

from .radix import Node


class Eviction:
    def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Device slots for new KV (whole pages), evicting unlocked cached pages (LRU)
        as needed; ``None`` if even that leaves too few."""
        with self._lock:
            slots = self._alloc_device(num_tokens)
        if slots is None:
            self._stats.add(device_alloc_failures=1)
        return slots

    def free_device(self, indices: torch.Tensor) -> None:
        """Return slots the caller owns (e.g. duplicates reported by :meth:`insert`)."""
        with self._lock:
            self.allocator.free(indices)

    # -- eviction ------------------------------------------------------------------------------------------
    def evict_device(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots (least recently used first), if
        unlocked pages allow; a page with a host copy is demoted, not lost."""
        with self._lock:
            return self._evict("device", num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        with self._lock:
            return self._evict("host", num_tokens)

    def _evictable(self, node: Node, tier: str) -> bool:
        if node.lock_ref or node.loading is not None or getattr(node, tier) is None:
            return False
        if tier == "device":  # device copies are prefix-closed: children first
            return all(c.device is None for c in node.children.values())
        return node.device is not None or not node.children  # a host-only node goes with its leaf

    def _evict(self, tier: str, num_tokens: int) -> int:
        heap = [(n.last_access, id(n), n) for n in self.tree.nodes() if self._evictable(n, tier)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._evictable(node, tier):
                continue
            if tier == "device":
                if node.host is None and (self.write_policy == "write_back" or node.children):
                    self._backup(node)
                if node.host is None and node.children:
                    continue  # cannot drop a page that host-only children hang from
                self.allocator.free(node.device)
                node.device = None
            else:
                self.host_pool.free(node.host)
                node.host = None
            freed += len(node.key)
            self._stats.evicted(tier, len(node.key))
            parent = node.parent
            if node.device is None and node.host is None:
                self.tree.remove(node)
            if parent.parent is not None and self._evictable(parent, tier):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _alloc(self, tier: str, n: int) -> torch.Tensor | None:
        """``n`` slots of ``tier``, evicting that tier's LRU unlocked pages if it is full."""
        pool = self.allocator if tier == "device" else self.host_pool
        slots = pool.alloc(n)
        if slots is None:
            self._evict(tier, n - pool.available_size())
            slots = pool.alloc(n)
        return slots

    def _alloc_device(self, n: int) -> torch.Tensor | None:
        return self._alloc("device", n)

    def _alloc_host(self, n: int) -> torch.Tensor | None:
        return self._alloc("host", n)
