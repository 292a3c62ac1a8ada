"""A metadata-only L3 store for the simulator: which page keys it holds, in LRU order."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..storage.base import Storage, _check_keys


class SimStorage(Storage):
    """Capacity in pages (``None``: unlimited); ``batch_set`` evicts least recently used keys."""

    scheme = "sim"

    def __init__(self, capacity_pages: int | None = None, **options) -> None:
        super().__init__(**options)
        self.capacity_pages = capacity_pages
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def batch_exists(self, keys) -> int:
        with self._lock:
            return next((i for i, k in enumerate(keys) if k not in self._keys), len(keys))

    def batch_get(self, keys, host_pool, host_indices) -> list[bool]:
        with self._lock:
            out = []
            for k in keys:
                hit = k in self._keys
                if hit:
                    self._keys.move_to_end(k)
                out.append(hit)
        self._stats.add(hits=sum(out), misses=len(out) - sum(out))
        return out

    def batch_set(self, keys, host_pool, host_indices) -> list[bool]:
        with self._lock:
            for k in keys:
                self._keys[k] = None
                self._keys.move_to_end(k)
            evicted = 0
            while self.capacity_pages is not None and len(self._keys) > self.capacity_pages:
                self._keys.popitem(last=False)
                evicted += 1
        self._stats.add(pages_written=len(keys), evictions=evicted)
        return [True] * len(keys)

    def delete(self, keys) -> None:
        with self._lock:
            for k in _check_keys(keys):
                self._keys.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)
