"""Best-of-N wall-clock timing and the machine's copy limit.

NOTE: every buffer a benchmark times is written first. Memory that was never written
maps the kernel's shared zero page, whose reads cost almost nothing: an unwritten
2 GiB source was measured reading at 26 GB/s here, against 15 for a written one.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from ..errors import UsageError
from ..machine import cache_bytes
from ..transfer import native

#: Bytes of each buffer of the fresh pair the CPU limit is also measured on (written
#: first), at least where the copy is larger: see :func:`fresh_bytes`
FRESH_LIMIT_BYTES = 256 << 20


def fresh_bytes(nbytes: int, llc: int | None = None) -> int:
    """Bytes of each buffer of the fresh pair that a limit for copying ``nbytes`` times:
    ``nbytes``, cut to the larger of :data:`FRESH_LIMIT_BYTES` and twice the last-level
    cache (``llc``, this machine's by default).

    A pair that fits the cache copies from it, not from memory, where the rows' bytes
    (a pool's worth) go through memory: on an Intel Xeon VM with a 300 MiB L3 (2026-12-06)
    kvtier's compiled copy of 32-128 MiB pairs ran at 31-34 GB/s, of 256 MiB ones at
    26-32, and of 512 MiB and 2 GiB ones at 21-25, as between the 2 GiB pools
    themselves; the 256 MiB fresh pair had set every row's limit there."""
    if llc is None:
        llc = max(cache_bytes(level) for level in (2, 3, 4))
    return min(nbytes, max(FRESH_LIMIT_BYTES, 2 * llc))


def best_seconds(fn: Callable[[], None], repeat: int, warmup: int = 1, cuda: bool = False) -> float:
    """Fastest of ``repeat`` runs after ``warmup`` untimed ones (first touches fault pages in).
    With ``cuda``, each run ends with a device synchronize, so queued copies count."""
    if repeat < 1:
        raise UsageError(f"repeat must be at least 1, got {repeat}")

    def run():
        fn()
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        run()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def memcpy_gbps(dst: torch.Tensor, src: torch.Tensor, nbytes: int, repeat: int) -> float:
    """The machine's limit for moving ``nbytes`` from ``src`` to ``dst``: GB/s of the
    fastest contiguous copy of them seen now. On the CPU, the best of torch's ``copy_``
    (all of torch's threads) and kvtier's compiled copy (streaming stores, one thread per
    torch thread), each between ``dst`` and ``src`` and between a fresh pair of written
    buffers (on a VM one allocation can copy at almost twice the speed of another, and
    the fastest copy is the limit). On CUDA, one ``cudaMemcpy`` between the two."""
    d, s = dst.view(torch.uint8)[:nbytes], src.view(torch.uint8)[:nbytes]
    if "cuda" in (d.device.type, s.device.type):
        return nbytes / best_seconds(lambda: d.copy_(s, non_blocking=True), repeat, cuda=True) / 1e9
    fresh = fresh_bytes(nbytes)
    fd = torch.empty(fresh, dtype=torch.uint8)
    fs = torch.empty_like(fd)
    fd.fill_(1)
    fs.fill_(2)
    return max(_copy_gbps(d, s, repeat), _copy_gbps(fd, fs, repeat))


def _copy_gbps(d: torch.Tensor, s: torch.Tensor, repeat: int) -> float:
    n = d.numel()
    rates = [n / best_seconds(lambda: d.copy_(s), repeat) / 1e9]
    if native.enabled():
        threads = max(1, torch.get_num_threads())
        rates.append(n / best_seconds(lambda: _native_copy(threads, d, s), repeat) / 1e9)
    return max(rates)


def _native_copy(threads: int, d: torch.Tensor, s: torch.Tensor) -> None:
    """``d <- s`` (contiguous bytes) with kvtier's compiled copy: rows of ``_ROW`` bytes
    split over ``threads`` threads in one call, as a pool copy's pages are, then the rest."""
    n = d.numel()
    rows = n // _ROW
    if rows:
        pages = np.arange(rows, dtype=np.int64)
        body = tuple(t[:rows * _ROW].numpy().reshape(rows, _ROW) for t in (d, s))
        native.copy_pages([body], pages, pages, threads)
    if n % _ROW:
        first = np.zeros(1, dtype=np.int64)
        native.copy_pages([(d[rows * _ROW:].numpy()[None], s[rows * _ROW:].numpy()[None])], first, first, 1)


#: Bytes per page of the limit's compiled copy
_ROW = 1 << 20
