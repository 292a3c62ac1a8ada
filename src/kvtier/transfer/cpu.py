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

Where the compiled module is built (``kvtier.transfer.native``; ``KVTIER_NATIVE=0`` turns
it off), it replaces both: one C call per copy takes every view pair, copies every block
in an order that keeps both sides to a few runs at a time (``native.Blocks``),
prefetching the source and streaming whole destination lines
(faster for every layout and direction measured), and splits each pair's pages over
threads it keeps between calls (``_copy_pool.h``). numpy stays the fallback,
complete: there the trailing axes contiguous on both sides (at least ``dim``) are seen
as one opaque element (:func:`widen`), so numpy steps once per head row, not per
number, and pages are split across Python threads (``copy.split_threads``,
``copy.CopyWorkers``): ``np.copyto`` releases the GIL.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple, Sequence

import numpy as np
import torch

from . import copy as _copy
from . import native
from .runs import Runs, coalesce, host_pages

#: A page is staged when the block both sides share is shorter than ``STAGE_BELOW_BYTES``
#: while the source's own blocks are at least ``STAGE_SOURCE_BYTES`` long. (Measured on the
#: reference spec: staging wins for page_head's 256-byte blocks, loses for page_first's 2 KiB.)
STAGE_BELOW_BYTES = 1 << 10
STAGE_SOURCE_BYTES = 16 << 10

#: NOTE: numpy keeps the GIL through a copy of at most 500 elements, whatever their size,
#: so merging a page into fewer elements than this would serialize the copy threads.
GIL_FREE_MIN_ELEMENTS = 501

#: Pages larger than this are not staged: the staging buffer must stay in cache.
STAGE_MAX_BYTES = 16 << 20


class Task(NamedTuple):
    """For each ``(a, b, n)`` of ``runs``: ``dst[a:a + n] <- src[b:b + n]`` (pages of page-major
    views); ``staged`` pages go one by one through a staging buffer. Views are cut by the
    thread that runs the task, so that building them overlaps other threads' copies (which
    release the GIL), and a task holds many runs, so that planning costs no object per page."""

    dst: np.ndarray
    src: np.ndarray
    staged: bool
    runs: list[tuple[int, int, int]]
    native: bool = False  # copied by the compiled path (``kvtier.transfer.native``) instead


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


def widen(dst: np.ndarray, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same memory with the trailing axes that are contiguous on both sides merged into
    one opaque (void) element: ``dim`` always, more where the layouts agree (page_first's
    ``(head, dim)`` token row). numpy then takes one step per such block instead of per
    number: 1.4x faster on short blocks (measured: a 4 MiB page_head transpose in cache).
    Bytes are copied as they are, so every dtype stays bit-exact. The page axis and one
    more are always kept, so that indexing a page still gives an array view, and a page
    keeps at least ``GIL_FREE_MIN_ELEMENTS`` elements."""
    while (dst.ndim > 2 and all(a.strides[-1] == a.itemsize for a in (dst, src))
           and math.prod(dst.shape[1:-1]) >= GIL_FREE_MIN_ELEMENTS):
        try:
            dst, src = (a.view(np.dtype((np.void, a.itemsize * a.shape[-1])))[..., 0] for a in (dst, src))
        except ValueError:  # numpy before 1.23 re-types only contiguous arrays: copy number by number
            break
    return dst, src


def use_staging(dst_page: np.ndarray, src_page: np.ndarray) -> bool:
    """Whether copying one page (inner view, no page axis) goes faster through staging."""
    return (contiguous_bytes(dst_page, src_page) < STAGE_BELOW_BYTES
            and contiguous_bytes(src_page) >= STAGE_SOURCE_BYTES
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


def plan(pairs: Sequence[tuple[np.ndarray, np.ndarray]], runs: Runs, parts: int = 1) -> list[Task]:
    """Tasks copying every run of ``runs`` for every page-major ``(dst, src)`` view pair, each
    pair's runs dealt round-robin over ``parts`` tasks: ``tasks[i::parts]`` is part ``i``.
    When there are fewer runs than ``parts``, runs are cut so that every part gets some.
    Pairs left to numpy are widened (:func:`widen`); the compiled copy merges contiguous
    trailing axes itself (widening cost 12 µs for two components, a tenth of a sliding
    window's per-layer load)."""
    triples = list(zip(runs.dst_start, runs.src_start, runs.length))
    if len(triples) < parts:
        pieces = -(-parts // len(triples))
        triples = [(a + i, b + i, min(step, n - i)) for a, b, n in triples
                   for step in (-(-n // pieces),) for i in range(0, n, step)]
    parts = min(parts, len(triples))
    tasks = []
    for dst, src in pairs:
        # NOTE: memcpy's blocks must not overlap; numpy copies overlapping views right
        compiled = native.takes(dst, src)
        if not compiled:
            dst, src = widen(dst, src)
        staged = not compiled and use_staging(dst[0], src[0])
        tasks += [Task(dst, src, staged, triples[i::parts], compiled) for i in range(parts)]
    return tasks


def run_tasks(tasks: Sequence[Task]) -> None:
    """Execute tasks in order on the calling thread."""
    buf = None
    try:
        for dst, src, staged, triples, compiled in tasks:
            if compiled:
                native.copy_runs(dst, src, triples)
                continue
            if not staged:
                for a, b, n in triples:
                    if n == 1:  # NOTE: an int index cuts a view about twice as fast as a slice
                        np.copyto(dst[a], src[b])
                    else:
                        np.copyto(dst[a:a + n], src[b:b + n])
                continue
            if buf is None or buf.nbytes < src[0].nbytes:  # components differ in page size
                if buf is not None:
                    _BUFFERS.give(buf)
                buf = _BUFFERS.take(src[0].nbytes)
            for a, b, n in triples:
                for i in range(n):
                    page = src[b + i]
                    stage = staging_view(buf, page)
                    np.copyto(stage, page)
                    np.copyto(dst[a + i], stage)
    finally:
        if buf is not None:
            _BUFFERS.give(buf)


def copy(pairs: Sequence[tuple[np.ndarray, np.ndarray]], dst_pages: torch.Tensor | np.ndarray,
         src_pages: torch.Tensor | np.ndarray, nbytes: int, threads: int, workers: _copy.CopyWorkers | None = None,
         runs: Runs | None = None) -> None:
    """``dst[dst_pages[i]] <- src[src_pages[i]]`` for every page-major ``(dst, src)`` numpy
    view pair (page numbers as tensors or int64 numpy arrays), split across ``threads``
    threads when there are enough bytes to move: in one compiled call where every pair
    may take it, else with numpy on ``workers``' threads (when given) over ``runs``
    (coalesced here when not given)."""
    jobs = native.jobs(pairs, host_pages(dst_pages), host_pages(src_pages))
    if jobs is not None:
        native.run_jobs(jobs, _copy.thread_count(nbytes, threads, workers, compiled=True))
        return
    parallel = _copy.thread_count(nbytes, threads, workers)
    tasks = plan(pairs, runs or coalesce(dst_pages, src_pages), parts=parallel)
    # NOTE: split_threads deals tasks[i::parallel] to thread i: part i of every pair
    _copy.split_threads(tasks, nbytes, parallel, run_tasks, workers)
