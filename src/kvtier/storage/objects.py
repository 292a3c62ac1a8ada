"""How the pages of one host pool map to stored objects ("parts"), and the bytes of each.

A page is stored as parts cut from its canonical flat form, so that pools holding
different head ranges (tensor-parallel shards of any size) share them:

- ``h{j}of{G}``: head group ``j`` of ``G`` of every multi-head component, each as
  ``(head, slot, layer, dim)`` over the group's heads, concatenated in spec order;
- ``rep``: the single-head components (MLA latents, replicated on every rank), same order.

NOTE: head-major is the order of a ``page_head`` pool, the layout for sharing across
tensor-parallel sizes: there each component of a part is one ``memcpy``. Every other
layout interleaves heads with slots or layers, so any part order costs it a strided
gather of ``dim``-sized pieces. The file store also writes pages as one part per
multi-head component over a run of head groups (:meth:`PagePlan.component_parts`),
in **slot order** ``(slot, layer, head, dim)``, a ``page_first`` pool's page, or
**layer order** ``(layer, slot, head, dim)``, a ``page_first_direct`` pool's: those
pools (``page_first`` is the default) then move their pages in place too; a reader
of fewer heads reads such a part whole and keeps its own. From a ``page_head`` pool
it writes a part per component and head group (:meth:`PagePlan.split_parts`), each
component's groups in turn, so that a whole page is one piece of the pool per
component and a reader of fewer heads still reads only its groups.

``G`` defaults to the greatest common divisor of the multi-head components' head
counts, the finest cut every shard size divides. A part's field name is
``<spec fingerprint>/p<page size>/<part>``: everything that sets an object's size
(dims, dtype, layers, page size, head groups) is part of its identity, so a reader
of another geometry looks up other names and misses; it never meets an object of a
size it did not expect and mistakes it for a corrupt one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .._checks import positive_int
from ..errors import IntegrityError, UsageError
from ..spec import KVSpec


#: A part's axes after the page, as a transpose of ``(page, slot, layer, head, dim)``
PART_AXES = {"head": (0, 3, 1, 2, 4),   # (head, slot, layer, dim): page_head's
             "slot": None,              # (slot, layer, head, dim): page_first's
             "layer": (0, 2, 1, 3, 4)}  # (layer, slot, head, dim): page_first_direct's, the flat page's


@dataclass(frozen=True)
class Part:
    field: str                                 # "<fingerprint>/p<page size>/<part name>"
    pieces: tuple[tuple[str, int, int], ...]   # (component, local head start, stop)
    nbytes: int
    order: str = "head"                        # the piece's axes: a key of PART_AXES


class PagePlan:
    """The parts a pool of ``spec`` writes and reads, and copies between pages and bytes."""

    def __init__(self, spec: KVSpec, page_size: int, head_groups: int | None = None) -> None:
        full = spec.full
        multi = [c for c in full.components if c.head_num > 1]
        groups = head_groups or (math.gcd(*(c.head_num for c in multi)) if multi else 1)
        positive_int("head_groups", groups)  # NOTE: a computed gcd is positive: only a given head_groups fails
        for c in multi:
            if c.head_num % groups:
                raise UsageError(f"head_groups {groups} does not divide component {c.name!r}'s {c.head_num} heads")
        rank, size = (spec.shard_of.rank, spec.shard_of.size) if spec.shard_of else (0, 1)
        if multi and groups % size:
            raise UsageError(f"head_groups {groups} is not divisible by the shard size {size}")
        self.spec, self.page_size, self.groups = spec, page_size, groups
        positive_int("page_size", page_size)
        fp, es = f"{full.fingerprint()}/p{page_size}", spec.element_size
        token_bytes = page_size * spec.layer_num * es
        self.read_parts: list[Part] = []
        if multi:
            per_rank = groups // size
            for j in range(rank * per_rank, (rank + 1) * per_rank):
                local = j - rank * per_rank
                pieces = tuple((c.name, local * c.head_num // groups, (local + 1) * c.head_num // groups)
                               for c in multi)
                nbytes = sum(c.head_num // groups * c.head_dim for c in multi) * token_bytes
                self.read_parts.append(Part(f"{fp}/h{j}of{groups}", pieces, nbytes))
        single = [c for c in full.components if c.head_num == 1]
        if single:
            self.read_parts.append(Part(f"{fp}/rep", tuple((c.name, 0, 1) for c in single),
                                        sum(c.head_dim for c in single) * token_bytes))
        # NOTE: replicated parts are written by rank 0 only; every rank reads them.
        self.write_parts = [p for p in self.read_parts if rank == 0 or not p.field.endswith("/rep")]
        self.prefix = fp  # "<fingerprint>/p<page size>": the geometry part of every field
        #: The head groups this plan's pool holds (global numbers)
        self.held_groups = range(rank * groups // size, (rank + 1) * groups // size) if multi else range(0)
        self.multi, self._token_bytes = tuple(multi), token_bytes  # multi: the full spec's multi-head components

    def component_parts(self, a: int, b: int, order: str) -> list[Part | None]:
        """The parts of a file of head groups ``[a, b)`` cut per component: per multi-head
        component, its page over those groups' heads in ``order`` (``"slot"`` or
        ``"layer"``, see ``PART_AXES``), named ``<order's initial>.<component>.g<a>-<b>``;
        None for each where this plan's pool does not hold all of those heads (a
        reader of fewer heads than the file: see the module's NOTE)."""
        held, out = self.held_groups, []
        inside = held and held.start <= a < b <= held.stop
        for c, nbytes in zip(self.multi, self.component_bytes(a, b)):
            per_group = c.head_num // self.groups  # the full component's heads
            local = ((c.name, (a - held.start) * per_group, (b - held.start) * per_group),)
            out.append(Part(f"{self.prefix}/{order[0]}.{c.name}.g{a}-{b}", local, nbytes, order) if inside else None)
        return out

    def split_parts(self, groups) -> list[Part]:
        """Per multi-head component, per head group ``j`` of ``groups`` (all held here):
        that component's heads of the group in head order ``(head, slot, layer, dim)``,
        named :func:`split_name`. A ``page_head`` pool holds each contiguously, and a
        component's run of groups contiguously too: a file of these parts, components
        one after another, reads into such a pool as one piece per component."""
        held, out = self.held_groups, []
        for c in self.multi:
            per_group = c.head_num // self.groups
            nbytes = per_group * c.head_dim * self._token_bytes
            for j in groups:
                if j not in held:
                    raise UsageError(f"head group {j} is not held here (groups {held.start}..{held.stop - 1})")
                local = ((c.name, (j - held.start) * per_group, (j - held.start + 1) * per_group),)
                out.append(Part(f"{self.prefix}/{split_name(c.name, j, self.groups)}", local, nbytes))
        return out

    def component_bytes(self, a: int, b: int) -> list[int]:
        """The bytes of each of :meth:`component_parts`' parts (held here or not)."""
        return [(b - a) * (c.head_num // self.groups) * c.head_dim * self._token_bytes for c in self.multi]

    def part_views(self, pool, part: Part) -> tuple[tuple[np.ndarray, int, int], ...]:
        """Per piece of ``part``: ``(view, offset, nbytes)``, ``view`` numpy
        with its part's axes after the page (``PART_AXES``) over all of ``pool``'s pages, ``offset`` and
        ``nbytes`` where the piece sits in the part's bytes. Build them once per call:
        making views costs more than copying a small part."""
        out, offset = [], 0
        for name, h0, h1 in part.pieces:
            view = pool.page_views[name].np_all_layers[:, :, :, h0:h1]  # (page, slot, layer, head, dim)
            if PART_AXES[part.order] is not None:
                view = view.transpose(PART_AXES[part.order])
            # NOTE: every layout but page_head scatters a part in runs of one head's `dim`;
            # numpy's strided copy costs per element, so each run moves as the widest ints
            # that tile it (8 bytes for any even head_dim of a 2-byte dtype: about 2x faster).
            if view.strides[-1] == view.itemsize:
                view = view.view(f"<i{math.gcd(8, view.shape[-1] * view.itemsize)}")
            nbytes = view[0].size * view.itemsize
            out.append((view, offset, nbytes))
            offset += nbytes
        if offset != part.nbytes:
            raise IntegrityError(f"part {part.field}: pieces of {offset} bytes, expected {part.nbytes}")
        return tuple(out)

    def pack(self, pool, page: int, part: Part, buf: np.ndarray) -> None:
        """Write page ``page``'s bytes of ``part`` into ``buf`` (``part.nbytes`` uint8)."""
        pack_part(self.part_views(pool, part), page, buf)

    def unpack(self, pool, page: int, part: Part, buf) -> None:
        """Write ``part``'s bytes from ``buf`` (any buffer, may be read-only) into page ``page``."""
        unpack_part(self.part_views(pool, part), page, buf)


def split_name(component: str, group: int, groups: int) -> str:
    """The name of component ``component``'s part of head group ``group`` of ``groups``
    in a file of split order (see :meth:`PagePlan.split_parts`)."""
    return f"h{group}of{groups}.{component}"


def pack_part(views, page: int, buf: np.ndarray) -> None:
    """``PagePlan.pack`` with the part's ``PagePlan.part_views``."""
    for view, offset, nbytes in views:
        src = view[page]
        np.copyto(buf[offset:offset + nbytes].view(src.dtype).reshape(src.shape), src)


def unpack_part(views, page: int, buf) -> None:
    """``PagePlan.unpack`` with the part's ``PagePlan.part_views``."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    for view, offset, nbytes in views:
        dest = view[page]
        np.copyto(dest, arr[offset:offset + nbytes].view(dest.dtype).reshape(dest.shape))


@functools.lru_cache(maxsize=64)
def page_plan(spec: KVSpec, page_size: int, head_groups: int | None = None) -> PagePlan:
    """The (immutable, shared) plan of one pool geometry."""
    return PagePlan(spec, page_size, head_groups)
