"""sglang's HiCache host pools seen as kvtier pools, in place (no copy, no sglang import).

An sglang host pool keeps each component in one tensor whose axes are a kvtier layout
with the token axis either whole (``size``) or split into ``(page, slot)``:

    sglang layout       component buffer (MHA K or V; MLA latent has head = 1)    kvtier layout
    layer_first         (layer, size, head, dim)                                  layer_first
    page_first          (size, layer, head, dim)                                  page_first
    page_first_direct   (page, layer, slot, head, dim)                            page_first_direct
    page_head           (page, head, slot, layer, dim)                            page_head
    page_unified (MLA)  (page, layer, slot, dim)                                  page_first_direct

So a view in kvtier's order is a ``reshape`` of the same memory. Only the pool's
attributes are read (``layout``, ``page_size``, ``layer_num``, ``dtype``, ``head_num``,
``head_dim``, ``v_head_dim``, ``k_buffer``/``v_buffer``, ``kv_buffer``, ``kv_cache_dim``);
none of its page methods is called, since several raise for asymmetric K/V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import UnsupportedPoolError, UsageError
from ...layout import get_layout
from ...pools import HostKVPool
from ...spec import Component, KVSpec


@dataclass(frozen=True)
class Family:
    """How one kind of sglang host pool maps to kvtier: its components and layouts."""

    name: str
    marker: str              # an attribute only pools of this family have
    layouts: dict[str, str]  # sglang layout -> kvtier layout of the same bytes


FAMILIES = (
    Family("mla", "kv_lora_rank", {"layer_first": "layer_first", "page_first": "page_first",
                   "page_first_direct": "page_first_direct", "page_unified": "page_first_direct"}),
    Family("mha", "v_head_dim", {"layer_first": "layer_first", "page_first": "page_first",
                   "page_first_direct": "page_first_direct", "page_head": "page_head"}),
)


@dataclass(frozen=True)
class Topology:
    """Where this rank's pool sits: tensor-parallel rank and size, and whether its KV
    is the same on every rank (MLA and other rank-replicated caches)."""

    tp_rank: int = 0
    tp_size: int = 1
    replicated: bool = False


def family_of(pool) -> Family:
    for family in FAMILIES:
        if hasattr(pool, family.marker):
            return family
    raise UnsupportedPoolError(f"{type(pool).__name__} is not an MHA or MLA KV host pool kvtier can read in place "
                               f"(it has neither v_head_dim nor kv_lora_rank)")


def pool_spec(pool, topology: Topology) -> KVSpec:
    """This rank's KVSpec. MHA heads of a non-replicated pool are this rank's shard of
    ``head_num * tp_size`` heads, so every tensor-parallel size shares stored pages."""
    if family_of(pool).name == "mla":
        return KVSpec(pool.layer_num, (Component("kv", 1, pool.kv_cache_dim),), pool.dtype)
    if topology.replicated or topology.tp_size == 1:
        return KVSpec.mha(pool.layer_num, pool.head_num, pool.head_dim, pool.v_head_dim, pool.dtype)
    full = KVSpec.mha(pool.layer_num, pool.head_num * topology.tp_size, pool.head_dim, pool.v_head_dim, pool.dtype)
    return full.shard(topology.tp_rank, topology.tp_size)


def component_buffers(pool) -> dict[str, torch.Tensor]:
    """The pool's tensor of each component, as sglang allocated it."""
    if getattr(pool, "kv_buffer", None) is None:
        raise UnsupportedPoolError(f"{type(pool).__name__} has no host buffer (an allocator-only pool); "
                                   "kvtier needs the materialized pool")
    if family_of(pool).name == "mla":
        return {"kv": pool.kv_buffer}
    return {"k": pool.k_buffer, "v": pool.v_buffer}


def kvtier_layout(pool) -> str:
    family = family_of(pool)
    if getattr(pool, "dcp_size", 1) != 1:
        raise UnsupportedPoolError(f"{type(pool).__name__} is split by decode context parallelism "
                                   f"(dcp_size={pool.dcp_size}); kvtier reads whole pages only")
    try:
        return family.layouts[pool.layout]
    except KeyError:
        raise UnsupportedPoolError(f"sglang {family.name.upper()} host layout {pool.layout!r} is not readable in "
                                   f"place; use --hicache-mem-layout {' or '.join(family.layouts)}") from None


def in_kvtier_order(buffer: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """``buffer`` viewed with kvtier's ``shape``: the same elements in the same order.

    NOTE: sglang's shape is kvtier's with ``(page, slot)`` merged into one token axis,
    or with MLA's one-head axis left out, or flat (a page as ``get_data_page`` gives it);
    anything else would be another order.
    """
    target, got = tuple(shape), tuple(buffer.shape)
    merged = [target[:i] + (target[i] * target[i + 1],) + target[i + 2:] for i in range(len(target) - 1)]
    headless = [target[:i] + target[i + 1:] for i, n in enumerate(target) if n == 1]
    if got not in (target, (math.prod(target),)) and got not in merged and got not in headless:
        raise UnsupportedPoolError(f"{what} has shape {got}, which is not kvtier's {target} in the same order")
    if not buffer.is_contiguous():
        raise UnsupportedPoolError(f"{what} is not contiguous (strides {buffer.stride()})")
    return buffer.view(target)  # every shape accepted above holds prod(target) elements


def wrap_pool(pool, topology: Topology = Topology(), buffers: dict[str, torch.Tensor] | None = None) -> HostKVPool:
    """A :class:`HostKVPool` over ``pool``'s own memory (or over ``buffers``, tensors
    laid out like the pool's but holding other pages, e.g. one flat page)."""
    spec = pool_spec(pool, topology)
    layout = get_layout(kvtier_layout(pool))
    buffers = component_buffers(pool) if buffers is None else buffers
    first = buffers[spec.names[0]]
    per_page = pool.page_size * spec.layer_num * spec.components[0].token_elems
    if first.numel() % per_page:
        raise UnsupportedPoolError(f"{type(pool).__name__}.{spec.names[0]} holds {first.numel()} elements, not whole "
                                   f"pages of {per_page}")
    sizes = {"page": first.numel() // per_page, "slot": pool.page_size, "layer": spec.layer_num}
    views = {c.name: in_kvtier_order(buffers[c.name], layout.shape({**sizes, "head": c.head_num, "dim": c.head_dim}),
                                     f"{type(pool).__name__} {c.name} buffer")
             for c in spec.components}
    return HostKVPool.from_buffers(spec, views, pool.page_size, layout=layout.name)


def wrap_flat_page(pool, topology: Topology, page: torch.Tensor) -> HostKVPool:
    """A one-page :class:`HostKVPool` over a page in sglang's flat form: what the pool's
    ``get_data_page(i).flatten()`` returns, the components one after the other, each
    in the pool's own axis order."""
    spec = pool_spec(pool, topology)
    elems = spec.page_elems(pool.page_size)
    if not isinstance(page, torch.Tensor) or page.dtype != spec.dtype or page.numel() != elems:
        got = f"{page.dtype} tensor of {page.numel()}" if isinstance(page, torch.Tensor) else type(page).__name__
        raise UsageError(f"a flat page of this pool is a {spec.dtype} tensor of {elems} elements, got {got}")
    parts = page.reshape(-1).split([pool.page_size * spec.layer_num * c.token_elems for c in spec.components])
    return wrap_pool(pool, topology, {c.name: part for c, part in zip(spec.components, parts)})
