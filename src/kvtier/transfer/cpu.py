"""CPU copy engine: page runs as numpy views, staged through cache where a page is a transpose.

Every copy is ``dst[dst_page] <- src[src_page]`` between page-major numpy views
``(page, *inner)`` (one per component, and per layer or all layers). Two ways to
move one page, picked once per view pair from the strides:

``direct``: one ``np.copyto`` per run of pages consecutive on both sides. numpy
iterates in the destination's memory order and copies the longest block that is
contiguous on both sides at a time.

``staged``: when the two sides agree only on a short block (a transpose, e.g. a
device page ``(layer, slot, head, dim)`` into a ``page_head`` host page
``(head, slot, layer, dim)``: 256-byte blocks) while the source holds the page in
a few long blocks, the page is first copied whole into a cache-sized staging buffer
that has the source's memory order (long sequential reads), then from there into
the destination in its own order (sequential writes; the short reads hit cache).
Memory is then read and written in long runs only; the transpose happens in cache.

Pages are split across threads (``copy.split_threads``): ``np.copyto`` releases the GIL.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Sequence

import numpy as np

from . import copy as _copy
from .runs import Runs

#: A page is staged when the block both sides share is shorter than this while the
#: source's own blocks are at least this long.
STAGE_BLOCK_BYTES = 16 << 10

#: Pages larger than this are not staged: the staging buffer must stay in cache.
STAGE_MAX_BYTES = 16 << 20


class Task(NamedTuple):
    """``dst <- src`` for one run of pages; ``staged`` goes through a staging buffer
    (then both are single pages, without the page axis)."""

    dst: np.ndarray
    src: np.ndarray
    staged: bool


def contiguous_bytes(dst: np.ndarray, src: np.ndarray | None = None) -> int:
    """Bytes of the innermost block that is contiguous in ``dst`` (and, when given,
    laid out the same way in ``src``): the longest piece one ``memcpy`` can move."""
    run = dst.itemsize
    for axis in sorted(range(dst.ndim), key=lambda a: abs(dst.strides[a])):
        size = dst.shape[axis]
        if size == 1:
            continue
        if dst.strides[axis] != run or (src is not None and src.strides[axis] != run):
            break
        run *= size
    return run


def use_staging(dst_page: np.ndarray, src_page: np.ndarray) -> bool:
    """Whether copying one page (inner view, no page axis) goes faster through staging."""
    return (contiguous_bytes(dst_page, src_page) < STAGE_BLOCK_BYTES <= contiguous_bytes(src_page)
            and src_page.nbytes <= STAGE_MAX_BYTES)


def staging_view(buffer: np.ndarray, like: np.ndarray) -> np.ndarray:
    """A view of ``buffer``'s first bytes with ``like``'s shape and dtype whose memory order
    follows ``like``'s strides (dense): copying ``like`` into it reads and writes in order."""
    order = sorted(range(like.ndim), key=lambda a: -abs(like.strides[a]))
    dense = buffer[:like.nbytes].view(like.dtype).reshape([like.shape[a] for a in order])
    return dense.transpose(np.argsort(order))


class _Buffers:
    """Reused staging buffers: allocating and faulting in megabytes per call would cost
    as much as the copy. A buffer is taken by one thread at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < 4:
                self._free.append(buf)


_BUFFERS = _Buffers()


def plan(pairs: Sequence[tuple[np.ndarray, np.ndarray]], runs: Runs, min_tasks: int = 1) -> list[Task]:
    """Tasks for copying every run of ``runs`` for every page-major ``(dst, src)`` view pair.
    Direct runs are cut so that there are at least ``min_tasks`` pieces to share out."""
    triples = list(zip(runs.dst_start, runs.src_start, runs.length))
    pieces = max(1, -(-min_tasks // max(1, len(triples) * len(pairs))))
    tasks = []
    for dst, src in pairs:
        if use_staging(dst[0], src[0]):
            tasks += [Task(dst[a + i], src[b + i], True) for a, b, n in triples for i in range(n)]
            continue
        for a, b, n in triples:
            step = max(1, -(-n // pieces))
            tasks += [Task(dst[a + i:a + min(n, i + step)], src[b + i:b + min(n, i + step)], False)
                      for i in range(0, n, step)]
    return tasks


def run_tasks(tasks: Sequence[Task]) -> None:
    """Execute tasks in order on the calling thread."""
    buf = None
    try:
        for dst, src, staged in tasks:
            if not staged:
                np.copyto(dst, src)
                continue
            if buf is None or buf.nbytes < src.nbytes:
                if buf is not None:
                    _BUFFERS.give(buf)
                buf = _BUFFERS.take(src.nbytes)
            stage = staging_view(buf, src)
            np.copyto(stage, src)
            np.copyto(dst, stage)
    finally:
        if buf is not None:
            _BUFFERS.give(buf)


def copy(pairs: Sequence[tuple[np.ndarray, np.ndarray]], runs: Runs, nbytes: int, threads: int) -> None:
    """Copy ``runs`` of pages for every page-major ``(dst, src)`` numpy view pair, splitting
    the pages across ``threads`` threads when there are enough bytes to move."""
    parallel = threads if nbytes >= _copy.PARALLEL_MIN_BYTES else 1
    _copy.split_threads(plan(pairs, runs, min_tasks=parallel), nbytes, parallel, run_tasks)
