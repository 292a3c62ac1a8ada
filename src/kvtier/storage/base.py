"""The storage (L3) interface, and the shared machinery of the copy backends.

Every backend turns a fault (server down, timeout, I/O error, corrupt object)
into a miss and a counted error: the ``batch_*`` methods never raise for those.
Caller mistakes (wrong key count, bad indices) raise ``ValueError`` before any
byte moves.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from ..pools import HostKVPool
from ..pools.indices import page_starts
from ..spec import KVSpec
from .codec import CorruptObject, decode, header_size, write_header
from .objects import PagePlan

log = logging.getLogger("kvtier.storage")

#: Payload bytes packed per backend round trip: bounds memory for large batches.
BATCH_BYTES = 64 << 20


class StorageStats:
    """Thread-safe counters behind ``Storage.stats()``."""

    _FIELDS = ("hits", "misses", "bytes_read", "bytes_written", "errors", "corrupt", "pages_written",
               "write_failures", "evictions")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self._FIELDS, 0)
        self._latency: dict[str, list[float]] = {}  # op -> [calls, seconds]

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._counts[k] += v

    def timed(self, op: str, seconds: float) -> None:
        with self._lock:
            calls_secs = self._latency.setdefault(op, [0, 0.0])
            calls_secs[0] += 1
            calls_secs[1] += seconds

    def snapshot(self) -> dict:
        with self._lock:
            out = dict(self._counts)
            out["latency_ms"] = {op: {"calls": c, "mean": s / c * 1e3, "total": s * 1e3}
                                 for op, (c, s) in self._latency.items()}
        return out


def _check_keys(keys: Sequence[str]) -> list[str]:
    if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError("keys must be a list of non-empty str (see kvtier.storage.page_keys)")
    return list(keys)


class Storage(ABC):
    """One interface for every L3 backend (see DESIGN section 4)."""

    scheme = ""

    def __init__(self, *, spec: KVSpec | None = None, head_groups: int | None = None) -> None:
        if spec is not None and not isinstance(spec, KVSpec):
            raise ValueError(f"spec must be a KVSpec, got {type(spec).__name__}")
        self._spec = spec
        self._head_groups = head_groups
        self._plans: dict[tuple[KVSpec, int], PagePlan] = {}
        self._stats = StorageStats()
        if spec is not None:
            self._plan(spec, 1)  # validates head_groups against the spec now

    # -- the contract ------------------------------------------------------------------
    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are present (for this storage's geometry)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[str], host_pool: HostKVPool, host_indices: torch.Tensor) -> list[bool]:
        """Fill host page ``i`` of ``host_indices`` from ``keys[i]``; ``False`` = miss."""

    @abstractmethod
    def batch_set(self, keys: Sequence[str], host_pool: HostKVPool, host_indices: torch.Tensor) -> list[bool]:
        """Store host page ``i`` of ``host_indices`` under ``keys[i]``; ``False`` = not stored."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove every object of ``keys`` (all geometries, all head ranges)."""

    @abstractmethod
    def clear(self) -> None:
        """Remove everything this backend stored."""

    def stats(self) -> dict:
        """Counters: hits, misses, bytes_read, bytes_written, errors, corrupt, latency_ms per op."""
        return {"backend": self.scheme, **self._stats.snapshot()}

    def close(self) -> None:
        """Release connections and handles; the object is unusable afterwards."""

    def __enter__(self) -> "Storage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers for backends -------------------------------------------------------------
    def _plan(self, spec: KVSpec, page_size: int) -> PagePlan:
        key = (spec, page_size)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = PagePlan(spec, page_size, self._head_groups)
        return plan

    def _check_pages(self, keys, host_pool, host_indices) -> tuple[list[str], list[int]]:
        keys = _check_keys(keys)
        if not isinstance(host_pool, HostKVPool):
            raise ValueError(f"host_pool must be a HostKVPool, got {type(host_pool).__name__}")
        if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != len(keys) * host_pool.page_size:
            n = host_indices.numel() if isinstance(host_indices, torch.Tensor) else host_indices
            raise ValueError(f"host_indices must hold len(keys) * page_size = {len(keys)} * {host_pool.page_size} "
                             f"slots, got {n}")
        pages = page_starts(host_indices, page_size=host_pool.page_size, size=host_pool.size, what="host_indices")
        if host_pool.device.type != "cpu":
            raise ValueError(f"storage moves bytes through host memory; the pool is on {host_pool.device}")
        self._spec = host_pool.spec  # the geometry batch_exists answers for from now on
        return keys, pages.tolist()

    def _fault(self, op: str, error: BaseException) -> None:
        self._stats.add(errors=1)
        log.warning("kvtier storage %s: %s failed: %s: %s", self.scheme, op, type(error).__name__, error)


class ObjectStorage(Storage):
    """A copy backend: each page part is one object ``(key, field) -> header + payload``.

    Subclasses implement the primitives below on their medium; this class does
    validation, packing, checksums, batching, statistics and fault handling.
    Objects are packed into (and read into) a per-thread staging arena that is
    reused across calls: fresh buffers of this size would be page-faulted in on
    every call, which costs as much as the copy itself.
    """

    def __init__(self, *, io_threads: int = 2, **options) -> None:
        super().__init__(**options)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads <= 0:
            raise ValueError(f"io_threads must be a positive int, got {io_threads!r}")
        self.io_threads = io_threads
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _arena(self, nbytes: int) -> np.ndarray:
        arena = getattr(self._local, "arena", None)
        if arena is None or arena.nbytes < nbytes:
            arena = self._local.arena = np.empty(nbytes, dtype=np.uint8)
        return arena[:nbytes]

    @staticmethod
    def _carve(arena: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
        offsets = np.cumsum([0, *sizes]).tolist()
        return [arena[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    # -- primitives ---------------------------------------------------------------------
    @abstractmethod
    def _put(self, items: list[tuple[str, str, np.ndarray]]) -> list[bool]:
        """Store ``(key, field, blob)`` objects (blob: uint8, header + payload); success per item."""

    @abstractmethod
    def _get(self, items: list[tuple[str, str]], dest: list[np.ndarray]) -> list:
        """Whole stored objects (header + payload) per ``(key, field)``; ``None`` if absent.
        ``dest[i]`` is a buffer of the expected object size that a backend may read into
        (and return); an object of another size is returned as read, and is then corrupt."""

    @abstractmethod
    def _has(self, items: list[tuple[str, str]]) -> list[bool]:
        """Whether each ``(key, field)`` object exists."""

    @abstractmethod
    def _has_any(self, keys: list[str]) -> list[bool]:
        """Whether any object of each key exists (used when no geometry is known)."""

    @abstractmethod
    def _remove(self, items: list[tuple[str, str]]) -> None:
        """Remove single objects (corrupt ones)."""

    @abstractmethod
    def _remove_keys(self, keys: list[str]) -> None:
        """Remove every object of each key."""

    @abstractmethod
    def _remove_all(self) -> None:
        """Remove every object this backend stored."""

    # -- the contract ----------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> int:
        keys = _check_keys(keys)
        if not keys:
            return 0
        t0 = time.perf_counter()
        try:
            if self._spec is None:
                present = self._has_any(keys)
            else:
                fields = [p.field for p in self._plan(self._spec, 1).read_parts]
                found = self._has([(k, f) for k in keys for f in fields])
                present = [all(found[i * len(fields):(i + 1) * len(fields)]) for i in range(len(keys))]
        except Exception as e:  # a storage fault is a miss, never an exception for the caller
            self._fault("exists", e)
            return 0
        finally:
            self._stats.timed("exists", time.perf_counter() - t0)
        return next((i for i, p in enumerate(present) if not p), len(keys))

    def batch_set(self, keys: Sequence[str], host_pool: HostKVPool, host_indices: torch.Tensor) -> list[bool]:
        keys, pages = self._check_pages(keys, host_pool, host_indices)
        plan = self._plan(host_pool.spec, host_pool.page_size)
        stored = [True] * len(keys)
        t0 = time.perf_counter()

        def set_chunk(chunk: range) -> None:
            names = [(i, part, f"{keys[i]}#{part.field}") for i in chunk for part in plan.write_parts]
            sizes = [header_size(name) + part.nbytes for _, part, name in names]
            items = []
            for (i, part, name), blob in zip(names, self._carve(self._arena(sum(sizes)), sizes)):
                plan.pack(host_pool, pages[i], part, blob[header_size(name):])
                write_header(name, blob)
                items.append((keys[i], part.field, blob))
            try:
                ok = self._put(items)
            except Exception as e:
                self._fault("set", e)
                ok = [False] * len(items)
            for (i, part, _), good in zip(names, ok):
                stored[i] = stored[i] and bool(good)
                if good:
                    self._stats.add(bytes_written=part.nbytes)

        self._run(set_chunk, len(keys), sum(p.nbytes for p in plan.write_parts))
        self._stats.add(pages_written=sum(stored), write_failures=len(keys) - sum(stored))
        self._stats.timed("set", time.perf_counter() - t0)
        return stored

    def batch_get(self, keys: Sequence[str], host_pool: HostKVPool, host_indices: torch.Tensor) -> list[bool]:
        keys, pages = self._check_pages(keys, host_pool, host_indices)
        plan = self._plan(host_pool.spec, host_pool.page_size)
        parts = plan.read_parts
        loaded = [False] * len(keys)
        t0 = time.perf_counter()

        def get_chunk(chunk: range) -> None:
            items = [(keys[i], p.field) for i in chunk for p in parts]
            sizes = [header_size(f"{k}#{f}") + p.nbytes for (k, f), p in zip(items, parts * len(chunk))]
            try:
                blobs = self._get(items, self._carve(self._arena(sum(sizes)), sizes))
            except Exception as e:
                self._fault("get", e)
                blobs = [None] * len(items)
            for n, i in enumerate(chunk):
                payloads = self._decode(items[n * len(parts):(n + 1) * len(parts)],
                                        blobs[n * len(parts):(n + 1) * len(parts)], parts)
                if payloads is None:
                    continue
                for part, payload in zip(parts, payloads):  # every part checked before any is copied
                    plan.unpack(host_pool, pages[i], part, payload)
                loaded[i] = True
                self._stats.add(bytes_read=sum(p.nbytes for p in parts))

        self._run(get_chunk, len(keys), sum(p.nbytes for p in parts))
        hits = sum(loaded)
        self._stats.add(hits=hits, misses=len(keys) - hits)
        self._stats.timed("get", time.perf_counter() - t0)
        return loaded

    def delete(self, keys: Sequence[str]) -> None:
        keys = _check_keys(keys)
        try:
            self._remove_keys(keys)
        except Exception as e:
            self._fault("delete", e)

    def clear(self) -> None:
        try:
            self._remove_all()
        except Exception as e:
            self._fault("clear", e)

    # -- internals ---------------------------------------------------------------------------
    def _run(self, fn, n: int, page_bytes: int) -> None:
        """``fn(range)`` over chunks of the ``n`` pages: at most ``BATCH_BYTES`` each, and
        spread over ``io_threads`` threads (file reads, socket I/O and numpy copies all
        release the GIL, so two threads overlap one's I/O with the other's copies)."""
        per_thread = -(-n // self.io_threads)
        step = max(1, min(per_thread, BATCH_BYTES // max(page_bytes, 1)))
        chunks = [range(a, min(n, a + step)) for a in range(0, n, step)]
        if len(chunks) <= 1 or self.io_threads == 1:
            for chunk in chunks:
                fn(chunk)
            return
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"kvtier-{self.scheme}")
        for future in [self._pool.submit(fn, chunk) for chunk in chunks]:
            future.result()

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _decode(self, items, blobs, parts) -> list[memoryview] | None:
        """Checked payloads of one page's parts, or None (counting corrupt objects)."""
        payloads = []
        for (key, field), blob, part in zip(items, blobs, parts):
            if blob is None:
                return None
            try:
                payloads.append(decode(f"{key}#{field}", blob, part.nbytes))
            except CorruptObject as e:
                self._stats.add(corrupt=1, errors=1)
                log.warning("kvtier storage %s: %s; deleting it", self.scheme, e)
                try:
                    self._remove([(key, field)])
                except Exception as err:
                    self._fault("remove", err)
                return None
        return payloads
