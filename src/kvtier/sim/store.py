"""A metadata-only L3 store for the simulator: which page keys it holds, in LRU order."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..storage.base import Storage


class SimStorage(Storage):
    """Capacity in pages (``None``: unlimited); ``batch_set`` evicts least recently used keys."""

    scheme = "sim"

    def __init__(self, capacity_pages: int | None = None, **options) -> None:
        super().__init__(**options)
        self.capacity_pages = capacity_pages
        # NOTE: only a bounded store needs the LRU order; an unbounded one keeps a plain dict
        # (its update takes a fraction of an OrderedDict's, which links every key it adds)
        self._keys: dict[str, None] = OrderedDict() if capacity_pages is not None else {}
        self._lock = threading.Lock()

    def batch_exists(self, keys) -> int:
        with self._lock:
            return next((i for i, k in enumerate(keys) if k not in self._keys), len(keys))

    def exists_each(self, keys) -> list[bool]:
        with self._lock:
            return [k in self._keys for k in keys]

    # NOTE: without a capacity nothing is ever evicted, so the LRU order is not kept up
    # (a replay with unlimited storage writes and reads every stored page).
    def batch_get(self, keys, host_pool, host_indices) -> list[bool]:
        with self._lock:
            held = self._keys
            out = [k in held for k in keys]
            if self.capacity_pages is not None:
                for k, hit in zip(keys, out):
                    if hit:
                        held.move_to_end(k)
        hits = sum(out)
        self._stats.add(hits=hits, misses=len(out) - hits)
        return out

    def batch_set(self, keys, host_pool, host_indices) -> list[bool]:
        with self._lock:
            held = self._keys
            if self.capacity_pages is None:
                held.update(dict.fromkeys(keys))
            else:
                for k in keys:
                    held[k] = None
                    held.move_to_end(k)
            evicted = 0
            while self.capacity_pages is not None and len(held) > self.capacity_pages:
                held.popitem(last=False)
                evicted += 1
        self._stats.add(pages_written=len(keys), evictions=evicted)
        return [True] * len(keys)

    def delete(self, keys) -> None:
        with self._lock:
            for k in self._check_keys(keys):
                self._keys.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)
