"""kvtier's host tier (and storage behind it) keyed by vLLM's offload keys.

One :class:`HostTier` per vLLM engine holds a :class:`~kvtier.pools.HostKVPool` of
one page per vLLM block, the state of every page, an LRU of readable pages, and the
storage client. The scheduler-side manager asks it what is where and reserves pages;
the worker copies blocks in and out of its pool. Page states::

    (none) --reserve--> STORING --commit(ok)--> READY <--fetched-- FETCHING <--probe-- (none)
                           \\--commit(fail)--> (none)       READY --evict/reset--> (none)

Only READY pages with no pin (a load in flight or a copy to storage in flight) are
evicted. Storage work runs on threads and never blocks the caller: a probe asks
storage which of a request's blocks exist and fetches them, checksums verified,
into pages that become READY; a store is copied to storage after vLLM commits it.
A storage fault, or a probe slower than ``timeout_s``, is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, NamedTuple, Sequence

import torch

from ...pools import HostKVPool
from ...pools.indices import page_slots
from ...storage import Storage
from .blocks import BlockFormat

log = logging.getLogger("kvtier.vllm")


class PageState(Enum):
    STORING = "storing"    # reserved for a store from vLLM, not yet readable
    READY = "ready"        # readable; in the LRU
    FETCHING = "fetching"  # being read from storage


class Lookup(Enum):
    HIT = "hit"            # READY: may be loaded now
    PENDING = "pending"    # in storage and being fetched: ask again
    RETRY = "retry"        # storage not asked yet, or not answered yet: ask again
    MISS = "miss"


@dataclass
class _Page:
    page: int
    state: PageState
    loads: int = 0         # loads into vLLM in flight
    writes: int = 0        # copies to storage in flight
    in_storage: bool = False
    deadline: float = 0.0  # FETCHING: after this, look-ups stop waiting for it

    @property
    def pins(self) -> int:
        return self.loads + self.writes


@dataclass
class Probe:
    """One request's storage look-ups (kept in vLLM's per-request context)."""

    queued: list[bytes] = field(default_factory=list)   # asked, not yet sent
    sent: dict[bytes, float] = field(default_factory=dict)  # key -> deadline
    missing: set[bytes] = field(default_factory=set)


class Reservation(NamedTuple):
    keys: list[bytes]      # keys that vLLM must copy
    pages: list[int]       # their host pages
    evicted: list[bytes]   # keys evicted to make room


class HostTier:
    """Host pages for vLLM blocks of one :class:`BlockFormat`, with optional storage.

    Thread safety: every method may be called from any thread; state changes happen
    under one lock, storage I/O outside it.
    """

    def __init__(self, fmt: BlockFormat, host_bytes: int, *, storage: Storage | None = None,
                 key_prefix: str = "vllm", timeout_s: float = 2.0, io_threads: int = 2) -> None:
        page_bytes = fmt.page_size * fmt.spec.bytes_per_token
        num_pages = host_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"kvtier: host_bytes {host_bytes} holds no block of {page_bytes} bytes; "
                             f"give at least {page_bytes}")
        self.format, self.storage, self.key_prefix, self.timeout_s = fmt, storage, key_prefix, timeout_s
        self.pool = HostKVPool(fmt.spec, num_pages * fmt.page_size, fmt.page_size, layout="page_head")
        self.num_pages = num_pages
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a probe finishes
        self._orphans: list[tuple[int, bytes]] = []  # (schedule ends to wait, key) after a reset
        self._pages: dict[bytes, _Page] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # READY keys, least recent first
        self._inflight = 0  # probe jobs running or queued
        self._reader = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-fetch") if storage else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-write") if storage else None
        self.stats = {"stored": 0, "loaded": 0, "evicted": 0, "fetched": 0, "fetch_failed": 0, "written": 0,
                      "write_failed": 0, "probe_timeouts": 0}

    # -- keys and slots -------------------------------------------------------------
    def storage_key(self, key: bytes) -> str:
        return f"{self.key_prefix}/{key.hex()}"

    def slots(self, pages: Sequence[int]) -> torch.Tensor:
        """Token slots of host ``pages`` (what the pool and storage take)."""
        return page_slots(torch.as_tensor(list(pages), dtype=torch.int64), self.format.page_size)

    # -- what is where ------------------------------------------------------------------
    def lookup(self, key: bytes, probe: Probe | None = None) -> Lookup:
        """Where ``key`` is. Unknown keys are queued on ``probe`` for storage (sent by
        :meth:`send`) and answer RETRY until storage answers or ``timeout_s`` passes."""
        now = time.monotonic()
        with self._lock:
            page = self._pages.get(key)
            if page is not None:
                if page.state is PageState.READY:
                    return Lookup.HIT
                if page.state is PageState.FETCHING and now < page.deadline:
                    return Lookup.PENDING
                return Lookup.MISS
            if self.storage is None or probe is None or key in probe.missing:
                return Lookup.MISS
            deadline = probe.sent.get(key)
            if deadline is None:
                if key not in probe.queued:
                    probe.queued.append(key)
                return Lookup.RETRY
            if now < deadline:
                return Lookup.RETRY
            self.stats["probe_timeouts"] += 1
            probe.missing.add(key)
            return Lookup.MISS

    def ready(self, key: bytes) -> bool:
        with self._lock:
            page = self._pages.get(key)
            return page is not None and page.state is PageState.READY

    def busy(self) -> bool:
        """Whether storage probes are running (the engine should keep stepping)."""
        with self._lock:
            return self._inflight > 0 or bool(self._orphans)

    def yield_to_io(self, budget_s: float) -> None:
        """Wait up to ``budget_s`` for running probes to finish.

        NOTE: a scheduler with nothing to do but wait for storage spins through empty
        steps holding the GIL, and I/O threads that need the GIL for every object then
        crawl (measured here: a 100-block fetch took 0.1 s to over 2 s). Waiting on a
        condition releases the GIL; the budget bounds what a step can lose."""
        with self._lock:
            if self._inflight:
                self._idle.wait(budget_s)

    # -- stores from vLLM --------------------------------------------------------------------
    def reserve(self, keys: Iterable[bytes]) -> Reservation | None:
        """Pages for the keys not held yet, evicting least recently used READY pages;
        ``None`` (and nothing changed) when they do not fit."""
        with self._lock:
            new = [k for k in dict.fromkeys(keys) if k not in self._pages]
            got = self._allocate(len(new))
            if got is None:
                return None
            pages, evicted = got
            for k, p in zip(new, pages):
                self._pages[k] = _Page(p, PageState.STORING)
            return Reservation(new, pages, evicted)

    def commit(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Stores that vLLM finished: STORING pages become READY (and go to storage),
        or are dropped when ``success`` is false."""
        to_write = []
        with self._lock:
            for k in keys:
                page = self._pages.get(k)
                if page is None or page.state is not PageState.STORING:
                    continue
                if not success:
                    self._drop(k)
                    continue
                page.state = PageState.READY
                self._lru[k] = None
                self.stats["stored"] += 1
                if self._writer is not None:
                    page.writes += 1
                    to_write.append((k, page.page))
        if to_write:
            self._writer.submit(self._write, to_write)

    # -- loads into vLLM -------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> list[int]:
        """Host pages of READY ``keys``, protected from eviction until :meth:`unpin`."""
        with self._lock:
            missing = [k.hex()[:16] for k in keys if k not in self._pages
                       or self._pages[k].state is not PageState.READY]
            if missing:
                raise ValueError(f"kvtier: load of blocks that are not ready: {missing[:4]}")
            for k in keys:
                self._pages[k].loads += 1
                self._lru.move_to_end(k)
            self.stats["loaded"] += len(keys)
            return [self._pages[k].page for k in keys]

    def unpin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for k in keys:
                page = self._pages.get(k)
                if page is None or page.loads == 0:  # a reset forgot it: vLLM dropped that job
                    continue
                page.loads -= 1

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark READY keys as recently used (in the given order)."""
        with self._lock:
            for k in keys:
                if k in self._lru:
                    self._lru.move_to_end(k)

    def lru_order(self) -> list[bytes]:
        """READY keys, least recently used first (what eviction takes next)."""
        with self._lock:
            return list(self._lru)

    def reset(self) -> list[bytes]:
        """Forget every page (vLLM's connector reset); returns the keys dropped now.

        vLLM discards the jobs in flight at a reset: their ``complete_*`` never comes.
        Pages those jobs may still copy into (STORING, or pinned by a load) are
        unreadable at once and freed after two more scheduler steps, by when vLLM
        has flushed those copies; pins of storage writes are released by the writer."""
        with self._lock:
            gone = []
            for k, page in list(self._pages.items()):
                if page.state is PageState.FETCHING:
                    continue  # the fetch thread finishes it
                if page.state is PageState.STORING or page.pins:
                    self._lru.pop(k, None)
                    page.state = PageState.STORING  # unreadable, never evicted
                    self._orphans.append((2, k))
                else:
                    self._drop(k)
                    gone.append(k)
            return gone

    def tick(self) -> None:
        """One scheduler step ended: free the orphans of a reset whose time has come
        (and whose copy to storage, if any, has finished)."""
        with self._lock:
            keep = []
            for steps, k in self._orphans:
                page = self._pages.get(k)
                if page is None:
                    continue
                if steps > 1 or page.writes:
                    keep.append((max(steps - 1, 1), k))
                else:
                    self._drop(k)
            self._orphans = keep

    # -- storage -----------------------------------------------------------------------------------
    def send(self, probe: Probe) -> None:
        """Start the storage look-up of ``probe``'s queued keys on a thread."""
        with self._lock:
            keys, probe.queued = probe.queued, []
            if not keys or self._reader is None:
                return
            deadline = time.monotonic() + self.timeout_s
            for k in keys:
                probe.sent[k] = deadline
            self._inflight += 1
        self._reader.submit(self._fetch, probe, keys, deadline)

    def _fetch(self, probe: Probe, keys: list[bytes], deadline: float) -> None:
        fetching: list[tuple[bytes, int]] = []
        try:
            present = self.storage.batch_exists([self.storage_key(k) for k in keys])
            with self._lock:
                wanted = [k for k in keys[:present] if k not in self._pages]
                got = self._allocate(len(wanted))
                while got is None and wanted:  # fetch the longest prefix that fits
                    wanted.pop()
                    got = self._allocate(len(wanted))
                pages = got[0] if got else []
                for k, p in zip(wanted, pages):
                    self._pages[k] = _Page(p, PageState.FETCHING, in_storage=True, deadline=deadline)
                    fetching.append((k, p))
                probe.missing.update(k for k in keys if k not in self._pages)
            ok = [False] * len(fetching)
            if fetching:
                ok = self.storage.batch_get([self.storage_key(k) for k, _ in fetching], self.pool,
                                            self.slots([p for _, p in fetching]))
        except Exception:  # a bug or fault in storage must not take vLLM down: misses
            log.exception("kvtier: storage look-up failed; its blocks count as misses")
            ok = [False] * len(fetching)
            with self._lock:
                probe.missing.update(k for k in keys if k not in self._pages)
        with self._lock:
            for (k, _), good in zip(fetching, ok):
                if good:
                    self._pages[k].state = PageState.READY
                    self._lru[k] = None
                    self.stats["fetched"] += 1
                else:
                    self._drop(k)
                    probe.missing.add(k)
                    self.stats["fetch_failed"] += 1
            self._inflight -= 1
            self._idle.notify_all()

    def _write(self, items: list[tuple[bytes, int]]) -> None:
        try:
            ok = self.storage.batch_set([self.storage_key(k) for k, _ in items], self.pool,
                                        self.slots([p for _, p in items]))
        except Exception:
            log.exception("kvtier: storage write failed; the blocks stay in the host tier only")
            ok = [False] * len(items)
        with self._lock:
            for (k, _), good in zip(items, ok):
                page = self._pages[k]  # a page with writes in flight is never dropped
                page.writes -= 1
                page.in_storage = page.in_storage or bool(good)
                self.stats["written" if good else "write_failed"] += 1

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the storage writes and probes submitted so far have finished."""
        for ex in (self._writer, self._reader):
            if ex is not None:
                ex.submit(lambda: None).result(timeout)
        end = time.monotonic() + (timeout or 60.0)
        while self.busy() and time.monotonic() < end:
            time.sleep(0.001)

    def close(self) -> None:
        for ex in (self._reader, self._writer):
            if ex is not None:
                ex.shutdown(wait=True)
        if self.storage is not None:
            self.storage.close()

    # -- under the lock ------------------------------------------------------------------------------
    def _allocate(self, n: int) -> tuple[list[int], list[bytes]] | None:
        """``n`` free pages, evicting LRU pages without pins; None if they cannot be had
        (then nothing is evicted)."""
        if n == 0:
            return [], []
        free = self.pool.available_size() // self.format.page_size
        victims: list[bytes] = []
        if free < n:
            for k in self._lru:
                if self._pages[k].pins == 0:
                    victims.append(k)
                    if free + len(victims) == n:
                        break
            if free + len(victims) < n:
                return None
        for k in victims:
            self._drop(k)
        self.stats["evicted"] += len(victims)
        slots = self.pool.alloc(n * self.format.page_size)
        assert slots is not None, f"{n} pages should be free after evicting {len(victims)}"
        return (slots[::self.format.page_size] // self.format.page_size).tolist(), victims

    def _drop(self, key: bytes) -> None:
        page = self._pages.pop(key)
        self._lru.pop(key, None)
        self.pool.free(self.slots([page.page]))
