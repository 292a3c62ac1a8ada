"""Page allocator handing out whole, aligned pages as token slots."""

from __future__ import annotations

import torch

from .indices import page_slots, page_starts


class PageAllocator:
    """Free list over ``num_pages`` pages of ``page_size`` token slots each.

    ``alloc`` returns the lowest-numbered free pages first on a fresh allocator,
    then reuses freed pages in the order they were freed.
    """

    def __init__(self, size: int, page_size: int, index_device: torch.device = torch.device("cpu")) -> None:
        assert size % page_size == 0, f"size {size} not a multiple of page_size {page_size}"
        self.size = size
        self.page_size = page_size
        self._devices = tuple({torch.device("cpu"), index_device})
        self._free = torch.arange(size // page_size, dtype=torch.int64)
        self._in_use = torch.zeros(size // page_size, dtype=torch.bool)

    def available_size(self) -> int:
        """Free token slots."""
        return self._free.numel() * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` token slots in whole pages, as ``(n,)`` int64; ``None`` when too few are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"alloc needs a non-negative int, got {n!r}")
        if n % self.page_size:
            raise ValueError(f"alloc({n}): not a multiple of page_size {self.page_size}")
        need = n // self.page_size
        if need > self._free.numel():
            return None
        pages, self._free = self._free[:need], self._free[need:]
        self._in_use[pages] = True
        return page_slots(pages, self.page_size)

    def allocated(self, page_ids: torch.Tensor) -> torch.Tensor:
        """``(n,)`` bool: which of the (valid) ``page_ids`` are handed out."""
        return self._in_use[page_ids]

    def free(self, indices: torch.Tensor) -> None:
        """Return whole pages; ``ValueError`` for slots that are not allocated (double free)."""
        pages = page_starts(indices, page_size=self.page_size, size=self.size, what="free indices",
                            allowed_devices=self._devices, unique=True)
        if pages.numel() == 0:
            return
        not_used = pages[~self._in_use[pages]]
        if not_used.numel():
            raise ValueError(
                f"free: pages starting at slots {(not_used[:8] * self.page_size).tolist()} are not allocated"
            )
        self._in_use[pages] = False
        self._free = torch.cat([self._free, pages])
