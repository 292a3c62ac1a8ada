"""Which vLLM block sits in which host pages, in what state, and the LRU over them.

One entry per vLLM offload key (block hash + group). An offloaded block may span
several vLLM blocks (``blocks_per_chunk``): its entry holds that many host pages, one
per vLLM block, not necessarily consecutive. Entry states::

    (none) --reserve--> STORING --commit(ok)--> READY <--filled-- FETCHING <--fetching-- (none)
                           \\--commit(fail)--> (none)       READY --evict/reset--> (none)

STORING and FETCHING entries are not readable yet (look-ups answer HIT_PENDING);
READY entries are, and sit in the LRU. Only READY entries without pins (a load into
vLLM, or a copy out to storage, in flight) are evicted, and never one of the keys of
the call that needs the room. Metadata only: the pages' bytes live in the workers'
pool files (:mod:`.region`). Not thread-safe: :class:`~.tier.HostTier` calls it under
its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, NamedTuple, Sequence

import numpy as np
import torch

from ...errors import IntegrityError, UsageError
from ...pools.allocator import PageAllocator

#: Scheduler steps after a reset before pages that vLLM's dropped jobs may still
#: copy into are freed (vLLM flushes those jobs at the next step).
ORPHAN_STEPS = 2


class PageState(Enum):
    STORING = "storing"    # reserved for a store from vLLM, not readable yet
    READY = "ready"        # readable; in the LRU
    FETCHING = "fetching"  # being filled from storage, not readable yet


class Source(Enum):
    HOST = "host"          # stored by vLLM into the host tier
    STORAGE = "storage"    # read from storage into the host tier, not loaded since


@dataclass
class Entry:
    pages: np.ndarray      # host page numbers, one per vLLM block of the offloaded block
    state: PageState
    source: Source = Source.HOST
    loads: int = 0         # loads into vLLM in flight
    copies: int = 0        # copies out to storage in flight
    in_storage: bool = False

    @property
    def pins(self) -> int:
        return self.loads + self.copies


class Reservation(NamedTuple):
    keys: list[bytes]      # keys vLLM must copy, in the order given
    pages: np.ndarray      # their host pages, ``blocks_per_key`` per key, in key order
    evicted: list[bytes]   # keys evicted to make room


class PageTable:
    """Keys -> host pages (``blocks_per_key`` of the ``num_pages``), with an LRU of READY
    keys and, when ``events`` is on, the stored/removed notices vLLM's KV events carry."""

    def __init__(self, num_pages: int, blocks_per_key: int = 1, events: bool = False) -> None:
        self.num_pages, self.blocks_per_key = num_pages, blocks_per_key
        self._free = PageAllocator(num_pages, 1)
        self._entries: dict[bytes, Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._orphans: dict[bytes, int] = {}                  # key -> steps left, after a reset
        self._events: list[tuple[list[bytes], bool]] | None = [] if events else None
        self._storing_pages = 0  # pages of STORING entries
        self._loading_pages = 0  # pages of entries with loads in flight
        self.stats = dict.fromkeys(("stored", "loaded", "evicted", "fetched", "fetch_failed", "written",
                                    "write_failed", "write_dropped", "fetch_dropped", "probe_timeouts"), 0)

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def free_keys(self) -> int:
        return self._free.available_size() // self.blocks_per_key

    # -- stores from vLLM ------------------------------------------------------------------
    def reserve(self, keys: Iterable[bytes]) -> Reservation | None:
        """STORING entries for the keys not held yet; ``None`` (nothing changed) if they
        do not fit. Keys of this call that are held already are never evicted for it."""
        keys = list(dict.fromkeys(keys))
        new = [k for k in keys if k not in self._entries]
        got = self.allocate(len(new), protect=keys)
        if got is None:
            return None
        pages, evicted = got
        per = self.blocks_per_key
        for i, k in enumerate(new):
            self._entries[k] = Entry(pages[i * per:(i + 1) * per], PageState.STORING)
        self._storing_pages += len(pages)
        return Reservation(new, pages, evicted)

    def commit(self, keys: Iterable[bytes], success: bool) -> list[tuple[bytes, Entry]]:
        """STORING entries of ``keys`` become READY (or are dropped); returns the new
        READY ones. Keys in any other state are left as they are."""
        ready = []
        for k in keys:
            entry = self._entries.get(k)
            if entry is None or entry.state is not PageState.STORING or k in self._orphans:
                continue
            if not success:
                self.drop(k)
                continue
            self.make_ready(k)
            self.stats["stored"] += 1
            ready.append((k, entry))
        self.stored([k for k, _ in ready])
        return ready

    def make_ready(self, key: bytes) -> None:
        entry = self._entries[key]
        if entry.state is PageState.STORING:
            self._storing_pages -= len(entry.pages)
        entry.state = PageState.READY
        self._lru[key] = None

    def stored(self, keys: list[bytes]) -> None:
        """``keys`` became readable in the host tier (a KV event)."""
        if keys:
            self._event(keys, removed=False)

    # -- loads into vLLM ----------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> np.ndarray:
        """Pages of READY ``keys`` (key order), each pinned once more (a load is a use: MRU)."""
        bad = [k.hex()[:16] for k in keys if k not in self._entries or self._entries[k].state is not PageState.READY]
        if bad:
            raise UsageError(f"kvtier: load of blocks that are not ready: {bad[:4]}")
        for k in keys:
            entry = self._entries[k]
            if entry.loads == 0:
                self._loading_pages += len(entry.pages)
            entry.loads += 1
            self._lru.move_to_end(k)
        self.stats["loaded"] += len(keys)
        return self.pages_of(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            entry = self._entries.get(k)
            if entry is not None and entry.loads:  # else a reset forgot it: vLLM dropped that job
                entry.loads -= 1
                if entry.loads == 0:
                    self._loading_pages -= len(entry.pages)
                entry.source = Source.HOST  # loaded once: now a host-tier block like any other

    def pages_of(self, keys: Sequence[bytes]) -> np.ndarray:
        if not keys:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self._entries[k].pages for k in keys])

    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            if k in self._lru:
                self._lru.move_to_end(k)

    def lru_order(self) -> list[bytes]:
        return list(self._lru)

    # -- resets --------------------------------------------------------------------------------
    def reset(self) -> list[bytes]:
        """Forget every entry; returns the keys dropped now.

        vLLM discards the jobs in flight at a reset: their ``complete_*`` never comes.
        Pages those jobs may still copy into (STORING, or pinned) become unreadable at
        once and are freed after ``ORPHAN_STEPS`` :meth:`tick` calls and after their
        copies to storage. FETCHING entries are left to their fetch."""
        gone = []
        for k, entry in list(self._entries.items()):
            if entry.state is PageState.FETCHING:
                continue
            if entry.state is PageState.STORING or entry.pins:
                self._lru.pop(k, None)
                if entry.state is not PageState.STORING:
                    self._storing_pages += len(entry.pages)
                entry.state = PageState.STORING
                self._orphans[k] = ORPHAN_STEPS
            else:
                self.drop(k)
                gone.append(k)
        return gone

    def tick(self) -> None:
        """One scheduler step ended: free the orphans whose time has come."""
        for k, steps in list(self._orphans.items()):
            if steps > 1 or self._entries[k].copies:
                self._orphans[k] = max(steps - 1, 1)
            else:
                del self._orphans[k]
                self.drop(k)

    def is_orphan(self, key: bytes) -> bool:
        return key in self._orphans

    @property
    def has_orphans(self) -> bool:
        return bool(self._orphans)

    # -- pages -------------------------------------------------------------------------------------
    def allocate(self, n: int, protect: Iterable[bytes] = ()) -> tuple[np.ndarray, list[bytes]] | None:
        """Pages for ``n`` keys, evicting LRU entries without pins and not in ``protect``;
        ``None`` if they cannot be had (then nothing is evicted)."""
        if n == 0:
            return np.zeros(0, dtype=np.int64), []
        need = n * self.blocks_per_key
        free = self._free.available_size()
        victims: list[bytes] = []
        if free < need:
            protected = set(protect)
            for k in self._lru:
                if self._entries[k].pins == 0 and k not in protected:
                    victims.append(k)
                    free += len(self._entries[k].pages)
                    if free >= need:
                        break
            if free < need:
                return None
        for k in victims:
            self.drop(k)
        if victims:
            self.stats["evicted"] += len(victims)
            self._event(victims, removed=True)
        return self._free.alloc(need).numpy(), victims

    def add(self, key: bytes, entry: Entry) -> None:
        if key in self._entries:
            raise IntegrityError(f"kvtier: pages of {key.hex()[:16]} added twice")
        self._entries[key] = entry

    def drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._lru.pop(key, None)
        if entry.state is PageState.STORING:
            self._storing_pages -= len(entry.pages)
        if entry.loads:
            self._loading_pages -= len(entry.pages)
        self._free.free(torch.from_numpy(entry.pages))

    def pins(self) -> int:
        """Loads into vLLM and copies out to storage in flight, over every entry: 0 at rest."""
        return sum(e.pins for e in self._entries.values())

    def usage(self) -> dict[str, float]:
        """Fractions of the pages: ``used`` (held by any entry), ``write`` (reserved
        for stores in flight), ``read`` (pinned by loads in flight)."""
        n = self.num_pages
        return {"used": 1 - self._free.available_size() / n, "write": self._storing_pages / n,
                "read": self._loading_pages / n}

    # -- events --------------------------------------------------------------------------------------
    def _event(self, keys: list[bytes], removed: bool) -> None:
        if self._events is not None:
            self._events.append((keys, removed))

    def take_events(self) -> list[tuple[list[bytes], bool]]:
        """``(keys, removed)`` notices since the last call, in order (an eviction comes
        before the store that takes its pages)."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out
