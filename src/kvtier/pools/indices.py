"""Validation of token-slot index tensors that must come in whole, aligned pages."""

from __future__ import annotations

import numpy as np
import torch

_INDEX_DTYPES = (torch.int64, torch.int32)


def page_starts(indices: torch.Tensor, *, page_size: int, size: int, what: str,
                allowed_devices: tuple[torch.device, ...] = (torch.device("cpu"),),
                unique: bool = False) -> torch.Tensor:
    """Check that ``indices`` are whole pages of token slots and return the page numbers.

    ``indices``: ``(n,)`` int64/int32 token slots, ``n % page_size == 0``; each page's slots
    are consecutive and start at a multiple of ``page_size``; all lie in ``[0, size)``.
    Returns ``(n // page_size,)`` int64 page numbers on the CPU. Raises ``ValueError``
    naming ``what`` and the offending numbers; never modifies anything.
    """
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor of int64 token slots, got {type(indices).__name__}")
    if indices.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{what} must have dtype int64 or int32, got {indices.dtype}")
    if indices.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(indices.shape)}")
    if indices.device not in allowed_devices:
        raise ValueError(f"{what} is on {indices.device}; expected one of {[str(d) for d in allowed_devices]}")
    n = indices.numel()
    if n % page_size:
        raise ValueError(f"{what} holds {n} slots, not a multiple of page_size {page_size}")
    idx = indices.to(device="cpu", dtype=torch.int64)
    if n == 0:
        return idx
    # numpy: less per-op overhead than torch on these small arrays
    pages = idx.numpy().reshape(-1, page_size)
    starts = pages[:, 0]
    bad = np.flatnonzero(starts % page_size)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{what}: page {i} starts at slot {int(starts[i])}, not a multiple of page_size {page_size}")
    # NOTE: aligned starts in [0, size) and consecutive slots keep every slot in range,
    # so the range check only needs the starts (a page count, not a slot count).
    lo, hi = int(starts.min()), int(starts.max()) + page_size - 1
    if lo < 0 or hi >= size:
        lo, hi = int(idx.min()), int(idx.max())
        raise ValueError(f"{what} has slots in [{lo}, {hi}], outside the pool's [0, {size})")
    if page_size > 1:
        steps = np.diff(pages, axis=1)
        if not (steps == 1).all():
            i = int(np.flatnonzero((steps != 1).any(axis=1))[0])
            raise ValueError(f"{what}: page {i} slots {pages[i].tolist()} are not consecutive from {int(starts[i])}")
    page_ids = starts // page_size
    if unique and page_ids.size > 1:
        ordered = np.sort(page_ids)
        if (ordered[1:] == ordered[:-1]).any():
            raise ValueError(f"{what} names the same page more than once; a destination page can be written once "
                             "per call")
    return torch.from_numpy(page_ids)


def page_slots(page_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page numbers -> their token slots, ``(len(page_ids) * page_size,)`` int64."""
    return (page_ids[:, None] * page_size + torch.arange(page_size)).reshape(-1)
