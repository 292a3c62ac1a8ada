"""Pool allocations: page-aligned, and on 2 MiB pages where Linux offers them.

A pool is one large allocation that lives as long as the engine, and its copies read
short runs far apart (a ``page_head`` per-layer load reads 256 bytes every 8 KiB).
Two things about the memory itself then matter, measured on the reference spec:

- alignment: torch aligns a CPU allocation to 64 bytes only. From a page-aligned base
  every 256-byte run covers whole 128-byte line pairs, which the CPU's adjacent-line
  prefetcher fetches together; from a 64-byte-aligned one a page_head per-layer load
  reads 1.5x the lines it uses, and ran markedly slower;
- page size: with 4 KiB pages each of those runs needs its own TLB entry. Transparent
  huge pages (``madvise(MADV_HUGEPAGE)``, asked before the memory is first touched) made
  page_head per-layer loads faster in paired runs.

``KVTIER_HUGEPAGES=0`` (read at each allocation) keeps to 4 KiB pages. Pinned memory
(CUDA's allocator) and device memory are left as their allocators give them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

PAGE = 4096
HUGE_PAGE = 2 << 20
#: CPU pools at least this large are put on huge pages. Smaller ones may come from
#: glibc's heap (below its mmap threshold, at most 32 MiB), which is not ours to advise.
HUGE_MIN_BYTES = 64 << 20
_MADV_HUGEPAGE = 14  # Linux


def pool_bytes(nbytes: int, *, device: torch.device, pin_memory: bool = False) -> torch.Tensor:
    """A ``(nbytes,)`` uint8 tensor on ``device`` whose first byte is page-aligned (2 MiB
    aligned, and advised onto huge pages, for a large unpinned CPU pool on Linux).
    Its memory is not touched here."""
    huge = (device.type == "cpu" and not pin_memory and nbytes >= HUGE_MIN_BYTES and sys.platform == "linux"
            and os.environ.get("KVTIER_HUGEPAGES", "1") != "0")
    align = HUGE_PAGE if huge else PAGE
    raw = torch.empty(nbytes + align, dtype=torch.uint8, device=device, pin_memory=pin_memory)
    shift = -raw.data_ptr() % align
    raw = raw[shift:shift + nbytes]
    if huge:
        _advise_huge(raw.data_ptr(), nbytes - nbytes % HUGE_PAGE)
    return raw


def _advise_huge(address: int, nbytes: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` over ``[address, address + nbytes)``; False where the
    kernel refuses (transparent huge pages off) or libc has no ``madvise``."""
    madvise = _madvise()
    if madvise is None or nbytes <= 0:
        return False
    return madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE) == 0


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's ``madvise`` (looked up on the first large pool, not at import), or ``None``."""
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise  # the process's own symbols include libc's
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn
