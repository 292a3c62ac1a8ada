"""How one vLLM KV block maps onto kvtier pages: canonical K/V components or opaque bytes.

vLLM hands the offloading worker each layer's KV cache as ``(num_blocks, page_bytes)``
int8 rows. What the bytes of a row mean depends on the attention backend and vLLM's
``kv_cache_layout``. Where kvtier knows that arrangement, a block becomes one kvtier
page of ``block_size`` slots of a real :class:`~kvtier.spec.KVSpec` — K and V as
components (MLA: one component ``kv`` of one head) — so the host tier and storage hold
canonical, head-shardable pages that any engine with the same model and dtype reads.
Everywhere else a block is stored whole as an *opaque* page: one slot of one
single-head ``uint8`` component holding each layer's row as it is; those pages round
trip exactly but only the same backend and layout can read them (their keys say so).

| backend (``kv_cache_layout``) | block interior | kvtier page |
|---|---|---|
| ``CPU_ATTN`` (``LBHNC``) | ``(head, kv, slot, dim)``: per head, K of every slot, then V | canonical ``k``, ``v`` |
| ``FLASH_ATTN``, ``TRITON_ATTN``, ``FLASHINFER`` (``LBNHC``) | ``(slot, head, kv, dim)`` | canonical ``k``, ``v`` |
| the same (``LBHNC``) | ``(head, slot, kv, dim)`` | canonical ``k``, ``v`` |
| any MLA backend | ``(slot, dim)`` of ``kv_lora_rank + rope`` | canonical ``kv`` (1 head) |
| anything else, quantized caches with scales, padded or packed pages | — | opaque |

A canonical mapping is accepted only when its elements fill the layer's page bytes
exactly; a view built by reshaping and permuting that row is a bijection, so a store
followed by a load is byte-exact whatever the backend. Only the CPU row is verified
end to end here; the GPU rows follow vLLM 0.32's code: a layer's logical ``(block,
head, slot, C)`` cache, ``C`` a head's K then V of one token (``head_size +
head_size_v``), which its kernels read as ``kv_cache.transpose(1, 2).split(head_size,
-1)``, in the physical order of ``kv_cache_layout``'s letters.

Canonical page names carry a version (``kv2``): the GPU rows took K and V as the
outermost axis before, so their pages under the first names may hold other bytes.
Opaque names carry the block's dtype and heads: such bytes mean nothing without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..._checks import is_int
from ...errors import UsageError
from ...spec import DTYPE_NAMES, DTYPES_BY_NAME, Component, KVSpec

_MHA_ORDERS: dict[tuple[str, str], tuple[str, ...]] = {
    ("CPU_ATTN", "LBHNC"): ("head", "kv", "slot", "dim"),
    **{(b, "LBNHC"): ("slot", "head", "kv", "dim") for b in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")},
    **{(b, "LBHNC"): ("head", "slot", "kv", "dim") for b in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")},
}
_MLA_ORDER = ("slot", "head", "dim")

#: vLLM cache dtype names -> torch dtypes kvtier can page.
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
           "float32": torch.float32, "float": torch.float32}
for _name, _attr in (("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


def cache_dtype(name: str) -> torch.dtype | None:
    """vLLM's cache dtype name (``"bfloat16"``, ``"fp8_e4m3"``) as a torch dtype, or None."""
    return _DTYPES.get(str(name).removeprefix("torch."))


@dataclass(frozen=True)
class Geometry:
    """What vLLM says about one layer's KV block (the same for every layer of a group)."""

    backend: str            # attention backend name, e.g. "CPU_ATTN"
    layout: str             # vLLM kv_cache_layout, e.g. "LBHNC"
    use_mla: bool
    num_kv_heads: int       # on this worker
    head_size: int          # MLA: kv_lora_rank + qk_rope_head_dim
    block_tokens: int
    dtype: torch.dtype | None
    total_kv_heads: int | None = None  # the model's; None: this worker holds them all
    tp_rank: int = 0
    tp_size: int = 1

    def shard_of(self, full: KVSpec) -> KVSpec:
        """This worker's part of ``full``: its heads as a shard (``KVSpec.shard``), so
        that storage objects are cut by global head range and any tensor-parallel size
        reads them. Ranks that replicate heads (more ranks than KV heads) hold shard
        ``rank * heads // tp_size`` of ``heads``; single-head (MLA) specs are whole on
        every rank."""
        if self.tp_size == 1 or all(c.head_num == 1 for c in full.components):
            return full
        heads = self.total_kv_heads or self.num_kv_heads * self.tp_size
        if heads >= self.tp_size:
            return full.shard(self.tp_rank, self.tp_size)
        return full.shard(self.tp_rank * heads // self.tp_size, heads)


@dataclass(frozen=True)
class BlockFormat:
    """One vLLM block as one kvtier page.

    ``order`` is the block interior's axis order over ``kv``/``head``/``slot``/``dim``
    (``None``: opaque). ``page_size`` is the kvtier page size in slots: the block's
    tokens for canonical pages, 1 for opaque ones.
    """

    name: str
    spec: KVSpec
    page_size: int
    page_bytes: int          # bytes of one layer's block that the views cover
    order: tuple[str, ...] | None

    @property
    def canonical(self) -> bool:
        return self.order is not None

    def layer_views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{component: (block, slot, head, dim) view}`` of one layer's int8
        ``(num_blocks, >= page_bytes)`` rows; no copy."""
        if rows.dim() != 2 or rows.stride(1) != 1 or rows.shape[1] < self.page_bytes:
            raise UsageError(f"kvtier: layer rows must be (num_blocks, >= {self.page_bytes}) bytes with contiguous "
                             f"rows, got shape {tuple(rows.shape)} strides {rows.stride()}")
        page = rows[:, :self.page_bytes].view(self.spec.dtype)
        if self.order is None:  # one slot of one head: the whole row
            return {"blk": page.view(page.shape[0], 1, 1, page.shape[1])}
        comps = self.spec.components
        sizes = {"kv": len(comps), "head": comps[0].head_num, "slot": self.page_size, "dim": comps[0].head_dim}
        block = page.unflatten(1, tuple(sizes[a] for a in self.order))
        if "kv" not in self.order:  # MLA: one component
            block = block.unsqueeze(1 + len(self.order))
            order = (*self.order, "kv")
        else:
            order = self.order
        canon = block.permute(0, *(1 + order.index(a) for a in ("kv", "slot", "head", "dim")))
        return {c.name: canon[:, i] for i, c in enumerate(comps)}

    def views(self, layer_rows: Sequence[torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
        """``{component: per-layer (block, slot, head, dim) views}`` over every layer."""
        per_layer = [self.layer_views(r) for r in layer_rows]
        return {name: tuple(v[name] for v in per_layer) for name in self.spec.names}


def opaque_format(geometry: Geometry, layers: int, page_bytes: int) -> BlockFormat:
    """Whole blocks as bytes: a ``(layers, 1 slot, 1 head, page_bytes)`` uint8 page.

    With tensor parallelism each rank's bytes are its own: the spec has one "head" per
    rank and each rank holds its own as a shard, so storage keeps the ranks' bytes
    apart, and a reader of another tensor-parallel size (another head count) misses."""
    g = geometry
    spec = KVSpec(layers, (Component("blk", g.tp_size, page_bytes),), torch.uint8)
    if g.tp_size > 1:
        spec = spec.shard(g.tp_rank, g.tp_size)
    dtype = DTYPE_NAMES.get(g.dtype, "unknown-dtype")
    name = f"opaque.{g.backend}.{g.layout}.{dtype}.h{g.num_kv_heads}x{g.head_size}.b{g.block_tokens}.{page_bytes}B"
    return BlockFormat(name, spec, 1, page_bytes, None)


def block_format(geometry: Geometry, layers: int, page_bytes: int) -> BlockFormat:
    """The canonical format of ``geometry`` when kvtier knows its backend and layout and
    its elements fill ``page_bytes`` exactly; otherwise the opaque one."""
    g = geometry
    order = _MLA_ORDER if g.use_mla else _MHA_ORDERS.get((g.backend, g.layout))
    if order is None or g.dtype is None or g.dtype not in DTYPE_NAMES:
        return opaque_format(g, layers, page_bytes)
    if g.use_mla:
        full = KVSpec(layers, (Component("kv", 1, g.head_size),), g.dtype)
    else:
        heads = (g.total_kv_heads or g.num_kv_heads * g.tp_size) if g.tp_size > 1 else g.num_kv_heads
        if g.tp_size > 1 and max(1, heads // g.tp_size) != g.num_kv_heads:
            return opaque_format(g, layers, page_bytes)  # heads split some other way: keep the bytes as they are
        full = KVSpec(layers, (Component("k", heads, g.head_size), Component("v", heads, g.head_size)), g.dtype)
    spec = g.shard_of(full)
    if spec.page_elems(g.block_tokens) // layers * spec.element_size != page_bytes:
        return opaque_format(g, layers, page_bytes)
    name = f"kv2.{spec.fingerprint()}.b{g.block_tokens}"
    return BlockFormat(name, spec, g.block_tokens, page_bytes, order)


# -- formats across processes (the pool file's header): plain JSON ----------------------
def format_to_json(fmt: BlockFormat) -> dict:
    spec = fmt.spec
    full = spec.full
    shard = [spec.shard_of.rank, spec.shard_of.size] if spec.shard_of is not None else None
    return {"name": fmt.name, "page_size": fmt.page_size, "page_bytes": fmt.page_bytes,
            "order": list(fmt.order) if fmt.order is not None else None, "layers": full.layer_num,
            "dtype": DTYPE_NAMES[full.dtype], "components": [[c.name, c.head_num, c.head_dim] for c in full.components],
            "shard": shard}


def format_from_json(d: dict) -> BlockFormat:
    """The :class:`BlockFormat` written by :func:`format_to_json`; ``ValueError`` for
    anything else (the checks of ``KVSpec`` and ``Component`` included)."""
    if not isinstance(d, dict):
        raise UsageError(f"format is {type(d).__name__}, not an object")
    dtype = DTYPES_BY_NAME.get(d.get("dtype"))
    comps = d.get("components")
    if dtype is None or not isinstance(comps, list) or not all(isinstance(c, list) and len(c) == 3 for c in comps):
        raise UsageError(f"format has dtype {d.get('dtype')!r}, components {comps!r:.80}")
    full = KVSpec(d.get("layers"), tuple(Component(*c) for c in comps), dtype)
    shard = d.get("shard")
    spec = full.shard(*shard) if isinstance(shard, list) and len(shard) == 2 else full
    order = d.get("order")
    axes = (sorted(_MLA_ORDER), sorted(("kv", "head", "slot", "dim")))
    if order is not None and (not isinstance(order, list) or sorted(order) not in axes):
        raise UsageError(f"format has block order {order!r}")
    name, page_size, page_bytes = d.get("name"), d.get("page_size"), d.get("page_bytes")
    for field, v in (("page_size", page_size), ("page_bytes", page_bytes)):
        if not is_int(v) or v <= 0:
            raise UsageError(f"format has {field} {v!r}")
    if not isinstance(name, str) or not name:
        raise UsageError(f"format has name {name!r}")
    return BlockFormat(name, spec, page_size, page_bytes, tuple(order) if order is not None else None)
