"""Which vLLM block sits in which host page, in what state, and the LRU over them.

Page states::

    (none) --reserve--> STORING --commit(ok)--> READY <--fetched-- FETCHING <--fetching-- (none)
                           \\--commit(fail)--> (none)       READY --evict/reset--> (none)

Only READY pages without pins (a load into vLLM, or a copy to storage, in flight)
are evicted. Not thread-safe: :class:`~.tier.HostTier` calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, NamedTuple, Sequence

import torch

from ...pools import HostKVPool
from ...pools.indices import page_slots

#: Scheduler steps after a reset before pages that vLLM's dropped jobs may still
#: copy into are freed (vLLM flushes those jobs at the next step).
ORPHAN_STEPS = 2


class PageState(Enum):
    STORING = "storing"    # reserved for a store from vLLM, not readable yet
    READY = "ready"        # readable; in the LRU
    FETCHING = "fetching"  # being read from storage


@dataclass
class Page:
    page: int
    state: PageState
    loads: int = 0         # loads into vLLM in flight
    writes: int = 0        # copies to storage in flight
    in_storage: bool = False
    deadline: float = 0.0  # FETCHING: after this, look-ups stop waiting for it

    @property
    def pins(self) -> int:
        return self.loads + self.writes


class Reservation(NamedTuple):
    keys: list[bytes]      # keys vLLM must copy, in the order given
    pages: list[int]       # their host pages
    evicted: list[bytes]   # keys evicted to make room


class PageTable:
    """Keys -> host pages of ``pool`` (one page per vLLM block), with an LRU of READY keys."""

    def __init__(self, pool: HostKVPool) -> None:
        self.pool = pool
        self._pages: dict[bytes, Page] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._orphans: dict[bytes, int] = {}                  # key -> steps left, after a reset
        self.stats = dict.fromkeys(("stored", "loaded", "evicted", "fetched", "fetch_failed", "written",
                                    "write_failed", "probe_timeouts"), 0)

    def get(self, key: bytes) -> Page | None:
        return self._pages.get(key)

    def slots(self, pages: Sequence[int]) -> torch.Tensor:
        """Token slots of ``pages`` (what the pool and storage take)."""
        return page_slots(torch.as_tensor(list(pages), dtype=torch.int64), self.pool.page_size)

    # -- stores from vLLM ------------------------------------------------------------------
    def reserve(self, keys: Iterable[bytes]) -> Reservation | None:
        """STORING pages for the keys not held yet; ``None`` (nothing changed) if they do not fit."""
        new = [k for k in dict.fromkeys(keys) if k not in self._pages]
        got = self.allocate(len(new))
        if got is None:
            return None
        pages, evicted = got
        for k, p in zip(new, pages):
            self._pages[k] = Page(p, PageState.STORING)
        return Reservation(new, pages, evicted)

    def commit(self, keys: Iterable[bytes], success: bool) -> list[tuple[bytes, Page]]:
        """STORING pages of ``keys`` become READY (or are dropped); returns the new READY ones."""
        ready = []
        for k in keys:
            page = self._pages.get(k)
            if page is None or page.state is not PageState.STORING or k in self._orphans:
                continue
            if not success:
                self.drop(k)
                continue
            self.make_ready(k)
            self.stats["stored"] += 1
            ready.append((k, page))
        return ready

    def make_ready(self, key: bytes) -> None:
        self._pages[key].state = PageState.READY
        self._lru[key] = None

    # -- loads into vLLM ----------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of READY ``keys``, each pinned once more (a load is a use: MRU)."""
        bad = [k.hex()[:16] for k in keys if k not in self._pages or self._pages[k].state is not PageState.READY]
        if bad:
            raise ValueError(f"kvtier: load of blocks that are not ready: {bad[:4]}")
        for k in keys:
            self._pages[k].loads += 1
            self._lru.move_to_end(k)
        self.stats["loaded"] += len(keys)
        return [self._pages[k].page for k in keys]

    def unpin(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            page = self._pages.get(k)
            if page is not None and page.loads:  # else a reset forgot it: vLLM dropped that job
                page.loads -= 1

    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            if k in self._lru:
                self._lru.move_to_end(k)

    def lru_order(self) -> list[bytes]:
        return list(self._lru)

    # -- resets --------------------------------------------------------------------------------
    def reset(self) -> list[bytes]:
        """Forget every page; returns the keys dropped now.

        vLLM discards the jobs in flight at a reset: their ``complete_*`` never comes.
        Pages those jobs may still copy into (STORING, or pinned) become unreadable at
        once and are freed after ``ORPHAN_STEPS`` :meth:`tick` calls, and after their
        copy to storage. FETCHING pages are left to their fetch."""
        gone = []
        for k, page in list(self._pages.items()):
            if page.state is PageState.FETCHING:
                continue
            if page.state is PageState.STORING or page.pins:
                self._lru.pop(k, None)
                page.state = PageState.STORING
                self._orphans[k] = ORPHAN_STEPS
            else:
                self.drop(k)
                gone.append(k)
        return gone

    def tick(self) -> None:
        """One scheduler step ended: free the orphans whose time has come."""
        for k, steps in list(self._orphans.items()):
            if steps > 1 or self._pages[k].writes:
                self._orphans[k] = max(steps - 1, 1)
            else:
                del self._orphans[k]
                self.drop(k)

    @property
    def has_orphans(self) -> bool:
        return bool(self._orphans)

    # -- pages -------------------------------------------------------------------------------------
    def allocate(self, n: int) -> tuple[list[int], list[bytes]] | None:
        """``n`` free pages, evicting LRU pages without pins; None if they cannot be had
        (then nothing is evicted)."""
        if n == 0:
            return [], []
        free = self.pool.available_size() // self.pool.page_size
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
            self.drop(k)
        self.stats["evicted"] += len(victims)
        slots = self.pool.alloc(n * self.pool.page_size)
        assert slots is not None, f"{n} pages should be free after evicting {len(victims)}"
        return (slots[::self.pool.page_size] // self.pool.page_size).tolist(), victims

    def add(self, key: bytes, page: Page) -> None:
        assert key not in self._pages, f"page of {key.hex()[:16]} added twice"
        self._pages[key] = page

    def drop(self, key: bytes) -> None:
        page = self._pages.pop(key)
        self._lru.pop(key, None)
        self.pool.free(self.slots([page.page]))
