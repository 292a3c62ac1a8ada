"""What each host layout costs for a given geometry: the numbers behind ``kvtier inspect``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._checks import positive_int
from ..layout import LAYOUTS, contiguous_run
from ..pools import HostKVPool
from ..spec import KVSpec


@dataclass(frozen=True)
class LayoutReport:
    layout: str
    page_bytes: int            # one page, all layers and components
    spans_per_page: int        # zero-copy (ptr, size) pieces per page
    span_bytes: tuple[int, int]  # smallest, largest span
    split_heads: bool          # contiguous head groups (heterogeneous TP sharing)
    max_split: int             # largest split factor that divides every head count (0: unsupported)
    load_chunk_bytes: int      # smallest contiguous piece a per-layer load copies
    load_chunks_per_page: int  # pieces per page for one layer, all components
    page_format: str


def memory_bytes(page_size: int) -> int:
    """Host memory :func:`layout_reports` takes: the pools live on the ``meta`` device (shapes,
    no bytes), so only the page's token-slot indices and their checked copies are real."""
    return 4 * 8 * page_size


def layout_reports(spec: KVSpec, page_size: int) -> list[LayoutReport]:
    """One report per layout, measured on a one-page ``meta`` pool of ``spec`` (nothing allocated)."""
    positive_int("page_size", page_size)
    reports = []
    for name in LAYOUTS:
        pool = HostKVPool(spec, page_size, page_size, layout=name, device="meta")
        _, sizes = pool.get_page_buffer_meta(torch.arange(page_size))
        runs = {}
        for c in spec.components:
            page_layer = pool.page_views[c.name].layers[0][0]  # (slot, head, dim)
            runs[c.name] = contiguous_run(page_layer)
        heads = math.gcd(*(c.head_num for c in spec.components))
        reports.append(LayoutReport(
            layout=name,
            page_bytes=pool.page_bytes,
            spans_per_page=len(sizes),
            span_bytes=(min(sizes), max(sizes)),
            split_heads=pool.supports_split_heads,
            max_split=heads if pool.supports_split_heads else 0,
            load_chunk_bytes=min(runs.values()) * spec.element_size,
            load_chunks_per_page=sum(page_size * c.token_elems // runs[c.name] for c in spec.components),
            page_format=pool.page_format,
        ))
    return reports
