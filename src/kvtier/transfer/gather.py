"""Batched gather/scatter copies: a few large index ops instead of one copy per run.

``dst.index_copy_(0, dst_pages, src.index_select(0, src_pages))`` over the page
axis of the canonical views, in chunks that bound the staging memory. It moves
every byte twice (into staging, then out), but its cost no longer grows with the
number of runs, so it wins when runs are small (small pages, one layer at a time).
Device-agnostic torch: on CUDA both ops are single kernels.
"""

from __future__ import annotations

import torch

from .copy import int_view

#: Staging per index op. Small enough to stay in cache between the gather and the
#: scatter, and to be reused rather than faulted in afresh for every chunk.
CHUNK_BYTES = 2 << 20


def gather_pages(dst: torch.Tensor, src: torch.Tensor, dst_pages: torch.Tensor, src_pages: torch.Tensor) -> None:
    """``dst[dst_pages[i]] = src[src_pages[i]]`` along axis 0 (pages), for all ``i``.

    ``dst_pages`` must not repeat (a destination is written once); ``src_pages`` may.
    """
    n = dst_pages.numel()
    if n == 0:
        return
    # NOTE: as same-width ints, so that every dtype works (the CPU has no index ops for fp8)
    dst, src = int_view(dst), int_view(src)
    page_bytes = src[0].numel() * src.element_size()
    step = max(1, CHUNK_BYTES // max(page_bytes, 1))
    dst_pages, src_pages = dst_pages.to(dst.device), src_pages.to(src.device)
    staging = torch.empty((min(step, n), *src.shape[1:]), dtype=src.dtype, device=src.device)
    for start in range(0, n, step):
        chunk = staging[:min(step, n - start)]
        torch.index_select(src, 0, src_pages[start:start + step], out=chunk)
        dst.index_copy_(0, dst_pages[start:start + step], chunk.to(dst.device))
