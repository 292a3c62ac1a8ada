"""Page transfers between pools: io backends as a dispatch table."""

from __future__ import annotations

from .copy import copy_numpy, copy_torch
from .runs import Runs, coalesce

#: ``io_backend`` names. On the CPU both run the threaded strided-view engine
#: (numpy views, GIL released); elsewhere both run torch ``copy_`` on views until
#: a dedicated GPU kernel takes ``"kernel"``.
IO_BACKENDS = ("direct", "kernel")


def check_io_backend(io_backend: str) -> None:
    if io_backend not in IO_BACKENDS:
        raise ValueError(f"unknown io_backend {io_backend!r}; supported: {', '.join(IO_BACKENDS)}")


def copy_runs(dst, src, runs: Runs, *, layer: int | None, page_bytes: int, io_backend: str, threads: int) -> None:
    """Copy page runs from ``src`` to ``dst`` (both ``PageViews`` of one component).

    ``layer=None`` copies every layer, else only ``layer``. ``page_bytes`` is the size
    of one page of this component over the layers copied (for thread scheduling).
    """
    check_io_backend(io_backend)
    use_numpy = dst.np_layers is not None and src.np_layers is not None
    d_all, d_layers = dst.arrays(use_numpy)
    s_all, s_layers = src.arrays(use_numpy)
    runs3 = list(zip(runs.dst_start, runs.src_start, runs.length))
    if layer is not None:
        d, s = d_layers[layer], s_layers[layer]
        pairs = [(d[a:a + n], s[b:b + n]) for a, b, n in runs3]
    elif d_all is not None and s_all is not None:
        pairs = [(d_all[a:a + n], s_all[b:b + n]) for a, b, n in runs3]
    else:
        pairs = [(d[a:a + n], s[b:b + n]) for d, s in zip(d_layers, s_layers) for a, b, n in runs3]
    if use_numpy:
        copy_numpy(pairs, sum(runs.length) * page_bytes, threads)
    else:
        copy_torch(pairs)


__all__ = ["IO_BACKENDS", "Runs", "check_io_backend", "coalesce", "copy_runs"]
