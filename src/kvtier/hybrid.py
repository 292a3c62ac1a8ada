"""Hybrid KV geometry: a model's layers in groups, each with its own geometry and attention.

Most models engines serve mix attention kinds: MiMo-V2-Flash has 9 full-attention
layers of 4 KV heads and 39 sliding-window layers (window 128) of 8; gpt-oss
alternates sliding and full layers; Gemma 3 has 5 sliding : 1 full. A
:class:`HybridSpec` names each group of layers (:class:`KVGroup`): the model layer
ids it covers, their :class:`~kvtier.spec.KVSpec` (one geometry for all of them), and
their :class:`Attention` (full, or sliding with a window of ``W`` past tokens).

What a group's kind means for a cache (docs/hybrid.md): a prefix of ``p`` tokens is
reusable only when every full group has all of ``[0, p)`` and every sliding group
has the pages covering ``[p - W, p)``; sliding KV outside every window that a later
request can resume from is not worth keeping.

A plain ``KVSpec`` is the one-group case (:meth:`HybridSpec.of`), so everything that
takes a ``KVSpec`` keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, partial
from typing import Iterable, Mapping, Sequence

import torch

from ._checks import is_int, non_negative_int, positive_int
from .errors import UsageError
from .spec import Component, KVSpec, _named_tuple_field

#: Attention kinds a group may have; a recurrent-state kind (fixed-size per-request
#: state, e.g. Mamba or linear attention) would be a third, with no per-token pages.
ATTENTION_KINDS = ("full", "sliding")


@dataclass(frozen=True)
class Attention:
    """``full``: every query sees every past token. ``sliding``: a query sees the
    ``window`` tokens before it (itself not counted)."""

    kind: str = "full"
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise UsageError(f"Attention.kind must be one of {list(ATTENTION_KINDS)}, got {self.kind!r}")
        if self.kind == "full" and self.window is not None:
            raise UsageError(f"full attention has no window, got window={self.window!r}")
        if self.kind == "sliding":
            positive_int("Attention.window", self.window)

    @classmethod
    def sliding(cls, window: int) -> "Attention":
        return cls("sliding", window)

    @property
    def is_full(self) -> bool:
        return self.kind == "full"

    @property
    def tag(self) -> str:
        """``full`` or ``swa<W>`` (fingerprints, reports)."""
        return "full" if self.is_full else f"swa{self.window}"

    def needed_tokens(self, prefix: int) -> range:
        """Token positions of ``[0, prefix)`` whose KV a request resuming after
        ``prefix`` tokens needs from this group."""
        return range(0, prefix) if self.is_full else range(max(0, prefix - self.window), prefix)

    def needed_pages(self, prefix: int, page_size: int) -> range:
        """The pages (of ``page_size`` tokens) holding :meth:`needed_tokens`: whole
        pages, so a sliding group keeps the page the window starts in."""
        tokens = self.needed_tokens(prefix)
        return range(tokens.start // page_size, -(-tokens.stop // page_size)) if tokens else range(0)


FULL = Attention()


@dataclass(frozen=True)
class KVGroup:
    """Model layers ``layers`` (ascending ids), stored with ``spec`` (one of its layers
    per id, in that order) and attending with ``attention``."""

    name: str
    layers: tuple[int, ...]
    spec: KVSpec
    attention: Attention = FULL

    def __post_init__(self) -> None:
        Component(self.name, 1, 1)  # the same identifier rule as component names
        if isinstance(self.layers, (list, range)):
            object.__setattr__(self, "layers", tuple(self.layers))
        if not isinstance(self.layers, tuple) or not self.layers:
            raise UsageError(f"KVGroup {self.name!r}: layers must be a non-empty tuple of ints, got {self.layers!r}")
        for layer in self.layers:
            non_negative_int(f"KVGroup {self.name!r}: a layer id", layer)
        if list(self.layers) != sorted(set(self.layers)):
            raise UsageError(f"KVGroup {self.name!r}: layer ids must ascend without repeats, got {list(self.layers)}")
        if not isinstance(self.spec, KVSpec):
            raise UsageError(f"KVGroup {self.name!r}: spec must be a KVSpec, got {type(self.spec).__name__}")
        if self.spec.layer_num != len(self.layers):
            raise UsageError(f"KVGroup {self.name!r}: {len(self.layers)} layer ids for a spec of "
                             f"{self.spec.layer_num} layers")
        if not isinstance(self.attention, Attention):
            raise UsageError(f"KVGroup {self.name!r}: attention must be an Attention, got {self.attention!r}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token over this group's layers."""
        return self.spec.bytes_per_token

    def fingerprint(self) -> str:
        """``<name>:<attention>:<layer ranges>:<spec fingerprint>``."""
        return f"{self.name}:{self.attention.tag}:{layer_ranges(self.layers)}:{self.spec.fingerprint()}"


@dataclass(frozen=True)
class HybridSpec:
    """A model's KV as named layer groups that together cover layers ``0 .. n-1`` once
    each. Every size is derived; the spec is a plain value (hashable, comparable)."""

    groups: tuple[KVGroup, ...]

    def __post_init__(self) -> None:
        _named_tuple_field(self, "groups", KVGroup)
        owner: dict[int, str] = {}
        for g in self.groups:
            for layer in g.layers:
                if layer in owner:
                    raise UsageError(f"layer {layer} is in groups {owner[layer]!r} and {g.name!r}")
                owner[layer] = g.name
        missing = sorted(set(range(max(owner) + 1)) - set(owner))
        if missing:
            raise UsageError(f"HybridSpec: layers {missing[:8]} are in no group; groups must cover layers "
                             f"0..{max(owner)}")
        shards = {g.spec.shard_of is not None for g in self.groups}
        if len(shards) > 1:
            raise UsageError("HybridSpec: either every group's spec is a shard or none is (use HybridSpec.shard)")

    # -- constructors -----------------------------------------------------------------------
    @classmethod
    def of(cls, spec: KVSpec) -> "HybridSpec":
        """A plain spec as one full-attention group named ``kv`` over all its layers."""
        return cls((KVGroup("kv", tuple(range(spec.layer_num)), spec),))

    @classmethod
    def from_layers(cls, attentions: Sequence[Attention], specs: Sequence[KVSpec | tuple[Component, ...]],
                    dtype: torch.dtype = torch.bfloat16, names: dict[Attention, str] | None = None) -> "HybridSpec":
        """Groups from per-layer descriptions: layer ``i`` attends with
        ``attentions[i]`` and has components ``specs[i]`` (a one-layer ``KVSpec``, or
        a tuple of components). Layers with equal attention and components form one
        group, named by ``names`` or ``full``, ``swa``, ``swa2``... in first-layer order."""
        if len(attentions) != len(specs) or not attentions:
            raise UsageError(f"{len(attentions)} attention kinds for {len(specs)} layer geometries")
        keys = []
        for a, s in zip(attentions, specs):
            comps = s.components if isinstance(s, KVSpec) else tuple(s)
            keys.append((a, comps, s.dtype if isinstance(s, KVSpec) else dtype))
        order: dict = {}
        for i, key in enumerate(keys):
            order.setdefault(key, []).append(i)
        used: dict[str, int] = {}
        groups = []
        for (a, comps, dt), layers in order.items():
            name = (names or {}).get(a)
            if name is None:
                base = "full" if a.is_full else "swa"
                used[base] = used.get(base, 0) + 1
                name = base if used[base] == 1 else f"{base}{used[base]}"
            groups.append(KVGroup(name, tuple(layers), KVSpec(len(layers), comps, dt), a))
        return cls(tuple(groups))

    # -- derived ------------------------------------------------------------------------------
    @property
    def layer_num(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    @property
    def is_uniform(self) -> bool:
        """One full-attention group: a plain ``KVSpec`` (:attr:`uniform_spec`)."""
        return len(self.groups) == 1 and self.groups[0].attention.is_full

    @property
    def uniform_spec(self) -> KVSpec:
        if not self.is_uniform:
            raise UsageError(f"this spec has groups {[g.fingerprint() for g in self.groups]}, not one full group")
        return self.groups[0].spec

    def group(self, name: str) -> KVGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise UsageError(f"unknown group {name!r}; this spec has {list(self.names)}")

    def group_of(self, layer: int) -> tuple[KVGroup, int]:
        """The group holding model layer ``layer`` and the layer's index inside it (one
        lookup: per-layer loads ask it for every layer)."""
        where = self._layer_table.get(layer) if is_int(layer) else None
        if where is None:
            raise UsageError(f"layer {layer!r} is out of range [0, {self.layer_num})")
        return where

    @cached_property
    def _layer_table(self) -> dict[int, tuple[KVGroup, int]]:
        return {layer: (g, i) for g in self.groups for i, layer in enumerate(g.layers)}

    def bytes_per_token(self) -> dict[str, int]:
        """Bytes of one token, per group."""
        return {g.name: g.bytes_per_token for g in self.groups}

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes of one token over the full-attention groups (kept for every token)."""
        return sum(g.bytes_per_token for g in self.groups if g.attention.is_full)

    @property
    def window_bytes(self) -> int:
        """Bytes the sliding groups need per point a request can resume from: each
        group's window of tokens."""
        return sum(g.attention.window * g.bytes_per_token for g in self.groups if not g.attention.is_full)

    @property
    def uniform_bytes_per_token(self) -> int:
        """Bytes of one token if every group kept every token (a cache blind to windows)."""
        return sum(g.bytes_per_token for g in self.groups)

    def bytes_for(self, tokens: int, resume_points: int = 1) -> int:
        """Bytes a hybrid-aware cache needs for ``tokens`` tokens of one sequence with
        ``resume_points`` points it can resume from (each sliding group keeps at most
        its window before each point, and never more than ``tokens``)."""
        out = self.full_bytes_per_token * tokens
        for g in self.groups:
            if not g.attention.is_full:
                out += min(tokens, g.attention.window * resume_points) * g.bytes_per_token
        return out

    def reusable_pages(self, page_size: int, present: Mapping[str, Sequence[bool]]) -> int:
        """The longest prefix, in whole pages, a request can resume after: the largest
        ``p`` such that every full group has pages ``[0, p)`` and every sliding group
        the pages of its window before ``p * page_size`` (the reuse rule). ``present[name][i]``
        says whether group ``name`` holds page ``i`` in some tier; every group is named,
        and a group's missing page is never made up for by another's."""
        if set(present) != set(self.names):
            raise UsageError(f"present must name exactly the groups {list(self.names)}, got {sorted(present)}")
        best = min(len(v) for v in present.values())
        for g in self.groups:
            if g.attention.is_full:
                held = present[g.name]
                best = min(best, next((i for i in range(best) if not held[i]), best))
        sliding = [(g.attention, _runs(present[g.name], best)) for g in self.groups if not g.attention.is_full]
        for p in range(best, 0, -1):
            # NOTE: every window before p ends with page p - 1: where a group lacks it, p is out
            # at once (most p of a long prefix), without working out the window
            if all(run[p - 1] for _, run in sliding) and \
                    all(run[p - 1] >= p - a.needed_pages(p * page_size, page_size).start for a, run in sliding):
                return p
        return 0

    def fingerprint(self) -> str:
        """Short, stable text naming every group (name, attention, layers, geometry);
        a one-group full spec gives its ``KVSpec``'s fingerprint, so keys of uniform
        models stay as they were. Shards give the full model's."""
        if self.is_uniform:
            return self.groups[0].spec.fingerprint()
        return "+".join(g.fingerprint() for g in self.groups)

    # -- tensor parallelism -----------------------------------------------------------------------
    def shard(self, rank: int, size: int) -> "HybridSpec":
        """Every group's ``KVSpec.shard(rank, size)``: each rank holds its heads of every
        group (a group's multi-head components must divide by ``size``)."""
        return HybridSpec(tuple(KVGroup(g.name, g.layers, g.spec.shard(rank, size), g.attention)
                                for g in self.groups))

    @property
    def full(self) -> "HybridSpec":
        if self.groups[0].spec.shard_of is None:
            return self
        return HybridSpec(tuple(KVGroup(g.name, g.layers, g.spec.full, g.attention) for g in self.groups))


def _runs(held: Sequence[bool], n: int) -> list[int]:
    """``out[i]``: how many pages up to and including page ``i`` are held in a row."""
    out, run = [], 0
    for i in range(n):
        run = run + 1 if held[i] else 0
        out.append(run)
    return out


def layer_ranges(ids: Iterable[int]) -> str:
    """``0,5,11-13``: ascending ids as comma-separated runs."""
    out, ids = [], list(ids)
    start = prev = ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


# -- the real models' geometries (bf16 KV) ---------------------------------------------------------------
def mimo_v2_flash(dtype: torch.dtype = torch.bfloat16) -> HybridSpec:
    """MiMo-V2-Flash: 48 layers; full attention at 0, 5, 11, ..., 47 (9 layers, 4 KV
    heads); a sliding window of 128 past tokens on the other 39 (8 KV heads); K 192 /
    V 128 everywhere (learned sinks on the sliding layers are weights, not KV)."""
    full = (0, 5, 11, 17, 23, 29, 35, 41, 47)
    swa = tuple(i for i in range(48) if i not in full)
    return HybridSpec((KVGroup("full", full, KVSpec.mha(9, 4, 192, 128, dtype)),
                       KVGroup("swa", swa, KVSpec.mha(39, 8, 192, 128, dtype), Attention.sliding(128))))


def gpt_oss(layers: int, dtype: torch.dtype = torch.bfloat16) -> HybridSpec:
    """gpt-oss (120b: 36 layers, 20b: 24): sliding window 128 on even layers, full
    attention on odd ones, 8 KV heads of 64."""
    return HybridSpec((KVGroup("full", tuple(range(1, layers, 2)), KVSpec.mha(layers // 2, 8, 64, dtype=dtype)),
                       KVGroup("swa", tuple(range(0, layers, 2)), KVSpec.mha(layers - layers // 2, 8, 64, dtype=dtype),
                               Attention.sliding(128))))


def gemma3_27b(dtype: torch.dtype = torch.bfloat16) -> HybridSpec:
    """Gemma 3 27B: 62 layers, 5 sliding (window 1024) : 1 full, 16 KV heads of 128."""
    full = tuple(i for i in range(62) if i % 6 == 5)
    swa = tuple(i for i in range(62) if i % 6 != 5)
    return HybridSpec((KVGroup("full", full, KVSpec.mha(len(full), 16, 128, dtype=dtype)),
                       KVGroup("swa", swa, KVSpec.mha(len(swa), 16, 128, dtype=dtype), Attention.sliding(1024))))


#: The hybrid presets by name (``kvtier simulate --spec``, ``kvtier inspect``), each
#: taking the KV dtype (default bf16).
PRESETS = {"mimo-v2-flash": mimo_v2_flash, "gpt-oss-120b": partial(gpt_oss, 36), "gpt-oss-20b": partial(gpt_oss, 24),
           "gemma3-27b": gemma3_27b}


__all__ = ["ATTENTION_KINDS", "Attention", "FULL", "HybridSpec", "KVGroup", "PRESETS", "gemma3_27b", "gpt_oss",
           "mimo_v2_flash"]
