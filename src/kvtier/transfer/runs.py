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


def coalesce(dst_pages: torch.Tensor | np.ndarray, src_pages: torch.Tensor | np.ndarray) -> Runs:
    """Merge neighbouring page pairs ``(d, s), (d + 1, s + 1)`` into one run.

    Both inputs are ``(n,)`` int64 page numbers of equal length (tensors or numpy
    arrays); the order of
    pairs is kept. Allocators hand out consecutive pages, so real transfers
    often collapse to a few runs; a random permutation stays one run per page.
    """
    # numpy: a few µs for what costs ~50 µs in small torch ops, once per per-layer load
    d, s = host_pages(dst_pages), host_pages(src_pages)
    n = len(d)
    if n == 0:
        return Runs([], [], [])
    if n <= _SMALL_PAGES:  # NOTE: a plain loop: numpy's five calls cost ~15 µs whatever n is
        return _coalesce_small(d.tolist(), s.tolist())
    starts = np.flatnonzero(np.concatenate(([True], (np.diff(d) != 1) | (np.diff(s) != 1))))
    lengths = np.diff(starts, append=n)
    return Runs(d[starts].tolist(), s[starts].tolist(), lengths.tolist())


def host_pages(pages: torch.Tensor | np.ndarray) -> np.ndarray:
    """Page numbers (a tensor on any device, or a numpy array) as an int64 numpy array,
    the array itself where it is one already."""
    if isinstance(pages, np.ndarray):
        return pages if pages.dtype == np.int64 else pages.astype(np.int64)
    return np.asarray(pages.cpu().numpy(), dtype=np.int64)


#: Page pairs up to which :func:`coalesce` walks Python lists (a sliding window's few pages)
_SMALL_PAGES = 32


def _coalesce_small(d: list[int], s: list[int]) -> Runs:
    dst, src, length = [d[0]], [s[0]], [1]
    for a, b in zip(d[1:], s[1:]):
        if a == dst[-1] + length[-1] and b == src[-1] + length[-1]:
            length[-1] += 1
        else:
            dst.append(a), src.append(b), length.append(1)
    return Runs(dst, src, length)
