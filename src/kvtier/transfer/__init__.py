"""Page transfers between pools: the two io backends and the choice between copy engines.

``direct``: one strided copy per run of pages that are consecutive on both sides
(on the CPU, ``kvtier.transfer.cpu``: numpy views, threads splitting the pages, and
transposing pages staged through cache; torch ``copy_`` elsewhere).
``kernel``: on CUDA, one launch of the strided Triton kernel per component
(``kvtier.transfer.triton_kernel``); elsewhere batched gather/scatter index ops
(``kvtier.transfer.gather``), whose cost does not grow with the number of runs. On
the CPU, ``kernel`` still copies runs of at least ``KERNEL_MIN_RUN_BYTES`` with the
direct engine, which moves each byte once and is faster there (measured: one
16-token page of one layer of the reference spec, 32 KiB, costs the same both ways).
``auto``: ``direct`` when the average run is at least ``KERNEL_MIN_RUN_BYTES``,
else ``kernel`` — the same rule, applied on every device.
Pools on torch's ``meta`` device (the simulator's: shapes, no memory) copy nothing:
their indices are validated by the caller, then the call returns.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..errors import UsageError
from . import cpu
from . import native
from .copy import CopyWorkers, copy_torch, int_view, thread_count
from .gather import gather_pages
from .runs import Runs, coalesce

IO_BACKENDS = ("direct", "kernel", "auto")

KERNEL_MIN_RUN_BYTES = 32 << 10


def check_io_backend(io_backend: str) -> None:
    if io_backend not in IO_BACKENDS:
        raise UsageError(f"unknown io_backend {io_backend!r}; supported: {', '.join(IO_BACKENDS)}")


def _view_pairs(dst, src, layer: int | range | None, use_numpy: bool = False) -> list:
    """Whole ``(dst, src)`` page views to copy between for one component: the layer's,
    the all-layer views (or, for a range of layers, the numpy all-layer views cut to
    it: one copy reads each page's run of those layers at once), or one pair per layer."""
    d_all, d_layers = dst.arrays(use_numpy)
    s_all, s_layers = src.arrays(use_numpy)
    if isinstance(layer, range) and len(layer) == 1:  # the layer's own views (kept: native._pair knows them)
        layer = layer.start
    if isinstance(layer, range):
        if use_numpy and d_all is not None and s_all is not None:  # (page, slot, layer, head, dim)
            return [(d_all[:, :, layer.start:layer.stop], s_all[:, :, layer.start:layer.stop])]
        return list(zip(d_layers[layer.start:layer.stop], s_layers[layer.start:layer.stop]))
    if layer is not None:
        return [(d_layers[layer], s_layers[layer])]
    if d_all is not None and s_all is not None:
        return [(d_all, s_all)]
    return list(zip(d_layers, s_layers))


def layer_pairs(views, layer: int | range | None) -> list | None:
    """The numpy ``(dst, src)`` page-view pairs of a copy of ``layer`` (as
    :func:`copy_pages` takes it) between ``views`` (``(dst, src)`` ``PageViews`` per
    component), or ``None`` where a side has none (off the CPU): what the CPU's direct
    engine copies, and what :func:`copy_layer` takes for one layer, for a caller to
    keep between its calls."""
    if not all(d.np_layers is not None and s.np_layers is not None for d, s in views):
        return None
    return [pair for dv, sv in views for pair in _view_pairs(dv, sv, layer, True)]


def _short(nbytes: int, runs: int, calls: int) -> bool:
    """Whether ``calls`` copy calls per run over ``runs`` runs move under
    ``KERNEL_MIN_RUN_BYTES`` each on average (of ``nbytes`` in all): the rule that
    sends ``kernel``/``auto`` copies to the batched gather."""
    return nbytes / (runs * calls) < KERNEL_MIN_RUN_BYTES


def copy_layer(pairs: list, dst_pages: np.ndarray, src_pages: np.ndarray, *, nbytes: int, io_backend: str,
               threads: int, workers: CopyWorkers | None = None) -> bool:
    """:func:`copy_pages` of one layer between CPU pools, given its :func:`layer_pairs`
    and int64 numpy page numbers: the compiled copy, where ``copy_pages`` would take it
    (``io_backend`` checked by the caller). ``False`` where it would not (a page pair of
    under ``KERNEL_MIN_RUN_BYTES`` with ``kernel``/``auto``, or the compiled copy off or
    refusing a pair): nothing was copied, and the caller calls ``copy_pages``.

    NOTE: a per-layer load's path without ``copy_pages``' dispatch, which it would take
    the same way every layer: right after a large copy, each Python frame and torch call
    runs from memory no cache holds, and a MiMo sliding layer's 655 KB load spent more
    time there than copying."""
    if len(dst_pages) == 0:
        return True
    if io_backend != "direct" and _short(nbytes, len(dst_pages), len(pairs)):
        return False  # NOTE: copy_pages' rule before coalescing; runs of several pages may still go direct
    jobs = native.jobs(pairs, dst_pages, src_pages)
    if jobs is None:
        return False
    native.run_jobs(jobs, thread_count(nbytes, threads, workers, compiled=True))
    return True


def _copy_direct(views, dst_pages: torch.Tensor, src_pages: torch.Tensor, runs: Runs | None, layer, nbytes,
                 threads, workers) -> None:
    pairs = layer_pairs(views, layer)
    if pairs is not None:
        cpu.copy(pairs, dst_pages, src_pages, nbytes, threads, workers, runs)
        return
    pairs = [pair for dv, sv in views for pair in _view_pairs(dv, sv, layer)]
    runs = runs or coalesce(dst_pages, src_pages)
    runs3 = list(zip(runs.dst_start, runs.src_start, runs.length))
    copy_torch([(d[a:a + n], s[b:b + n]) for d, s in pairs for a, b, n in runs3])


def _copy_gather(views, dst_pages, src_pages, layer) -> None:
    for d, s in views:
        for dst, src in _view_pairs(d, s, layer):
            gather_pages(dst, src, dst_pages, src_pages)


def _triton():
    """The Triton kernel module, or None where Triton is not installed."""
    try:
        from . import triton_kernel
    except ImportError:
        return None
    return triton_kernel


class _MappedHost:
    """A pinned host view as a device pointer: with unified addressing, CUDA kernels
    read pinned host memory at its host address (what Triton needs is data_ptr/dtype)."""

    def __init__(self, view: torch.Tensor) -> None:
        self._view, self.dtype = view, view.dtype

    def data_ptr(self) -> int:
        return self._view.data_ptr()

    def __getattr__(self, name):
        return getattr(self._view, name)


def _copy_triton(views, dst_pages, src_pages, layer) -> None:
    kernel = _triton()
    device = next(v.device for pair in views for v in pair if v.device.type == "cuda")
    dst_pages, src_pages = dst_pages.to(device), src_pages.to(device)

    def arg(t: torch.Tensor):  # as same-width ints: one kernel for every dtype, fp8 included
        t = int_view(t)
        return _MappedHost(t) if t.device.type == "cpu" else t

    for d, s in views:
        for dst, src in _view_pairs(d, s, layer):
            kernel.copy_pages(arg(dst), arg(src), dst_pages, src_pages)


def _tensor(pages: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.from_numpy(pages) if isinstance(pages, np.ndarray) else pages


def copy_pages(views: Sequence[tuple], dst_pages: torch.Tensor | np.ndarray, src_pages: torch.Tensor | np.ndarray,
               *, layer: int | range | None, nbytes: int, io_backend: str, threads: int,
               workers: CopyWorkers | None = None) -> None:
    """Copy pages ``src_pages[i] -> dst_pages[i]`` for every ``(dst, src)`` pair of
    ``PageViews`` in ``views`` (one per component). ``layer=None`` copies every layer,
    else only ``layer`` (an index, or a range of layers with step 1). ``nbytes`` is the
    total to move (sizes threads and runs). The page numbers are int64 CPU tensors or
    numpy arrays (what the pools' checks give: the CPU copy takes them as they are).
    ``workers``: kept threads for the CPU engine's split (else threads per call)."""
    check_io_backend(io_backend)
    if len(dst_pages) == 0:
        return
    d0, s0 = views[0]
    d_dev, s_dev = d0.device, s0.device
    if "meta" in (d_dev.type, s_dev.type):
        return  # shapes without memory (the simulator's pools): validated by the caller, nothing to move
    if d_dev.type != "cpu" or s_dev.type != "cpu":  # the engines off the CPU take tensors
        dst_pages, src_pages = _tensor(dst_pages), _tensor(src_pages)
    runs = None  # NOTE: only for picking an engine and for numpy's copies: the compiled copy takes pages
    small = False  # whether the direct engine's average copy call would move under KERNEL_MIN_RUN_BYTES
    if io_backend != "direct":
        calls = sum(len(_view_pairs(d, s, layer)) for d, s in views)  # the direct engine's calls per run
        # NOTE: a run holds at least a page: where one page pair reaches the threshold,
        # coalescing cannot change the answer (a full layer's 256 random pages took
        # tens of us a call to coalesce, for nothing)
        if _short(nbytes, len(dst_pages), calls):
            runs = coalesce(dst_pages, src_pages)
            small = _short(nbytes, len(runs.length), calls)
        if io_backend == "auto":
            io_backend = "kernel" if small else "direct"
    if io_backend == "kernel":
        if "cuda" in (d_dev.type, s_dev.type) and _triton() is not None:
            _copy_triton(views, dst_pages, src_pages, layer)
            return
        if d_dev == s_dev and (d_dev.type != "cpu" or small):
            _copy_gather(views, _tensor(dst_pages), _tensor(src_pages), layer)
            return
    _copy_direct(views, dst_pages, src_pages, runs, layer, nbytes, threads, workers)


__all__ = ["IO_BACKENDS", "CopyWorkers", "KERNEL_MIN_RUN_BYTES", "Runs", "check_io_backend", "coalesce", "copy_layer",
           "copy_pages", "layer_pairs"]
