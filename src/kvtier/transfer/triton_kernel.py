"""One strided Triton kernel for every layout, geometry and direction.

A transfer is "copy page ``src_pages[i]`` of one view to page ``dst_pages[i]`` of
another", where both views are canonical page views (page axis first, then up to
four inner axes such as ``(slot, layer, head, dim)``) with arbitrary strides. The
kernel gets each side's base pointer and strides, so every layout (an axis order
is only strides) and every component (its own element counts) runs the same code.

Grid: ``(pages, blocks per page)``; a block is ``BLOCK`` consecutive elements of
the page's inner index space, innermost axis fastest. ``BLOCK`` is picked from the
page's element count, so small pages (16 tokens x 1 head x 64 dims = 1,024 elements)
get one full block each instead of many tiny ones, and large pages get several.

On CUDA this is the ``io_backend="kernel"`` path; on the CPU it runs under
``TRITON_INTERPRET=1`` (how the tests exercise it without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import IntegrityError

MIN_BLOCK, MAX_BLOCK = 128, 4096


@triton.jit
def _copy_pages_kernel(dst_ptr, src_ptr, dst_pages_ptr, src_pages_ptr, dst_page_stride, src_page_stride,
                       n1, n2, n3, elems,
                       ds0, ds1, ds2, ds3, ss0, ss1, ss2, ss3, BLOCK: tl.constexpr):
    page = tl.program_id(0)
    block = tl.program_id(1)
    dst_page = tl.load(dst_pages_ptr + page).to(tl.int64)
    src_page = tl.load(src_pages_ptr + page).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < elems
    i3 = offs % n3
    rest = offs // n3
    i2 = rest % n2
    rest = rest // n2
    i1 = rest % n1
    i0 = rest // n1
    src_off = src_page * src_page_stride + i0 * ss0 + i1 * ss1 + i2 * ss2 + i3 * ss3
    dst_off = dst_page * dst_page_stride + i0 * ds0 + i1 * ds1 + i2 * ds2 + i3 * ds3
    values = tl.load(src_ptr + src_off, mask=mask)
    tl.store(dst_ptr + dst_off, values, mask=mask)


def _inner(view: torch.Tensor) -> tuple[list[int], list[int]]:
    """Inner sizes and strides padded to four axes (size-1 axes in front)."""
    sizes, strides = list(view.shape[1:]), list(view.stride()[1:])
    if len(sizes) > 4:
        raise IntegrityError(f"the copy kernel takes at most 4 inner axes, got {len(sizes)}")
    pad = 4 - len(sizes)
    return [1] * pad + sizes, [0] * pad + strides


def block_size(elems: int) -> int:
    """Elements a program copies: the page's element count rounded up to a power of
    two, within [MIN_BLOCK, MAX_BLOCK]."""
    return max(MIN_BLOCK, min(MAX_BLOCK, triton.next_power_of_2(max(elems, 1))))


def copy_pages(dst: torch.Tensor, src: torch.Tensor, dst_pages: torch.Tensor, src_pages: torch.Tensor) -> None:
    """``dst[dst_pages[i]] = src[src_pages[i]]`` for canonical page views (page axis first)."""
    n = dst_pages.numel()
    if n == 0:
        return
    if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype:
        raise IntegrityError(f"page copy between {dst.dtype} pages {tuple(dst.shape[1:])} and {src.dtype} pages "
                             f"{tuple(src.shape[1:])}")
    sizes, d_strides = _inner(dst)
    _, s_strides = _inner(src)
    elems = sizes[0] * sizes[1] * sizes[2] * sizes[3]
    block = block_size(elems)
    grid = (n, triton.cdiv(elems, block))
    _copy_pages_kernel[grid](dst, src, dst_pages, src_pages,
                             dst.stride(0), src.stride(0), sizes[1], sizes[2], sizes[3], elems,
                             *d_strides, *s_strides, BLOCK=block)
