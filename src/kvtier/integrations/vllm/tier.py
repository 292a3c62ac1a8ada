"""kvtier's host tier (and storage behind it) keyed by vLLM's offload keys.

One :class:`HostTier` per vLLM engine: a :class:`~kvtier.pools.HostKVPool` of one
page per vLLM block, a :class:`~.pages.PageTable` saying which block is where, and
the storage client. The scheduler-side manager asks it what is where and reserves
pages; the worker copies blocks in and out of its pool.

Storage work runs on threads and never blocks the caller: a *probe* asks storage
which of a request's blocks exist and fetches them, checksums verified, into pages
that then become READY; a committed store is copied to storage afterwards. A storage
fault, or a probe slower than ``timeout_s``, is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Sequence

import torch

from ...pools import HostKVPool
from ...storage import Storage
from .blocks import BlockFormat
from .pages import Page, PageState, PageTable, Reservation

log = logging.getLogger("kvtier.vllm")


class Lookup(Enum):
    HIT = "hit"            # READY: may be loaded now
    PENDING = "pending"    # in storage and being fetched: ask again
    RETRY = "retry"        # storage not asked yet, or not answered yet: ask again
    MISS = "miss"


@dataclass
class Probe:
    """One request's storage look-ups (kept in vLLM's per-request context)."""

    queued: list[bytes] = field(default_factory=list)       # asked, not sent yet
    sent: dict[bytes, float] = field(default_factory=dict)  # key -> deadline
    missing: set[bytes] = field(default_factory=set)


class HostTier:
    """Host pages for vLLM blocks of one :class:`BlockFormat`, with optional storage.

    Thread safety: every method may be called from any thread; the page table changes
    under one lock, storage I/O runs outside it.
    """

    def __init__(self, fmt: BlockFormat, host_bytes: int, *, storage: Storage | None = None,
                 key_prefix: str = "vllm", timeout_s: float = 2.0, io_threads: int = 2) -> None:
        page_bytes = fmt.page_size * fmt.spec.bytes_per_token
        num_pages = host_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"kvtier: host_bytes {host_bytes} holds no block of {page_bytes} bytes; "
                             f"give at least {page_bytes}")
        self.format, self.storage, self.key_prefix, self.timeout_s = fmt, storage, key_prefix, timeout_s
        self.num_pages = num_pages
        self.pool = HostKVPool(fmt.spec, num_pages * fmt.page_size, fmt.page_size, layout="page_head")
        self._table = PageTable(self.pool)
        self.stats = self._table.stats
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a probe finishes
        self._inflight = 0                            # probes sent and not finished
        self._reader = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-fetch") if storage else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-write") if storage else None

    def storage_key(self, key: bytes) -> str:
        return f"{self.key_prefix}/{key.hex()}"

    def slots(self, pages: Sequence[int]) -> torch.Tensor:
        return self._table.slots(pages)

    # -- what is where ----------------------------------------------------------------------
    def lookup(self, key: bytes, probe: Probe | None = None) -> Lookup:
        """Where ``key`` is. With storage, unknown keys are queued on ``probe`` (sent by
        :meth:`send`) and answer RETRY until storage answers or ``timeout_s`` passes."""
        now = time.monotonic()
        with self._lock:
            page = self._table.get(key)
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

    def busy(self) -> bool:
        """Whether work is in flight that needs the engine to keep stepping."""
        with self._lock:
            return self._inflight > 0 or self._table.has_orphans

    def lru_order(self) -> list[bytes]:
        """READY keys, least recently used first (what eviction takes next)."""
        with self._lock:
            return self._table.lru_order()

    # -- the manager's calls -------------------------------------------------------------------
    def reserve(self, keys: Iterable[bytes]) -> Reservation | None:
        """Pages for the keys not held yet, evicting least recently used READY pages;
        ``None`` (and nothing changed) when they do not fit."""
        with self._lock:
            return self._table.reserve(keys)

    def commit(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Stores vLLM finished: READY (then copied to storage), or dropped on failure."""
        with self._lock:
            ready = self._table.commit(list(keys), success)
            to_write = [(k, p.page) for k, p in ready if not p.in_storage] if self._writer else []
            for k, _ in to_write:
                self._table.get(k).writes += 1
        if to_write:
            self._writer.submit(self._write, to_write)

    def pin(self, keys: Sequence[bytes]) -> list[int]:
        """Host pages of READY ``keys``, protected from eviction until :meth:`unpin`."""
        with self._lock:
            return self._table.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._table.unpin(keys)

    def touch(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._table.touch(keys)

    def reset(self) -> list[bytes]:
        with self._lock:
            return self._table.reset()

    def tick(self) -> None:
        with self._lock:
            self._table.tick()

    # -- storage -------------------------------------------------------------------------------------
    def send(self, probe: Probe) -> None:
        """Start the storage look-up of ``probe``'s queued keys on a thread."""
        with self._lock:
            keys, probe.queued = probe.queued, []
            if not keys or self._reader is None:
                return
            deadline = time.monotonic() + self.timeout_s
            probe.sent.update(dict.fromkeys(keys, deadline))
            self._inflight += 1
        self._reader.submit(self._fetch, probe, keys, deadline)

    def yield_to_io(self, budget_s: float) -> None:
        """Wait up to ``budget_s`` for running probes to finish.

        NOTE: a scheduler with nothing to do but wait for storage spins through empty
        steps holding the GIL, and I/O threads that need the GIL for every object then
        crawl (measured here: a 100-block fetch took 0.1 s to over 2 s). Waiting on a
        condition releases the GIL; the budget bounds what a step can lose."""
        with self._lock:
            if self._inflight:
                self._idle.wait(budget_s)

    def _fetch(self, probe: Probe, keys: list[bytes], deadline: float) -> None:
        fetching: list[tuple[bytes, int]] = []
        ok: list[bool] = []
        try:
            present = self.storage.batch_exists([self.storage_key(k) for k in keys])
            with self._lock:
                fetching = self._start_fetching(keys[:present], deadline)
                probe.missing.update(k for k in keys if self._table.get(k) is None)
            if fetching:
                ok = self.storage.batch_get([self.storage_key(k) for k, _ in fetching], self.pool,
                                            self.slots([p for _, p in fetching]))
        except Exception:  # a fault or bug in storage must not take vLLM down: misses
            log.exception("kvtier: storage look-up failed; its blocks count as misses")
        with self._lock:
            for i, (k, _) in enumerate(fetching):
                if i < len(ok) and ok[i]:
                    self._table.make_ready(k)
                    self.stats["fetched"] += 1
                else:
                    self._table.drop(k)
                    self.stats["fetch_failed"] += 1
            probe.missing.update(k for k in keys if self._table.get(k) is None)
            self._inflight -= 1
            self._idle.notify_all()

    def _start_fetching(self, keys: list[bytes], deadline: float) -> list[tuple[bytes, int]]:
        """FETCHING pages for the longest prefix of ``keys`` (not held yet) that fits."""
        wanted = [k for k in keys if self._table.get(k) is None]
        got = self._table.allocate(len(wanted))
        while got is None:
            wanted.pop()
            got = self._table.allocate(len(wanted))
        for k, p in zip(wanted, got[0]):
            self._table.add(k, Page(p, PageState.FETCHING, in_storage=True, deadline=deadline))
        return list(zip(wanted, got[0]))

    def _write(self, items: list[tuple[bytes, int]]) -> None:
        try:
            ok = self.storage.batch_set([self.storage_key(k) for k, _ in items], self.pool,
                                        self.slots([p for _, p in items]))
        except Exception:
            log.exception("kvtier: storage write failed; the blocks stay in the host tier only")
            ok = [False] * len(items)
        with self._lock:
            for (k, _), good in zip(items, ok):
                page = self._table.get(k)  # a page with writes in flight is never dropped
                page.writes -= 1
                page.in_storage = page.in_storage or bool(good)
                self.stats["written" if good else "write_failed"] += 1

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the storage writes and probes submitted so far have finished."""
        for ex in (self._writer, self._reader):
            if ex is not None:
                ex.submit(lambda: None).result(timeout)
        with self._lock:
            self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        """Finish storage writes in flight, then release the storage client."""
        for ex in (self._reader, self._writer):
            if ex is not None:
                ex.shutdown(wait=True)
        if self.storage is not None:
            self.storage.close()


__all__ = ["HostTier", "Lookup", "PageState", "Probe", "Reservation"]
