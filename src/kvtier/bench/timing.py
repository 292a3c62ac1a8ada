"""Best-of-N wall-clock timing and the machine's copy limit.

NOTE: every buffer a benchmark times is written first. Memory that was never written
maps the kernel's shared zero page, whose reads cost almost nothing: an unwritten
2 GiB source was measured reading at 26 GB/s here, against 15 for a written one.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

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
    return alternated([fn], repeat, warmup, cuda)[0]


def limit_copies(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> list[tuple[int, Callable[[], None]]]:
    """``(bytes, copy)`` for each contiguous copy a limit for moving ``nbytes`` from ``src``
    to ``dst`` takes the fastest of. On the CPU: torch's ``copy_`` (all of torch's threads)
    and kvtier's compiled copy (streaming stores, one thread per torch thread), each
    between ``dst`` and ``src`` and between a fresh pair of written buffers (on a VM one
    allocation can copy at almost twice the speed of another, and the fastest copy is the
    limit; :func:`fresh_bytes`). On CUDA, one ``cudaMemcpy`` between the two."""
    d, s = dst.view(torch.uint8)[:nbytes], src.view(torch.uint8)[:nbytes]
    if _on_cuda(d, s):
        return [(nbytes, lambda: d.copy_(s, non_blocking=True))]
    fd = torch.empty(fresh_bytes(nbytes), dtype=torch.uint8)
    fs = torch.empty_like(fd)
    fd.fill_(1)
    fs.fill_(2)
    threads = max(1, torch.get_num_threads())
    out = []
    for a, b in ((d, s), (fd, fs)):
        out.append((a.numel(), lambda a=a, b=b: a.copy_(b)))
        if native.enabled():
            out.append((a.numel(), lambda a=a, b=b: _native_copy(threads, a, b)))
    return out


def alternated(fns: Sequence[Callable[[], None]], repeat: int, warmup: Sequence[int] | int = 1,
               cuda: bool = False) -> list[float]:
    """Fastest seconds of each of ``fns`` over ``repeat`` rounds, each round running every
    one once, in turn, after ``warmup`` untimed runs of each (one count, or one per fn).
    With ``cuda``, each run ends with a device synchronize.

    Why rounds: this project's VMs copy at one speed for seconds and then at another (a
    2-core AMD EPYC VM, 2026-12-07: a 512 MiB copy at 46-51 GB/s, then 28-31, by turns).
    Figures timed one after the other, each in a burst, can fall in different spells; a
    ratio of two of them then measures the spells. Timed in rounds, each figure's fastest
    run comes from the same spells as the others'."""
    if repeat < 1:
        raise UsageError(f"repeat must be at least 1, got {repeat}")
    warmups = [warmup] * len(fns) if isinstance(warmup, int) else list(warmup)
    if len(warmups) != len(fns):
        raise ValueError(f"{len(warmups)} warmup counts for {len(fns)} functions")

    def run(fn):
        fn()
        if cuda:
            torch.cuda.synchronize()

    for fn, n in zip(fns, warmups):
        for _ in range(n):
            run(fn)
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            run(fn)
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def _on_cuda(*tensors: torch.Tensor) -> bool:
    return any(t.device.type == "cuda" for t in tensors)


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
