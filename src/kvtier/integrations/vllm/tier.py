"""kvtier's host tier on vLLM's scheduler side: the page table, and storage behind it.

One :class:`HostTier` per vLLM engine, in the scheduler's process. It holds the
:class:`~.pages.PageTable` (which offload key is in which host pages, in what state)
and, for storage, the I/O threads. The pages' bytes are the workers' pools, mapped
from their pool files (:mod:`.region`): one pool per tensor-parallel rank, all with
the same page numbers, each holding that rank's heads. The worker copies vLLM's
blocks in and out of them on vLLM's jobs; this side copies them to and from storage.

Storage work runs on threads and never blocks the scheduler. Every storage call goes
through :class:`~kvtier.cache.guard.StorageGuard` (timeouts, answer checks, counted
errors, rate-limited warnings), and no storage call ever holds a host page: it reads
and writes a :class:`~.staging.StagingBuffer`. A storage backend that hangs or is
slower than the stores arriving therefore holds only staging pages, and while the
buffer is full further storage writes are dropped (counted), never queued behind
it: the host tier keeps serving.

- *probe*: a request's keys not in the host tier, asked of storage (``exists_each``:
  each key on its own) at the end of the scheduler step; those present are read into staging, then into
  fresh host pages, READY. Until storage answers, or ``timeout_s`` passes, their
  look-ups answer RETRY; a fault or a timeout is a miss.
- *write*: a committed store not yet in storage is staged and written by one of
  ``io_threads`` writers; a failure only leaves it in the host tier.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Sequence

import numpy as np
import torch

from ...cache.guard import StorageGuard
from ...errors import UsageError
from ...pools import HostKVPool
from ...pools.indices import page_slots
from ...storage import Storage
from .blocks import BlockFormat
from .pages import Entry, PageState, PageTable, Reservation, Source
from .staging import StagingBuffer

log = logging.getLogger("vllm.kvtier")

#: Default ceiling of the staging buffer for storage I/O.
MAX_DEFAULT_BUFFER = 1 << 30
#: Probe delays kept between two reports of them (the rest are not sampled).
MAX_DELAYS = 10_000


class Lookup(Enum):
    HIT = "hit"            # READY: may be loaded now
    PENDING = "pending"    # being stored or filled: readable soon
    RETRY = "retry"        # storage not asked yet, or not answered yet: ask again
    MISS = "miss"


@dataclass
class Probe:
    """One request's storage look-ups (kept in vLLM's per-request context)."""

    queued: list[bytes] = field(default_factory=list)       # asked, not sent yet
    sent: dict[bytes, float] = field(default_factory=dict)  # key -> deadline
    missing: set[bytes] = field(default_factory=set)


class _Errors:
    """The error counter :class:`StorageGuard` reports into (``error(kind)``)."""

    def __init__(self, stats: dict, lock: threading.Lock) -> None:
        self._stats, self._lock = stats, lock

    def error(self, kind: str) -> None:
        with self._lock:
            self._stats[f"{kind}_errors"] = self._stats.get(f"{kind}_errors", 0) + 1


class HostTier:
    """Host pages for vLLM blocks of one :class:`BlockFormat` per rank, with optional storage.

    ``pools[r]``: rank ``r``'s host pool (``num_pages`` pages of one vLLM block each);
    ``blocks_per_key``: vLLM blocks per offloaded block. ``buffer_pages``: staging pages
    for storage I/O (default: a quarter of the host pages, at most 1 GiB of them; at
    least ``blocks_per_key``). Thread safety: every method may be called from any
    thread; the page table changes under one lock, storage I/O and page copies run
    outside it.
    """

    def __init__(self, pools: Sequence[HostKVPool], fmt: BlockFormat, *, blocks_per_key: int = 1,
                 storage: Storage | None = None, key_prefix: str = "vllm", timeout_s: float = 2.0,
                 io_threads: int = 2, buffer_pages: int | None = None, events: bool = False,
                 owns_storage: bool = True) -> None:
        num_pages = {p.num_pages for p in pools}
        if len(num_pages) != 1 or not pools:
            raise UsageError(f"kvtier: every rank's host pool needs one page count, got {sorted(num_pages)}")
        self.num_pages = num_pages.pop()
        if self.num_pages < blocks_per_key:
            raise UsageError(f"kvtier: {self.num_pages} host pages hold no offloaded block of {blocks_per_key} "
                             "vLLM blocks; raise host_bytes")
        self.format, self.pools, self.blocks_per_key = fmt, list(pools), blocks_per_key
        self.storage, self.key_prefix, self.timeout_s = storage, key_prefix, timeout_s
        self._owns_storage = owns_storage  # False: the client is shared (one per group) and closed by its owner
        self._table = PageTable(self.num_pages, blocks_per_key, events)
        self.stats = self._table.stats
        self.stats.update(bytes_read=0, bytes_written=0, read_time=0.0, write_time=0.0, probed=0)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a probe or a write finishes
        self._inflight = 0                            # probes sent and not finished
        # keys that answered HIT this scheduler step: vLLM pins them (prepare_load) later in
        # the step, so a fetch finishing on an I/O thread meanwhile must not evict them
        self._answered: set[bytes] = set()
        self._writing = 0                             # write jobs staged and not finished
        self._delays: list[float] = []                # seconds from a probe's send to storage's answer
        # NOTE: ranks holding the same heads (replicated KV, MLA) share one staging pool
        # and one storage object; each distinct shard is read and written once.
        self._groups: dict = {}
        for rank, pool in enumerate(self.pools):
            self._groups.setdefault(pool.spec, []).append(rank)
        #: bytes of one vLLM block over the distinct shards: what storage moves for it
        self.shard_page_bytes = sum(self.pools[ranks[0]].page_bytes for ranks in self._groups.values())
        self._reader = self._writer = self._stager = None
        self._guard: StorageGuard | None = None
        if storage is not None:
            default = min(self.num_pages // 4, MAX_DEFAULT_BUFFER // self.shard_page_bytes)
            self._staging = StagingBuffer(self.pools, self._groups, max(buffer_pages or default, blocks_per_key))
            self._guard = StorageGuard(storage, _Errors(self.stats, self._lock), timeout_s, concurrency=io_threads)
            self._reader = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-fetch")
            self._writer = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-write")
            self._stager = ThreadPoolExecutor(1, thread_name_prefix="kvtier-stage")  # never waits on storage

    @property
    def pool(self) -> HostKVPool:
        """Rank 0's pool."""
        return self.pools[0]

    def storage_keys(self, key: bytes) -> list[str]:
        """The storage objects of one offloaded block: one per vLLM block."""
        base = f"{self.key_prefix}/{key.hex()}"
        return [base] if self.blocks_per_key == 1 else [f"{base}.{j}" for j in range(self.blocks_per_key)]

    def _expand(self, keys: Sequence[bytes]) -> list[str]:
        return [s for k in keys for s in self.storage_keys(k)]

    @staticmethod
    def _slots(pool: HostKVPool, pages: np.ndarray) -> torch.Tensor:
        return page_slots(torch.from_numpy(np.asarray(pages, dtype=np.int64)), pool.page_size)

    # -- what is where ----------------------------------------------------------------------
    def new_probe(self) -> Probe:
        return Probe()

    def positions(self, keys: Sequence[bytes]) -> np.ndarray:
        """The group position of each key: 0 (one tier serves one group)."""
        return np.zeros(len(keys), dtype=np.int64)

    def lookup(self, key: bytes, probe: Probe | None = None) -> Lookup:
        """Where ``key`` is. With storage, unknown keys are queued on ``probe`` (sent by
        :meth:`send`) and answer RETRY until storage answers or ``timeout_s`` passes."""
        now = time.monotonic()
        with self._lock:
            entry = self._table.get(key)
            if entry is not None:
                if entry.state is PageState.READY:
                    self._answered.add(key)
                    return Lookup.HIT
                if self._table.is_orphan(key):
                    return Lookup.MISS  # its store was dropped by a reset: it never completes
                return Lookup.PENDING
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

    def source(self, key: bytes) -> Source:
        """Where a READY block came from: stored by vLLM, or read from storage."""
        with self._lock:
            entry = self._table.get(key)
            return entry.source if entry is not None else Source.HOST

    def free_keys(self) -> int:
        """Offloaded blocks that fit in the free host pages (no eviction)."""
        with self._lock:
            return self._table.free_keys()

    def busy(self) -> bool:
        """Whether work is in flight that needs the engine to keep stepping."""
        with self._lock:
            return self._inflight > 0 or self._table.has_orphans

    def lru_order(self) -> list[bytes]:
        """READY keys, least recently used first (what eviction takes next)."""
        with self._lock:
            return self._table.lru_order()

    def snapshot(self) -> dict:
        """A copy of :attr:`stats` (counters of blocks, bytes, seconds and errors)."""
        with self._lock:
            return dict(self.stats)

    def take_delays(self) -> list[float]:
        """Seconds each storage look-up took, from its send to storage's answer, since
        the last call."""
        with self._lock:
            out, self._delays = self._delays, []
            return out

    def usage(self) -> dict[str, float]:
        """Fractions of the host pages in use, pinned by stores and pinned by loads."""
        with self._lock:
            return self._table.usage()

    def pins(self) -> int:
        """Loads and storage copies in flight that hold host pages (``PageTable.pins``)."""
        with self._lock:
            return self._table.pins()

    # -- the manager's calls -------------------------------------------------------------------
    def reserve(self, keys: Iterable[bytes]) -> Reservation | None:
        """Pages for the keys not held yet, evicting least recently used READY blocks
        (never one of ``keys``); ``None`` (and nothing changed) when they do not fit."""
        with self._lock:
            return self._table.reserve(keys)

    def commit(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Stores vLLM finished: READY (then copied to storage), or dropped on failure."""
        with self._lock:
            ready = self._table.commit(list(keys), success)
            job = self._stage_writes([(k, e) for k, e in ready if not e.in_storage]) if self._writer else None
        if job:
            self._stager.submit(self._stage_out, job)

    def pin(self, keys: Sequence[bytes]) -> np.ndarray:
        """Host pages of READY ``keys`` (``blocks_per_key`` each, key order), protected
        from eviction until :meth:`unpin`."""
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
            self._answered.clear()

    def take_events(self) -> list[tuple[list[bytes], bool]]:
        with self._lock:
            return self._table.take_events()

    # -- storage writes ----------------------------------------------------------------------------
    def _stage_writes(self, items: list[tuple[bytes, Entry]]) -> list | None:
        """Staging pages for as many of ``items`` as fit (the rest are dropped, counted),
        each entry pinned until its pages are staged. Under the lock."""
        per = self.blocks_per_key
        staging = self._staging.take(len(items), per)
        fits = len(staging) // per
        self.stats["write_dropped"] += len(items) - fits
        if fits == 0:
            return None
        job = []
        for i, (k, entry) in enumerate(items[:fits]):
            entry.copies += 1
            job.append((k, entry, staging[i * per:(i + 1) * per]))
        self._writing += 1
        return job

    def _write_done(self, staging: np.ndarray) -> None:
        """A write job ended (under the lock): its staging pages go back."""
        self._staging.give(staging)
        self._writing -= 1
        self._idle.notify_all()

    def _stage_out(self, job: list[tuple[bytes, Entry, np.ndarray]]) -> None:
        """On the stage thread: copy the pages into staging, unpin them, queue the write."""
        host = np.concatenate([e.pages for _, e, _ in job])
        staging = np.concatenate([s for _, _, s in job])
        try:
            self._staging.stage_out(staging, host)
        except Exception:
            log.exception("kvtier: staging a storage write failed; its blocks stay in the host tier only")
            with self._lock:
                for _, entry, _ in job:
                    entry.copies -= 1
                self.stats["write_failed"] += len(job)
                self._write_done(staging)
            return
        with self._lock:
            for _, entry, _ in job:
                entry.copies -= 1
        self._writer.submit(self._write, [k for k, _, _ in job], staging)

    def _write(self, keys: list[bytes], staging: np.ndarray) -> None:
        t0 = time.perf_counter()
        ok = np.ones(len(keys) * self.blocks_per_key, dtype=bool)
        try:
            storage_keys = self._expand(keys)
            for pool in self._staging.pools.values():
                ok &= np.array(self._guard.set_each(storage_keys, pool, self._slots(pool, staging)), dtype=bool)
        except Exception:  # a bug, not a storage fault (the guard takes those): the blocks stay host-only
            log.exception("kvtier: storage write failed")
            ok[:] = False
        per_key = ok.reshape(len(keys), self.blocks_per_key).all(axis=1)
        with self._lock:
            for k, good in zip(keys, per_key):
                entry = self._table.get(k)
                if entry is not None and good:
                    entry.in_storage = True
                self.stats["written" if good else "write_failed"] += 1
            self.stats["bytes_written"] += int(per_key.sum()) * self.blocks_per_key * self.shard_page_bytes
            self.stats["write_time"] += time.perf_counter() - t0
            self._write_done(staging)

    # -- storage reads -------------------------------------------------------------------------------
    def send(self, probe: Probe) -> None:
        """Start the storage look-up of ``probe``'s queued keys on a thread."""
        with self._lock:
            keys, probe.queued = probe.queued, []
            if not keys or self._reader is None:
                return
            sent = time.monotonic()
            probe.sent.update(dict.fromkeys(keys, sent + self.timeout_s))
            self._inflight += 1
        self._reader.submit(self._fetch, probe, keys, sent)

    def yield_to_io(self, budget_s: float) -> None:
        """Wait up to ``budget_s`` for running probes to finish.

        NOTE: a scheduler with nothing to do but wait for storage spins through empty
        steps holding the GIL, and I/O threads that need the GIL for every object then
        crawl (measured here: a 100-block fetch took 0.1 s to over 2 s). Waiting on a
        condition releases the GIL; the budget bounds what a step can lose."""
        with self._lock:
            if self._inflight:
                self._idle.wait(budget_s)

    def _fetch(self, probe: Probe, keys: list[bytes], sent: float) -> None:
        staging = None
        try:
            # NOTE: per key, not the longest present prefix: a sliding window group's keys
            # come from the end of the request backwards, and any of them may be missing
            present = np.array(self._guard.exists_each(self._expand(keys)), dtype=bool)
            held = present.reshape(len(keys), self.blocks_per_key).all(axis=1)
            with self._lock:
                self.stats["probed"] += len(keys)
                wanted = [k for k, ok in zip(keys, held) if ok and self._table.get(k) is None]
                staging = self._staging.take(len(wanted), self.blocks_per_key)
                fits = len(staging) // self.blocks_per_key
                self.stats["fetch_dropped"] += len(wanted) - fits
                wanted = wanted[:fits]
            if wanted:
                self._read(wanted, staging)
        except Exception:  # a bug, not a storage fault (the guard takes those): misses
            log.exception("kvtier: storage look-up failed; its blocks count as misses")
        finally:
            with self._lock:
                if staging is not None:
                    self._staging.give(staging)
                probe.missing.update(k for k in keys if self._table.get(k) is None)
                if len(self._delays) < MAX_DELAYS:
                    self._delays.append(time.monotonic() - sent)
                self._inflight -= 1
                self._idle.notify_all()

    def _read(self, keys: list[bytes], staging: np.ndarray) -> None:
        """Read ``keys`` into ``staging``, then the complete ones into new READY host pages."""
        t0 = time.perf_counter()
        per = self.blocks_per_key
        ok = np.ones(len(keys) * per, dtype=bool)
        storage_keys = self._expand(keys)
        for pool in self._staging.pools.values():
            ok &= np.array(self._guard.get(storage_keys, pool, self._slots(pool, staging)), dtype=bool)
        good = ok.reshape(len(keys), per).all(axis=1)
        with self._lock:
            self.stats["fetch_failed"] += int((~good).sum())
            self.stats["read_time"] += time.perf_counter() - t0
            filling = self._start_filling([k for k, g in zip(keys, good) if g])
        if not filling:
            return
        at = {k: i for i, k in enumerate(keys)}
        src = np.concatenate([staging[at[k] * per:(at[k] + 1) * per] for k, _ in filling])
        dst = np.concatenate([e.pages for _, e in filling])
        try:
            self._staging.stage_in(dst, src)
        except Exception:
            with self._lock:  # roll back: no FETCHING entry outlives its fetch
                for k, _ in filling:
                    self._table.drop(k)
                self.stats["fetch_failed"] += len(filling)
            raise
        with self._lock:
            for k, entry in filling:
                self._table.make_ready(k)
            self._table.stored([k for k, _ in filling])
            self.stats["fetched"] += len(filling)
            self.stats["bytes_read"] += len(filling) * per * self.shard_page_bytes

    def _start_filling(self, keys: list[bytes]) -> list[tuple[bytes, Entry]]:
        """FETCHING entries for the longest prefix of ``keys`` (not held yet) that fits
        in the host pages; the rest are dropped (counted). Under the lock."""
        wanted = [k for k in keys if self._table.get(k) is None]
        n = len(wanted)
        got = self._table.allocate(n, protect=self._answered)
        while got is None:
            n -= 1
            got = self._table.allocate(n, protect=self._answered)
        self.stats["fetch_dropped"] += len(wanted) - n
        per = self.blocks_per_key
        out = []
        for i, k in enumerate(wanted[:n]):
            entry = Entry(got[0][i * per:(i + 1) * per], PageState.FETCHING, Source.STORAGE, in_storage=True)
            self._table.add(k, entry)
            out.append((k, entry))
        return out

    # -- lifecycle ------------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the storage writes and probes started so far have finished;
        whether they did within ``timeout`` seconds."""
        with self._lock:
            return self._idle.wait_for(lambda: self._inflight == 0 and self._writing == 0, timeout)

    def close(self) -> None:
        """Finish storage writes in flight, then release the storage client."""
        for ex in (self._reader, self._stager, self._writer):
            if ex is not None:
                ex.shutdown(wait=True)
        if self._guard is not None:
            self._guard.close()
        if self.storage is not None and self._owns_storage:
            self.storage.close()


__all__ = ["HostTier", "Lookup", "PageState", "Probe", "Reservation"]
