"""The storage (L3) interface, its statistics, and the checks every backend shares.

Every backend turns a fault (server down, timeout, I/O error, corrupt object)
into a miss and a counted error: the ``batch_*`` methods never raise for those.
Caller mistakes (wrong key count, bad or repeated indices, oversized keys, a pool
of another geometry than the one bound) raise ``ValueError`` before any byte moves.

Geometry: ``spec=`` and ``page_size=`` at construction bind a store to one pool
geometry; ``batch_exists`` then checks that geometry's objects, and a pool of any
other geometry is a ``ValueError``. An unbound store takes each call's geometry from
its pool (plans are pure functions of the pool's spec and page size, so no call
changes what another sees), and ``batch_exists`` answers "some object of the key".
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Iterable, Sequence

import torch

from ..errors import UsageError
from ..pools import HostKVPool
from ..pools.indices import page_starts
from ..spec import KVSpec
from .faults import WarningLimiter
from .objects import PagePlan, page_plan
from .options import Opt, check_options

log = logging.getLogger("kvtier.storage")

#: The longest key, in UTF-8 bytes (object headers store names with a 16-bit length).
MAX_KEY_BYTES = 65_535


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


def _check_keys(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list (any iterable is read exactly once), each a non-empty str of at
    most ``MAX_KEY_BYTES`` UTF-8 bytes; ``ValueError`` naming the first bad key otherwise."""
    if type(keys) is not list and (isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable)):
        raise UsageError(f"keys must be a list of non-empty str (see kvtier.storage.page_keys), "
                         f"got {type(keys).__name__}")
    keys = list(keys)
    # NOTE: every key kvtier makes is ASCII (hex digests), a few dozen bytes: joined, they
    # are checked by C loops (str only, ASCII, none empty, and no key longer than all of
    # them together), a fifth of the loop below; anything else is looked at key by key
    try:
        joined = "".join(keys)
    except TypeError:  # a key that is no str: the loop names it
        joined = None
    if joined is not None and len(joined) <= MAX_KEY_BYTES and joined.isascii() and all(keys):
        return keys
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            raise UsageError(f"keys must be a list of non-empty str (see kvtier.storage.page_keys); "
                             f"key {i} is {k!r:.60}")
        if k.isascii():  # NOTE: every key kvtier makes (hex digests): its length is its UTF-8 size, no copy
            n = len(k)
        else:
            try:
                n = len(k.encode())
            except UnicodeEncodeError as e:
                raise UsageError(f"key {i} is not encodable as UTF-8: {e}") from None
        if n > MAX_KEY_BYTES:
            raise UsageError(f"key {i} is {n} bytes (UTF-8), over the limit of {MAX_KEY_BYTES}")
    return keys


class Storage(ABC):
    """One interface for every L3 backend (see docs/storage.md)."""

    scheme = ""
    #: Options a URL query may carry (``kvtier.storage.options``); subclasses extend it.
    OPTIONS: dict[str, Opt] = {"page_size": Opt(int, 1, none_ok=True), "head_groups": Opt(int, 1, none_ok=True)}
    #: The keys check every backend applies (for subclasses outside this package)
    _check_keys = staticmethod(_check_keys)
    #: Options only keywords can carry.
    KEYWORDS: set[str] = {"spec"}

    def __init__(self, *, spec: KVSpec | None = None, page_size: int | None = None,
                 head_groups: int | None = None) -> None:
        if spec is not None and not isinstance(spec, KVSpec):
            raise UsageError(f"spec must be a KVSpec, got {type(spec).__name__}")
        check_options(Storage.OPTIONS, page_size=page_size, head_groups=head_groups)
        if (spec is None) != (page_size is None):
            raise UsageError(f"spec= and page_size= bind a store's geometry together: give both or neither "
                             f"(got spec={spec.fingerprint() if spec else None}, page_size={page_size})")
        self._spec, self._page_size, self._head_groups = spec, page_size, head_groups
        # validates head_groups against the spec now
        self._bound: PagePlan | None = page_plan(spec, page_size, head_groups) if spec is not None else None
        self._stats = StorageStats()
        self._warnings = WarningLimiter(log)

    # -- the contract ------------------------------------------------------------------
    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are present (for the bound geometry, else any)."""

    def exists_each(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether it is present (as :meth:`batch_exists` counts it); a fault is
        ``False``. Hybrid lookups need it: a sliding group's pages exist only in windows,
        not as a leading run. Backends answer it in one round trip; this default asks
        key by key."""
        return [self.batch_exists([k]) == 1 for k in _check_keys(keys)]

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
        self._warnings.flush()

    def __enter__(self) -> "Storage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers for backends -------------------------------------------------------------
    def _plan(self, host_pool: HostKVPool) -> PagePlan:
        """The objects of ``host_pool``'s pages (its geometry was checked by ``_check_pages``)."""
        return self._bound or page_plan(host_pool.spec, host_pool.page_size, self._head_groups)

    def _check_pool(self, host_pool: HostKVPool) -> None:
        """Raise ``ValueError`` unless ``host_pool`` has the bound geometry (if any)."""
        if self._spec is not None and (host_pool.spec != self._spec or host_pool.page_size != self._page_size):
            raise UsageError(f"this store is bound to spec {self._spec.fingerprint()} (shard "
                             f"{self._spec.shard_of}) with page_size {self._page_size}; the pool has spec "
                             f"{host_pool.spec.fingerprint()} (shard {host_pool.spec.shard_of}) with page_size "
                             f"{host_pool.page_size}")

    def _check_pages(self, keys, host_pool, host_indices, *, writing: bool) -> tuple[list[str], list[int]]:
        """Checked keys and the pool's page numbers for them. A read's destination pages
        must be distinct (two objects into one page would mix their bytes)."""
        keys = _check_keys(keys)
        if not isinstance(host_pool, HostKVPool):
            raise UsageError(f"host_pool must be a HostKVPool, got {type(host_pool).__name__}")
        self._check_pool(host_pool)
        if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != len(keys) * host_pool.page_size:
            n = host_indices.numel() if isinstance(host_indices, torch.Tensor) else host_indices
            raise UsageError(f"host_indices must hold len(keys) * page_size = {len(keys)} * {host_pool.page_size} "
                             f"slots, got {n}")
        pages = page_starts(host_indices, page_size=host_pool.page_size, size=host_pool.size, what="host_indices",
                            unique=not writing)
        if host_pool.device.type != "cpu":
            raise UsageError(f"storage moves bytes through host memory; the pool is on {host_pool.device}")
        self._plan(host_pool)  # an impossible head_groups for this spec is caller misuse: raise now
        return keys, pages.tolist()

    def _fault(self, op: str, error: BaseException) -> None:
        self._stats.add(errors=1)
        kind = (op, type(error).__name__, getattr(error, "errno", None))
        self._warnings.warn(kind, "kvtier storage %s: %s failed: %s: %s", self.scheme, op, type(error).__name__,
                            error)
