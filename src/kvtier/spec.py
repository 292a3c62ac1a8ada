"""KV-cache geometry: which per-token components a model caches, and their sizes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ._checks import index_in_range, positive_int
from .errors import UsageError

# Short, stable dtype names used in fingerprints, storage keys and the CLI.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.uint8: "u8",
}
for _attr, _name in (("float8_e4m3fn", "fp8e4m3"), ("float8_e5m2", "fp8e5m2")):
    if hasattr(torch, _attr):
        DTYPE_NAMES[getattr(torch, _attr)] = _name
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _named_tuple_field(obj: object, field: str, kind: type) -> None:
    """Check ``obj.<field>``: a non-empty tuple (a list is converted) of ``kind`` items
    with distinct ``.name``s; ``ValueError`` naming the owner, the field and the fault."""
    owner, items = type(obj).__name__, getattr(obj, field)
    if isinstance(items, list):
        items = tuple(items)
        object.__setattr__(obj, field, items)
    if not isinstance(items, tuple) or not items:
        raise UsageError(f"{owner}.{field} must be a non-empty tuple of {kind.__name__}, got {items!r}")
    for item in items:
        if not isinstance(item, kind):
            raise UsageError(f"{owner}.{field} must hold {kind.__name__}, got {item!r}")
    names = [item.name for item in items]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise UsageError(f"{owner}.{field} has duplicate names {dups}")


def parse_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``; ``ValueError`` listing the known names."""
    try:
        return DTYPES_BY_NAME[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}; supported: {', '.join(DTYPES_BY_NAME)}") from None


@dataclass(frozen=True)
class Component:
    """One per-token tensor of every layer: ``(head_num, head_dim)`` per token."""

    name: str
    head_num: int
    head_dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise UsageError(f"Component.name must be an identifier like 'k', got {self.name!r}")
        positive_int("Component.head_num", self.head_num)
        positive_int("Component.head_dim", self.head_dim)

    @property
    def token_elems(self) -> int:
        """Elements of this component for one token of one layer."""
        return self.head_num * self.head_dim


@dataclass(frozen=True)
class Shard:
    """Where a tensor-parallel shard sits in its model: rank ``rank`` of ``size``."""

    full: "KVSpec"
    rank: int
    size: int


@dataclass(frozen=True)
class KVSpec:
    """The KV geometry of a model: layers, per-token components and dtype.

    Every size is derived from these three fields; nothing is cached on the
    instance, so a spec is a plain value (hashable, comparable).
    """

    layer_num: int
    components: tuple[Component, ...]
    dtype: torch.dtype
    shard_of: Shard | None = field(default=None, repr=False)  # set by :meth:`shard`

    def __post_init__(self) -> None:
        positive_int("KVSpec.layer_num", self.layer_num)
        _named_tuple_field(self, "components", Component)
        if not isinstance(self.dtype, torch.dtype):
            raise UsageError(f"KVSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.dtype not in DTYPE_NAMES:
            raise UsageError(
                f"KVSpec.dtype {self.dtype} is not supported; supported: "
                f"{', '.join(str(d) for d in DTYPE_NAMES)}"
            )

    # -- constructors -----------------------------------------------------
    @classmethod
    def mha(cls, layer_num: int, head_num: int, head_dim: int, v_head_dim: int | None = None,
            dtype: torch.dtype = torch.bfloat16) -> "KVSpec":
        """MHA/GQA/MQA: components ``k`` and ``v``; ``v_head_dim`` defaults to ``head_dim``."""
        v_dim = head_dim if v_head_dim is None else v_head_dim
        return cls(layer_num, (Component("k", head_num, head_dim), Component("v", head_num, v_dim)), dtype)

    @classmethod
    def mla(cls, layer_num: int, kv_lora_rank: int, qk_rope_head_dim: int,
            dtype: torch.dtype = torch.bfloat16) -> "KVSpec":
        """MLA latent cache: one component ``kv`` of one head, ``rank + rope`` dims."""
        positive_int("KVSpec.mla.kv_lora_rank", kv_lora_rank)
        positive_int("KVSpec.mla.qk_rope_head_dim", qk_rope_head_dim)
        return cls(layer_num, (Component("kv", 1, kv_lora_rank + qk_rope_head_dim),), dtype)

    @classmethod
    def k_only(cls, layer_num: int, head_num: int, head_dim: int,
               dtype: torch.dtype = torch.bfloat16) -> "KVSpec":
        """K-only cache (e.g. an indexer's key cache): one component ``k``."""
        return cls(layer_num, (Component("k", head_num, head_dim),), dtype)

    # -- derived sizes ----------------------------------------------------
    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token over all layers and all components."""
        return self.layer_num * sum(c.token_elems for c in self.components) * self.element_size

    def page_elems(self, page_size: int) -> int:
        """Elements of one flat page (all components, all layers)."""
        return page_size * self.layer_num * sum(c.token_elems for c in self.components)

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise UsageError(f"unknown component {name!r}; this spec has {list(self.names)}")

    # -- tensor parallelism -------------------------------------------------
    def shard(self, rank: int, size: int) -> "KVSpec":
        """The part of this spec held by tensor-parallel rank ``rank`` of ``size``.

        Each multi-head component's heads split evenly (``head_num % size == 0``);
        single-head components (MLA latents) are replicated. The shard remembers the
        full spec: its :meth:`fingerprint` names the full model and
        :meth:`head_range` gives its global heads.
        """
        if self.shard_of is not None:
            raise UsageError("shard() takes the full spec; this spec is already a shard")
        positive_int("KVSpec.shard.size", size)
        index_in_range("KVSpec.shard rank", rank, size)
        for c in self.components:
            if c.head_num > 1 and c.head_num % size:
                raise UsageError(f"component {c.name!r} has {c.head_num} heads, not divisible by shard size {size}")
        comps = tuple(c if c.head_num == 1 else Component(c.name, c.head_num // size, c.head_dim)
                      for c in self.components)
        return KVSpec(self.layer_num, comps, self.dtype, Shard(self, rank, size))

    @property
    def full(self) -> "KVSpec":
        """The whole model's spec (``self`` unless this is a shard)."""
        return self if self.shard_of is None else self.shard_of.full

    def head_range(self, name: str) -> tuple[int, int]:
        """Global heads ``[start, stop)`` of component ``name`` held by this spec."""
        c = self.component(name)
        if self.shard_of is None or self.full.component(name).head_num == 1:
            return 0, c.head_num
        start = self.shard_of.rank * c.head_num
        return start, start + c.head_num

    def fingerprint(self) -> str:
        """Short stable text naming dims, dtype and component names of the full model,
        e.g. ``L61-bf16-k=8x192-v=8x128``. Equal specs give equal fingerprints, and
        every shard of a spec gives the full spec's."""
        if self.shard_of is not None:
            return self.full.fingerprint()
        comps = "-".join(f"{c.name}={c.head_num}x{c.head_dim}" for c in self.components)
        return f"L{self.layer_num}-{DTYPE_NAMES[self.dtype]}-{comps}"
