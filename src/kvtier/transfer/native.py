"""The optional compiled copy path (``kvtier.transfer._native``) and its fallback switch.

``_native.copy_jobs`` copies a page's blocks in the order :class:`Blocks` picks (outermost
the axis far apart on both sides, so that the inner loops copy a tile lying in a few runs
of each), prefetching the source some blocks ahead and writing whole destination lines
with streaming stores:
that hides the memory latency of short scattered reads (page_head's per-layer load
reads 256-byte blocks 8 KiB apart) and saves reading the destination before writing
it, which numpy cannot. One call takes every component's view pair and splits their
pages over threads kept in C between calls. Measured on the reference spec, it is as
fast as numpy or faster for every layout and direction, so the CPU engine
(``cpu.copy``) uses it for every copy between views that do not overlap. It is built by
``pip install`` where a C compiler is present (``setup.py``, ``optional=True``); where
it is not, kvtier copies with numpy alone.

Where the CPU has AVX-512, a streaming store writes a whole 64-byte line, where it has
AVX2 half a line (16 bytes otherwise): gathers that write short blocks far apart, the
per-layer loads from ``page_first`` and ``page_head``, went faster (``_native.c`` has
the figures).

Environment: ``KVTIER_NATIVE=0`` forces the pure numpy path (read at each copy plan,
through ``kvtier.compiled.load``, so tests and benchmarks can switch it);
``KVTIER_WIDE_STORES=0`` keeps the compiled copy to 16-byte stores and ``=32`` to at
most 32 (read per call);
``KVTIER_COPY_SPIN_US`` (read at the first copy; default 100) is how long its kept
threads spin for the next call once a call of a burst ends before they sleep (0: at
once); ``KVTIER_COPY_TRIALS=0`` (read as each copy plan is made) keeps every plan to
its rule's loop order, with no trial of the source's order (:class:`Blocks`).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import time
import weakref
from typing import NamedTuple

import numpy as np

from ..compiled import built, load
from ..errors import IntegrityError

#: the compiled copy; not built (no compiler at install time): numpy does every copy
COMPILED = "kvtier.transfer._native"


def enabled() -> bool:
    """Whether copies may use the compiled path: built, and not switched off (read now)."""
    return load(COMPILED) is not None


def path_name() -> str:
    """``"native"`` or ``"numpy"``: the copy path CPU transfers take now (for reports)."""
    return "native" if enabled() else "numpy"


def store_bytes() -> int:
    """Bytes per streaming store of the compiled copy now (for reports): 64 where the CPU
    has AVX-512, 32 where it has AVX2, else 16, capped by ``KVTIER_WIDE_STORES`` (``0``:
    16, ``32``: 32); 0 on numpy's path."""
    module = load(COMPILED)
    return module.store_bytes() if module is not None else 0


def _span(a: np.ndarray) -> tuple[int, int]:
    """``(address, nbytes)`` of the memory ``a`` spans (every element, any strides)."""
    low = high = a.__array_interface__["data"][0]
    for size, stride in zip(a.shape, a.strides):
        if size == 0:
            return low, 0
        if stride > 0:
            high += stride * (size - 1)
        else:
            low += stride * (size - 1)
    return low, high + a.itemsize - low


class Blocks:
    """One page's copy as blocks: ``shape``/``strides`` over the axes left once the trailing
    axes contiguous on both sides are merged into one ``block`` of bytes. Two axes along
    neither of which the source's blocks form a run (a gather: page_head's per-layer
    load) are looped in the source's order. Otherwise the outermost loop walks the axis
    whose shorter stride of the two is the longest (ties: the one whose longer stride
    is the shortest); the loops inside it, the destination's strides from the longest
    in; the outermost cut in tiles where that lengthens the destination's runs
    (:func:`_tiled`). Built from a page's shape, its byte strides on each side and its
    item size (no page axis).

    Beside the rule's loops the plan keeps, as candidate ``orders``, the source's order
    and the source's order with the rule's outermost axis innermost, and its first
    large copies try each (:meth:`trial`, :meth:`timed`, :func:`run_jobs`) before it
    keeps the fastest: which is fastest depends on the machine.
    ``shape``/``dst_strides``/``src_strides`` are the rule's."""

    def __init__(self, shape: tuple, dst_strides: tuple, src_strides: tuple, itemsize: int) -> None:
        axes = [a for a in range(len(shape)) if shape[a] != 1]
        axes.sort(key=lambda a: abs(dst_strides[a]))
        block = itemsize
        while axes and dst_strides[axes[0]] == block == src_strides[axes[0]]:
            block *= shape[axes.pop(0)]
        gather = len(axes) == 2 and block not in (abs(src_strides[a]) for a in axes)
        if gather:
            # NOTE: a gather, page_head's per-layer load (a page's heads x slots: a 256-byte
            # row of one layer every 8 KiB of the source, into a slot's 2 KiB row of heads),
            # reads each head's slots in turn rather than writing each slot's row whole.
            # On the Xeon VM, four alternated pairs of `kvtier bench transfer --layouts
            # page_head` (direct and kernel), K/V 128/128: 13.5-14.0 -> 14.9-15.3 GB/s
            # (0.57-0.59x of the limit -> 0.62-0.63x); 192/128 and MiMo-V2-Flash's level.
            # Where the source has a run (page_first's backup reads each layer's slots as
            # one), or with three axes (backups into page_head), the rule below stays: the
            # source's order slowed those (0.86-0.97x -> 0.77-0.88x of the limit).
            axes.sort(key=lambda a: -abs(src_strides[a]))
        else:
            # NOTE: the outermost loop walks the axis that is far apart on both sides (a
            # page's slots, for a backup into page_first or page_head), so the inner loops
            # copy a tile whose blocks lie in a few runs on each side: page_head's backup
            # reads each layer's 2 KiB row of a slot and writes each head's 8 KiB run of it.
            # Alternated in one process on the reference spec, against the source's order:
            # page_head backups 20.0-20.5 -> 24.2-24.3 GB/s, page_first's 20.7-20.9 ->
            # 22.2-23.1, page_head's load runs 15.6-16.2 -> 16.7-16.8; the rest level. (The
            # destination's order was slower still for page_head: 15.5.)
            axes.sort(key=lambda a: (-min(abs(src_strides[a]), abs(dst_strides[a])),
                                     max(abs(src_strides[a]), abs(dst_strides[a]))))
            # NOTE: within that tile, the destination's far axes outer and its nearest
            # innermost, so each run of it is written whole before the next: page_head's
            # load runs (a slot's layers x heads) write each layer's 2 KiB row of the slot in
            # turn and read the heads' rows 256 bytes at a time, instead of writing 256 bytes
            # to each layer in turn. Alternated runs of the reference spec: 0.65-0.70x of the
            # limit -> 0.72-0.77x (16.0-17.0 -> 17.8-19.0 GB/s); no other order of the
            # three axes did better
            axes[1:] = sorted(axes[1:], key=lambda a: -abs(dst_strides[a]))
        loops = [shape[a] for a in axes], [dst_strides[a] for a in axes], [src_strides[a] for a in axes]
        self.block = block
        # NOTE: a gather stays untiled: tiling its outer axis (the heads, whose destination
        # stride is the block) would bring back the order it replaces
        self.shape, self.dst_strides, self.src_strides = (tuple(map(tuple, loops)) if gather
                                                          else _tiled(*loops, block))
        self.page_bytes = block * math.prod(self.shape)
        #: the candidate loop orders ``(shape, dst_strides, src_strides)``, each once: the
        #: rule's above; the source's order (the gather already has it); and the source's
        #: order with the rule's outermost axis (far apart on both sides) innermost instead
        self.orders = [(self.shape, self.dst_strides, self.src_strides)]
        if not gather and os.environ.get("KVTIER_COPY_TRIALS", "1") != "0":
            by_source = sorted(axes, key=lambda a: -abs(src_strides[a]))
            far_inside = [a for a in by_source if a != axes[0]] + axes[:1]
            for seq in (by_source, far_inside):
                order = tuple(tuple(x[a] for a in seq) for x in (shape, dst_strides, src_strides))
                if order not in self.orders:
                    self.orders.append(order)
        #: the order kept, or None while each is on trial
        self.kept: int | None = 0 if len(self.orders) == 1 else None
        self._best = [math.inf] * len(self.orders)  # fastest seconds per byte seen, each order
        self._tries = [0] * len(self.orders)

    def trial(self, nbytes: int) -> int | None:
        """The order a copy of ``nbytes`` through this plan tries (then :meth:`timed`), or
        None where it takes the kept one: kept already, or too small to time
        (``TRIAL_BYTES``)."""
        if self.kept is not None or nbytes < TRIAL_BYTES:
            return None
        return min(range(len(self.orders)), key=self._tries.__getitem__)

    def timed(self, order: int, seconds_per_byte: float) -> None:
        """A trial of ``order`` took ``seconds_per_byte``; once each order has had
        ``TRIALS``, the one whose fastest was fastest is kept (ties: the rule's)."""
        self._best[order] = min(self._best[order], seconds_per_byte)
        self._tries[order] += 1
        if self.kept is None and min(self._tries) >= TRIALS:
            self.kept = min(range(len(self.orders)), key=self._best.__getitem__)

    def loops(self, order: int | None = None) -> tuple:
        """``(shape, dst_strides, src_strides)`` of ``order`` (None: the kept one, or the
        rule's while on trial)."""
        return self.orders[order if order is not None else self.kept or 0]


#: Bytes of the destination a tile of the outer axis writes in one run at most (_tiled)
TILE_BYTES = 8 << 10
#: A copy call of at least this many bytes may try a plan's candidate loop orders
#: (:meth:`Blocks.trial`); smaller ones take the kept (or the rule's) order
TRIAL_BYTES = 4 << 20
#: Calls timed per candidate order before a plan keeps the fastest
TRIALS = 3
#: Candidate loop orders a plan has at most (:class:`Blocks`): a caller that wants a
#: plan's kept order timed makes ``TRIALS * MAX_ORDERS`` large calls first
MAX_ORDERS = 3
#: The clock the trials are timed with
_clock = time.perf_counter
#: Loops the compiled copy takes at most (``MAX_DIMS`` in ``_native.c``)
_MAX_DIMS = 6


def _tiled(shape: list, dst: list, src: list, block: int) -> tuple[tuple, tuple, tuple]:
    """The loops of :class:`Blocks` (outermost first), with the outermost one cut in tiles
    where that makes the destination's runs longer: when the innermost loops write one
    run of the destination, the outermost axis continues that run, and loops in between
    break it (a load run from ``page_first``: a slot's layers, each a 2 KiB row of its
    own layer's run of slots), the outer axis is split in two and its inner part
    placed just outside the run's loops, so each run covers as many of its steps as
    fit ``TILE_BYTES`` (a power of two of them that divides it).

    NOTE: a page_first load run then writes each layer 8 KiB (4 slots) at a time instead
    of 2 KiB, and a page_head one likewise. Alternated whole runs of ``kvtier bench
    transfer`` (two pairs): page_first load runs 19.9-20.6 -> 20.1-21.3 GB/s (0.75-0.79x
    of the limit -> 0.76-0.80x), page_head's level, the other rows level; with ``--spec
    mimo-v2-flash``, page_first load runs 0.71-0.72x -> 0.77x. 8 slots at a time (16 KiB)
    and 16 were slower than 4."""
    run, k = block, len(shape)
    while k > 1 and dst[k - 1] == run:  # the innermost loops that write one run
        run *= shape[k - 1]
        k -= 1
    tile = 1
    if 1 < k and dst[0] == run and len(shape) < _MAX_DIMS:
        while 2 * tile * run <= TILE_BYTES and shape[0] % (2 * tile) == 0:
            tile *= 2
    if tile == 1:
        return tuple(shape), tuple(dst), tuple(src)
    return ((shape[0] // tile, *shape[1:k], tile, *shape[k:]), (dst[0] * tile, *dst[1:k], dst[0], *dst[k:]),
            (src[0] * tile, *src[1:k], src[0], *src[k:]))


@functools.lru_cache(maxsize=1024)
def _blocks(shape: tuple, dst_strides: tuple, src_strides: tuple, itemsize: int) -> Blocks:
    """:class:`Blocks` of a page of this shape, strides and item size (the same for every
    call between two pools: built once)."""
    return Blocks(shape, dst_strides, src_strides, itemsize)


def takes(dst: np.ndarray, src: np.ndarray) -> bool:
    """Whether the compiled copy may copy between these two views: enabled, and the views
    share no memory (memcpy's blocks must not overlap; numpy copies overlapping views right)."""
    return enabled() and not _pair(dst, src).overlap


class _Pair(NamedTuple):
    """What :func:`_job` needs of a view pair besides the pages, worked out once per pair
    (a pool's views live as long as the pool): each side's spanned bytes, where its page
    0 starts in them and its page stride, and the page's blocks."""

    dst: weakref.ref
    src: weakref.ref
    overlap: bool
    dst_bytes: ctypes.Array
    src_bytes: ctypes.Array
    dst_first: int
    src_first: int
    dst_step: int
    src_step: int
    blocks: Blocks


#: NOTE: keyed by the views' ids and checked by weak references (a dead view's id may be
#: reused): the cache keeps no pool alive. A sliding layer's load (655 KB, two pairs)
#: spent about 25 of its 90 µs working this out each call.
_PAIRS: dict[tuple[int, int], _Pair] = {}
_MAX_PAIRS = 4096


def _pair(dst: np.ndarray, src: np.ndarray) -> _Pair:
    got = _PAIRS.get((id(dst), id(src)))
    if got is not None and got.dst() is dst and got.src() is src:
        return got
    if dst.shape[1:] != src.shape[1:]:
        raise IntegrityError(f"page shapes differ: {dst.shape[1:]} and {src.shape[1:]}")
    d_low, d_len = _span(dst)
    s_low, s_len = _span(src)
    pair = _Pair(weakref.ref(dst), weakref.ref(src), bool(np.may_share_memory(dst, src)),
                 (ctypes.c_char * d_len).from_address(d_low), (ctypes.c_char * s_len).from_address(s_low),
                 dst.__array_interface__["data"][0] - d_low, src.__array_interface__["data"][0] - s_low,
                 dst.strides[0], src.strides[0], _blocks(dst.shape[1:], dst.strides[1:], src.strides[1:], dst.itemsize))
    if len(_PAIRS) >= _MAX_PAIRS:
        _PAIRS.clear()
    _PAIRS[(id(dst), id(src))] = pair
    return pair


def _job(dst: np.ndarray, src: np.ndarray, dst_pages: np.ndarray, src_pages: np.ndarray) -> tuple:
    """``copy_jobs``' tuple for ``dst[dst_pages[i]] <- src[src_pages[i]]`` between page-major
    views (page numbers as int64 arrays)."""
    return _job_of(_pair(dst, src), dst_pages, src_pages)


def _job_of(p: _Pair, dst_pages: np.ndarray, src_pages: np.ndarray, order: int | None = None) -> tuple:
    """:func:`_job` of a worked-out pair, in its plan's loop ``order`` (None: the kept
    one): each side as the bytes its view spans, and where page 0 starts in them and the
    page stride (the C side turns the page numbers into byte offsets and checks every
    block against those bytes)."""
    b = p.blocks
    # NOTE: the offsets worked out in C, not numpy: four array ops per pair were a tenth
    # of a sliding layer's per-layer load (655 KB)
    return (p.dst_bytes, p.src_bytes, dst_pages, src_pages, *b.loops(order), b.block, True,
            (p.dst_first, p.dst_step, p.src_first, p.src_step))


class Jobs(list):
    """:func:`jobs`' list, with the plans on trial in it (``(Blocks, order)`` each) and
    the bytes the call moves, for :func:`run_jobs` to time."""

    trials: list
    nbytes: int


def jobs(pairs, dst_pages: np.ndarray, src_pages: np.ndarray) -> list[tuple] | None:
    """:func:`run_jobs`' jobs for ``dst[dst_pages[i]] <- src[src_pages[i]]`` over every
    page-major ``(dst, src)`` numpy view pair (page numbers as int64 arrays), or ``None``
    where the compiled copy may not take them all (:func:`takes`): the check and the jobs
    in one pass over the pairs. A large copy through a plan still on trial takes the
    order its trial asks for (:meth:`Blocks.trial`)."""
    if not enabled():
        return None
    out, pages = Jobs(), len(dst_pages)
    out.trials, out.nbytes = [], 0
    for dst, src in pairs:
        p = _pair(dst, src)
        if p.overlap:
            return None
        b = p.blocks
        out.nbytes += pages * b.page_bytes
        order = None if b.kept is not None else b.trial(pages * b.page_bytes)
        if order is not None and all(t is not b for t, _ in out.trials):  # K and V may share a plan
            out.trials.append((b, order))
        out.append(_job_of(p, dst_pages, src_pages, order))
    return out


def run_jobs(jobs: list[tuple], threads: int) -> None:
    """Copy :func:`jobs`' jobs in one compiled call that splits each one's pages over
    ``threads`` threads, GIL released; a call with plans on trial is timed for them.

    NOTE: which loop order copies a plan's blocks fastest depends on the machine. On an
    AMD EPYC VM, looping over a page's slots outermost took page_head backups from 20.0-20.5
    to 24.2-24.3 GB/s against the source's order; on an Intel Xeon (Emerald Rapids) VM the
    source's order was the faster, 17.1-17.6 -> 22.4-23.0 GB/s, and page_head load runs
    19.5-19.6 -> 21.1-21.7 (throwaway harness, alternated rounds), and the source's order
    with the slots innermost faster still (backups 26.7, 16-layer load runs 22.5 GB/s).
    So a plan with several candidate orders times each on its first large calls and
    keeps the fastest."""
    compiled = built(COMPILED)
    threads = min(threads, compiled.MAX_THREADS)  # a pool's copy_threads is the machine's cores: maybe more
    trials = getattr(jobs, "trials", None)
    if not trials:
        compiled.copy_jobs(jobs, threads)
        return
    start = _clock()
    compiled.copy_jobs(jobs, threads)
    per_byte = (_clock() - start) / max(jobs.nbytes, 1)
    for blocks, order in trials:
        blocks.timed(order, per_byte)


def copy_pages(pairs, dst_pages: np.ndarray, src_pages: np.ndarray, threads: int) -> None:
    """``dst[dst_pages[i]] <- src[src_pages[i]]`` for every page-major ``(dst, src)`` numpy
    view pair (each :func:`takes`), page numbers as int64 arrays, in one compiled call that
    splits each pair's pages over ``threads`` threads, GIL released. One call instead of a
    call per pair and thread in Python threads: a per-layer load of 64 MiB spent about
    400 µs of its 4.4 ms in Python (offsets, views, waking a worker) before this."""
    run_jobs([_job(dst, src, dst_pages, src_pages) for dst, src in pairs], threads)


#: Runs up to which :func:`copy_runs` lists their pages in Python
_SMALL_RUNS = 16


def copy_runs(dst: np.ndarray, src: np.ndarray, runs: list[tuple[int, int, int]]) -> None:
    """``dst[a:a + n] <- src[b:b + n]`` for each ``(a, b, n)`` of ``runs``, between page-major
    numpy views ``(page, *inner)``, with the compiled copy on this thread: one call, GIL
    released. Only for a caller that :func:`enabled` let (a plan made under the switch
    runs as planned)."""
    if not runs:
        return
    if len(runs) <= _SMALL_RUNS:  # NOTE: a few pages (a sliding window's): numpy's calls cost more than a loop
        dst_pages = np.array([a + i for a, _, n in runs for i in range(n)], dtype=np.int64)
        src_pages = np.array([b + i for _, b, n in runs for i in range(n)], dtype=np.int64)
    else:
        r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
        n = r[:, 2]
        within = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        dst_pages, src_pages = np.repeat(r[:, 0], n) + within, np.repeat(r[:, 1], n) + within
    built(COMPILED).copy_jobs([_job(dst, src, dst_pages, src_pages)], 1)
