"""The objects of one page on the zero-copy path (Mooncake): their names and the
spans of pool memory they move from and to."""

from __future__ import annotations

import torch

from ..errors import UnsupportedLayoutError
from ..layout import Layout
from ..pools import HostKVPool
from .objects import PagePlan


def escape_key(key: str) -> str:
    """``key`` with ``%`` and ``#`` escaped, so that ``#`` can end the key in an object name."""
    return key.replace("%", "%25").replace("#", "%23")


def page_objects(spec, layout: Layout, plan: PagePlan, writing: bool) -> list[tuple[str, tuple | None]]:
    """``(suffix, pieces)`` per object of one page; pieces give the spans (``None``: the
    whole page as the pool's page buffer metadata gives it)."""
    fmt = layout.page_format
    if layout.supports_split_heads:
        parts = plan.write_parts if writing else plan.read_parts
        return [(f"{plan.prefix}/{fmt}/{p.field.rsplit('/', 1)[1]}", p.pieces) for p in parts]
    if spec.shard_of is not None:
        raise UnsupportedLayoutError(
            f"zero-copy storage of a tensor-parallel shard needs contiguous head groups, which layout "
            f"{layout.name!r} does not give; use layout='page_head'")
    return [(f"{plan.prefix}/{fmt}/page", None)]


def spans(pool: HostKVPool, slot: int, pieces) -> tuple[list[int], list[int]]:
    """Pointers and byte sizes of one object of the page starting at token ``slot``."""
    if pieces is None:
        return pool.get_page_buffer_meta(torch.arange(slot, slot + pool.page_size))
    es, page = pool.spec.element_size, slot // pool.page_size
    ptrs, sizes = [], []
    for name, h0, h1 in pieces:  # page_head buffers: (page, head, slot, layer, dim)
        buf = pool.buffers[name]
        ptrs.append(buf.data_ptr() + (page * buf.stride(0) + h0 * buf.stride(1)) * es)
        sizes.append((h1 - h0) * buf.stride(1) * es)
    return ptrs, sizes
