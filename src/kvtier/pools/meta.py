"""Zero-copy span metadata of host pages, vectorized: no Python loop per page.

Every pointer is ``base + page * page_stride + ...`` with strides read off the
buffers, so one formula serves every layout (see ``kvtier.layout``).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from ..layout import Layout
from ..spec import KVSpec


def _spans(pages: torch.Tensor, base: np.ndarray, page_stride: np.ndarray, inner_off: np.ndarray,
           inner_size: list[int]) -> tuple[list[int], list[int]]:
    """``ptr[p, j, c] = base[c] + pages[p] * page_stride[c] + inner_off[j, c]``, flattened.

    ``inner_off``: ``(pieces per page per component, components)`` byte offsets;
    ``inner_size``: span sizes for one page, in output order.
    """
    p = pages.numpy()
    ptrs = base + p[:, None, None] * page_stride + inner_off[None]
    return ptrs.reshape(-1).tolist(), inner_size * len(p)


def page_spans(layout: Layout, spec: KVSpec, buffers: dict[str, torch.Tensor],
               pages: torch.Tensor) -> tuple[list[int], list[int]]:
    """Spans of whole pages: for each page, each index of the layout's outer axes
    (``layer`` for ``layer_first``), each component, the contiguous inner block."""
    es = spec.element_size
    bufs = [buffers[c.name] for c in spec.components]
    axis = layout.order.index("page")
    outer_shape = tuple(bufs[0].shape[:axis])
    assert all(tuple(b.shape[:axis]) == outer_shape for b in bufs), "outer axes must match across components"
    outer = list(itertools.product(*(range(n) for n in outer_shape)))
    inner_off = np.array([[sum(i * s * es for i, s in zip(idx, b.stride()[:axis])) for b in bufs] for idx in outer],
                         dtype=np.int64).reshape(len(outer), len(bufs))
    span = [int(np.prod(b.shape[axis + 1:])) * es for b in bufs]
    base = np.array([b.data_ptr() for b in bufs], dtype=np.int64)
    page_stride = np.array([b.stride(axis) * es for b in bufs], dtype=np.int64)
    return _spans(pages, base, page_stride, inner_off, span * len(outer))


def split_head_spans(spec: KVSpec, buffers: dict[str, torch.Tensor], pages: torch.Tensor,
                     split_factor: int) -> tuple[list[int], list[int]]:
    """Spans of head groups, for a layout ordered ``(page, head, ...)``: for each page,
    each of ``split_factor`` groups, each component."""
    es = spec.element_size
    bufs = [buffers[c.name] for c in spec.components]
    group_bytes = [b.shape[1] // split_factor * b.stride(1) * es for b in bufs]
    inner_off = np.array([[g * gb for gb in group_bytes] for g in range(split_factor)], dtype=np.int64)
    base = np.array([b.data_ptr() for b in bufs], dtype=np.int64)
    page_stride = np.array([b.stride(0) * es for b in bufs], dtype=np.int64)
    return _spans(pages, base, page_stride, inner_off, group_bytes * split_factor)
