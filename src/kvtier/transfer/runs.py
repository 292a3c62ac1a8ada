"""Coalescing page pairs into runs that are consecutive on both sides."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class Runs(NamedTuple):
    """``dst[dst_start[i] : dst_start[i] + length[i]] <- src[src_start[i] : ...]``, in pages."""

    dst_start: list[int]
    src_start: list[int]
    length: list[int]


def coalesce(dst_pages: torch.Tensor, src_pages: torch.Tensor) -> Runs:
    """Merge neighbouring page pairs ``(d, s), (d + 1, s + 1)`` into one run.

    Both inputs are ``(n,)`` int64 page numbers of equal length; the order of
    pairs is kept. Allocators hand out consecutive pages, so real transfers
    often collapse to a few runs; a random permutation stays one run per page.
    """
    n = dst_pages.numel()
    if n == 0:
        return Runs([], [], [])
    # numpy: a few µs for what costs ~50 µs in small torch ops, once per per-layer load
    d, s = dst_pages.cpu().numpy(), src_pages.cpu().numpy()
    starts = np.flatnonzero(np.concatenate(([True], (np.diff(d) != 1) | (np.diff(s) != 1))))
    lengths = np.diff(starts, append=n)
    return Runs(d[starts].tolist(), s[starts].tolist(), lengths.tolist())
