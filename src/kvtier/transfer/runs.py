"""Coalescing page pairs into runs that are consecutive on both sides."""

from __future__ import annotations

from typing import NamedTuple

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
    step = (dst_pages[1:] - dst_pages[:-1] == 1) & (src_pages[1:] - src_pages[:-1] == 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), (~step).nonzero().flatten() + 1])
    lengths = torch.diff(starts, append=torch.tensor([n]))
    return Runs(dst_pages[starts].tolist(), src_pages[starts].tolist(), lengths.tolist())
