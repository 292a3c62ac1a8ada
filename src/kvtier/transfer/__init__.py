"""Page transfers between pools: io backends as a dispatch table."""

from __future__ import annotations

from typing import Sequence

from .copy import copy_numpy, copy_torch
from .runs import Runs, coalesce

#: ``io_backend`` names. On the CPU both run the threaded strided-view engine
#: (numpy views, GIL released); elsewhere both run torch ``copy_`` on views until
#: a dedicated GPU kernel takes ``"kernel"``.
IO_BACKENDS = ("direct", "kernel")


def check_io_backend(io_backend: str) -> None:
    if io_backend not in IO_BACKENDS:
        raise ValueError(f"unknown io_backend {io_backend!r}; supported: {', '.join(IO_BACKENDS)}")


def _pairs(dst, src, runs: Runs, layer: int | None, use_numpy: bool) -> list:
    """``(dst_view, src_view)`` per run (per layer when no all-layer view exists)."""
    d_all, d_layers = dst.arrays(use_numpy)
    s_all, s_layers = src.arrays(use_numpy)
    runs3 = list(zip(runs.dst_start, runs.src_start, runs.length))
    if layer is not None:
        d, s = d_layers[layer], s_layers[layer]
        return [(d[a:a + n], s[b:b + n]) for a, b, n in runs3]
    if d_all is not None and s_all is not None:
        return [(d_all[a:a + n], s_all[b:b + n]) for a, b, n in runs3]
    return [(d[a:a + n], s[b:b + n]) for d, s in zip(d_layers, s_layers) for a, b, n in runs3]


def copy_runs(views: Sequence[tuple], runs: Runs, *, layer: int | None, nbytes: int, io_backend: str,
              threads: int) -> None:
    """Copy page runs for every ``(dst, src)`` pair of ``PageViews`` in ``views`` (one per
    component), as one batch. ``layer=None`` copies every layer, else only ``layer``;
    ``nbytes`` is the total to move (it decides whether threads pay off)."""
    check_io_backend(io_backend)
    use_numpy = all(d.np_layers is not None and s.np_layers is not None for d, s in views)
    pairs = [p for d, s in views for p in _pairs(d, s, runs, layer, use_numpy)]
    if use_numpy:
        copy_numpy(pairs, nbytes, threads)
    else:
        copy_torch(pairs)


__all__ = ["IO_BACKENDS", "Runs", "check_io_backend", "coalesce", "copy_runs"]
