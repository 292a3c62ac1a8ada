"""Page allocator handing out whole, aligned pages as token slots."""

from __future__ import annotations

import numpy as np
import torch

from .._checks import non_negative_int
from ..errors import IntegrityError, UsageError
from .common import check_sizes
from .indices import distinct_pages, first_flagged, page_numbers, slot_tensor


#: up to this many pages, an alloc or free marks them one by one (see ``_flags``)
_FEW = 16


class PageAllocator:
    """Free list over ``num_pages`` pages of ``page_size`` token slots each.

    ``alloc`` returns the lowest-numbered free pages first on a fresh allocator,
    then reuses freed pages in the order they were freed.
    """

    def __init__(self, size: int, page_size: int, index_device: torch.device = torch.device("cpu")) -> None:
        check_sizes(size, page_size)
        self.size = size
        self.page_size = page_size
        self._devices = tuple({torch.device("cpu"), index_device})
        pages = size // page_size
        # NOTE: the free list is a FIFO in a fixed ring of ``pages`` int64s: ``_count``
        # free page ids start at ``_head`` and wrap. It never holds more than every page,
        # so an alloc or a free copies only the pages it moves (a concatenated tensor
        # copied the whole list on every free).
        self._ring = np.arange(pages, dtype=np.int64)
        self._head = 0
        self._count = pages
        # NOTE: one flag per page, seen two ways: ``_in_use`` (numpy) for many pages at a
        # time, ``_flags`` (the same bytes) for a few, where indexing a bytearray from
        # Python costs a fraction of a numpy call's fixed cost
        self._flags = bytearray(pages)
        self._in_use = np.frombuffer(self._flags, dtype=bool) if pages else np.zeros(0, dtype=bool)

    def available_size(self) -> int:
        """Free token slots."""
        return self._count * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` token slots in whole pages, as ``(n,)`` int64; ``None`` when too few are free."""
        non_negative_int("alloc", n)
        if n % self.page_size:
            raise UsageError(f"alloc({n}): not a multiple of page_size {self.page_size}")
        need = n // self.page_size
        if need > self._count:
            return None
        pages = self._take(need)
        self._in_use[pages] = True
        return slot_tensor(pages, self.page_size)

    def alloc_pages(self, k: int) -> np.ndarray | None:
        """``k`` whole pages as page numbers (int64 numpy); ``None`` when too few are free."""
        non_negative_int("alloc_pages", k)
        if k > self._count:
            return None
        pages = self._take(k)
        if k <= _FEW:
            flags = self._flags
            for p in pages.tolist():
                flags[p] = 1
        else:
            self._in_use[pages] = True
        return pages

    def free_pages(self, pages: np.ndarray) -> None:
        """Return pages by number (int64 numpy, distinct); :class:`UsageError` for one out
        of range or named twice, :class:`IntegrityError` for one not allocated (a double
        free)."""
        if pages.size == 0:
            return
        if pages.dtype != np.int64:
            pages = pages.astype(np.int64)
        # NOTE: a sliding group frees a window's few pages at a time: checked and cleared
        # over a list and the bytearray; more pages (an eviction's) in one pass that checks
        # both ends and repeats (distinct_pages)
        n = self._in_use.size
        if pages.size <= _FEW:
            ids, flags = pages.tolist(), self._flags
            if min(ids) < 0 or max(ids) >= n:
                raise UsageError(f"free_pages: page numbers must be in [0, {n})")
            if len(set(ids)) != len(ids):
                raise UsageError(f"free_pages: a page named twice in {ids}")
            if not all([flags[p] for p in ids]):
                raise IntegrityError(f"free_pages: pages {[p for p in ids if not flags[p]][:8]} are not allocated "
                                     "(a double free)")
            for p in ids:
                flags[p] = 0
        else:
            if not distinct_pages(pages, n):  # refused, or not judged: numpy's checks (and words)
                if int(pages.view(np.uint64).max()) >= n:
                    raise UsageError(f"free_pages: page numbers must be in [0, {n})")
                ordered = np.sort(pages)
                twice = ordered[1:][ordered[1:] == ordered[:-1]]
                if twice.size:
                    raise UsageError(f"free_pages: pages {twice[:8].tolist()} named twice")
            used = self._in_use[pages]
            if np.count_nonzero(used) != pages.size:
                raise IntegrityError(f"free_pages: pages {pages[~used][:8].tolist()} are not allocated "
                                     "(a double free)")
            self._in_use[pages] = False
        self._put(pages)

    def release(self, pages: np.ndarray) -> None:
        """:meth:`free_pages` for pages the caller has checked under the same lock: in
        range, distinct and handed out (say by :meth:`allocated`). Nothing is checked
        again: a wrong page corrupts the free list."""
        if pages.size:
            self._in_use[pages] = False
            self._put(pages)

    def allocated(self, page_ids: torch.Tensor | np.ndarray) -> np.ndarray:
        """``(n,)`` bool numpy array: which of the (valid) ``page_ids`` (a tensor or numpy
        array) are handed out."""
        return self._in_use[np.asarray(page_ids, dtype=np.int64)]

    def first_free(self, pages: np.ndarray, start: int = 0) -> int:
        """The index of the first of the (valid) int64 page numbers ``pages[start:]`` that
        is not handed out, or -1."""
        return first_flagged(self._in_use, pages, start, False)

    def free(self, indices: torch.Tensor) -> None:
        """Return whole pages; :class:`UsageError` for slots that are not whole pages of
        this allocator, :class:`IntegrityError` for pages not allocated (a double free)."""
        pages = page_numbers(indices, page_size=self.page_size, size=self.size, what="free indices",
                             allowed_devices=self._devices, unique=True)
        if pages.size == 0:
            return
        not_used = pages[~self._in_use[pages]]
        if not_used.size:
            raise IntegrityError(f"free: pages starting at slots {(not_used[:8] * self.page_size).tolist()} are "
                                 "not allocated (a double free)")
        self._in_use[pages] = False
        self._put(pages)

    def _take(self, k: int) -> np.ndarray:
        """The ``k`` oldest free page ids (a copy), removed from the ring."""
        ring, start = self._ring, self._head
        end = start + k
        if end <= ring.size:
            pages = ring[start:end].copy()
        else:
            pages = np.concatenate((ring[start:], ring[:end - ring.size]))
        self._head = end % ring.size if ring.size else 0
        self._count -= k
        return pages

    def _put(self, pages: np.ndarray) -> None:
        """Append ``pages`` behind the free ones (the caller checked they were in use)."""
        ring, k = self._ring, pages.size
        tail = (self._head + self._count) % ring.size
        first = min(k, ring.size - tail)
        if first == k:
            ring[tail:tail + k] = pages
        else:  # it wraps
            ring[tail:] = pages[:first]
            ring[:k - first] = pages[first:]
        self._count += k
