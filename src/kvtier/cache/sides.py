"""The sliding-window groups of a hybrid cache: their pages beside each node's full pages.

A hybrid model's full-attention groups share the node's page numbers (page ``p`` of a
node is page ``p`` of every full group's pool). Its sliding groups keep only the
pages that some window needs, so beside the full pages each device and host copy
holds, per sliding group, one page number per page of the node, ``-1`` where that
group holds nothing (a "hole"). Those side arrays are split with the copy.

Which pages a sliding group keeps is decided where KV enters the tree (insert,
commit, prefetch): only pages in the window before some *resume point* (the end of
every committed sequence, every ``retention_interval`` tokens, and every branch
point) are taken; the caller's other pages are freed at once, and so never reach
the host or storage. A prefix of ``p`` pages is resumable only when every full
group holds ``[0, p)`` and every sliding group the pages of its window before ``p``
(the reuse rule of docs/hybrid.md): :func:`resumable` answers that for many ``p`` at once.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from ..errors import UsageError
from ..hybrid import HybridSpec
from ..pools.indices import page_numbers, slot_tensor

HOLE = -1


def runs(indices: list[int]) -> dict[int, int]:
    """``out[i]``: for each ``i`` of ``indices``, how many consecutive indices (all in
    ``indices``) end at ``i``; repeats count once."""
    out: dict[int, int] = {}
    for i in sorted(set(indices)):
        out[i] = out.get(i - 1, 0) + 1
    return out


def resumable(windows: dict[str, int], held: dict[str, dict[int, int]], limit: int, page_size: int) -> int:
    """The largest ``p <= limit`` (pages) such that each sliding group ``g`` (window
    ``windows[g]`` tokens) holds every page of its window before ``p * page_size``
    (``held[g]``: :func:`runs` of the pages it holds); the full groups are taken to
    hold ``[0, limit)``. Every window before ``p > 0`` ends with page ``p - 1``, so
    only the pages the groups hold are tried, from the last."""
    first = held[next(iter(windows))]
    for i in sorted((i for i in first if i < limit), reverse=True):
        p = i + 1
        if all(held[g].get(i, 0) >= p - max(0, p * page_size - window) // page_size
               for g, window in windows.items()):
            return p
    return 0


def lowest(pages: np.ndarray) -> int:
    """The smallest of ``pages`` (a non-empty int64 array; ``HOLE`` marks a page not held).
    NOTE: a window is a few pages: ``min`` over a list is 0.2 us where numpy's reduce
    takes 1.3, and a hybrid match asks twice per sliding group."""
    return min(pages.tolist()) if pages.size <= 64 else int(pages.min())


def highest(pages: np.ndarray) -> int:
    """The largest of ``pages`` (a non-empty int64 array), as :func:`lowest` reads it."""
    return max(pages.tolist()) if pages.size <= 64 else int(pages.max())

class Sides:
    """The sliding groups of a hybrid cache: pools, windows and the keep rule."""

    def __init__(self, spec: HybridSpec, device_pools, host_pools, page_size: int,
                 retention_interval: int | None) -> None:
        self.spec, self.page_size, self.interval = spec, page_size, retention_interval
        self.full = tuple(g.name for g in spec.groups if g.attention.is_full)
        self.names = tuple(g.name for g in spec.groups if not g.attention.is_full)
        self.windows = {g.name: g.attention.window for g in spec.groups if not g.attention.is_full}
        self.groups_device, self.groups_host = device_pools, host_pools
        self.device = {g: device_pools[g] for g in self.names}
        self.host = {g: host_pools[g] for g in self.names}
        self.owned = {g: np.zeros(self.device[g].size // page_size, dtype=bool) for g in self.names}
        self.fetching = dict.fromkeys(self.names, 0)  # host slots prefetches hold outside the tree
        self._holes = np.full(1 << 13, HOLE, dtype=np.int64)
        # what a match of nothing found, per group (read only: every miss shares them)
        self.none_held = {g: np.zeros(0, dtype=bool) for g in self.names}
        self.no_windows = {g: () for g in self.names}

    def memory_bytes(self) -> int:
        """Host bytes of the groups' device-page ownership maps and the kept ``-1`` array."""
        return sum(sys.getsizeof(a) for a in (*self.owned.values(), self._holes))

    def _kept_holes(self, n: int) -> np.ndarray:
        """A view of ``n`` ``-1`` of the kept array (grown as needed): copy before writing."""
        if self._holes.size < n:
            self._holes = np.full(max(n, 2 * self._holes.size), HOLE, dtype=np.int64)
        return self._holes[:n]

    def holes(self, n: int) -> np.ndarray:
        """A new ``(n,)`` int64 array of ``-1`` (a copy of a kept one: faster than a fill)."""
        return self._kept_holes(n).copy()

    def after_holes(self, n: int, pages: np.ndarray) -> np.ndarray:
        """A new array of ``n`` ``-1`` then ``pages`` (one copy, from the kept ``-1`` array)."""
        return np.concatenate((self._kept_holes(n), pages))

    def empty(self, pages: int) -> dict[str, np.ndarray]:
        """Per group, a new array of ``pages`` ``-1``."""
        if len(self.names) == 1:  # (every preset: no comprehension frame)
            return {self.names[0]: self.holes(pages)}
        return {g: self.holes(pages) for g in self.names}

    def window_pages(self, g: str, prefix: int) -> range:
        """Pages group ``g`` needs to resume after ``prefix`` tokens."""
        start = max(0, prefix - self.windows[g]) // self.page_size
        return range(start, -(-prefix // self.page_size)) if prefix else range(0)

    def keep_pages(self, pages: int, points) -> dict[str, range | np.ndarray]:
        """Per group, the ascending indices of the pages (of ``pages``) that lie in the
        window before some resume point of ``points`` (token offsets): the window's
        ``range`` for one point (a sequence's end alone: the common case), else an
        int64 array."""
        end, out = pages * self.page_size, {}
        for g in self.names:
            if len(points) == 1:
                for r in points:
                    out[g] = self.window_pages(g, min(r, end))
                continue
            held = set()
            for r in points:
                held.update(self.window_pages(g, min(r, end)))
            out[g] = np.array(sorted(held), dtype=np.int64)
        return out

    def retention_points(self, end: int) -> list[int]:
        """Multiples of ``retention_interval`` up to ``end`` tokens."""
        if not self.interval:
            return []
        return list(range(self.interval, end + 1, self.interval))

    # -- pages and slots -------------------------------------------------------------------------
    def slots(self, pages: np.ndarray) -> torch.Tensor:
        """Token slots of ``pages`` (no holes)."""
        return slot_tensor(pages, self.page_size)

    def pages_of(self, slots: torch.Tensor) -> np.ndarray:
        """Page numbers of whole-page slots."""
        flat = slots.cpu().numpy().astype(np.int64, copy=False)
        return flat[::self.page_size] // self.page_size

    @staticmethod
    def alloc_pages(pool, n: int) -> np.ndarray | None:
        return pool.alloc_pages(n)

    def _given_pages(self, g: str, slots: torch.Tensor, what: str) -> np.ndarray:
        """The page numbers of one group's given slots, ``-1`` for pages of all ``-1``."""
        ps, pool = self.page_size, self.device[g]
        try:  # NOTE: the common case, every page given: one check (a -1 fails it, then the holes are sorted out)
            return page_numbers(slots, page_size=ps, size=pool.size, what=f"{what}: groups[{g!r}]",
                                allowed_devices=(slots.device,), unique=True)
        except ValueError:
            pass
        flat = slots.cpu().numpy().astype(np.int64, copy=False).reshape(-1, ps)
        hole = flat[:, 0] < 0
        holes = np.count_nonzero(hole)
        if holes:  # pages all -1, the others checked as whole pages
            if not (flat[hole] == HOLE).all():
                i = int(np.flatnonzero(hole & (flat != HOLE).any(axis=1))[0])
                raise UsageError(f"{what}: groups[{g!r}] page {i} holds slots {flat[i].tolist()[:4]}..., neither a "
                                 "whole page nor all -1")
            kept = torch.from_numpy(np.ascontiguousarray(flat[~hole]).reshape(-1))
        else:
            kept = slots
        try:
            pages = page_numbers(kept, page_size=ps, size=pool.size, what=f"{what}: groups[{g!r}]",
                                 allowed_devices=(kept.device,), unique=True)
        except ValueError as e:
            raise UsageError(f"{e} (a page of -1 gives none)") from None
        if not holes:
            return pages
        out = np.full(hole.size, HOLE, dtype=np.int64)
        out[~hole] = pages
        return out

    def check_given(self, groups, tokens: int, what: str) -> dict[str, np.ndarray]:
        """The page numbers (``-1``: none given) of an engine's sliding slots: per group
        a 1-D tensor of ``tokens`` slots, each page either all ``-1`` or one whole page
        of the group's device pool, no page twice. ``ValueError`` otherwise."""
        ps = self.page_size
        if groups is None:
            groups = {}
        if not hasattr(groups, "items") or set(groups) - set(self.names):
            got = sorted(groups) if hasattr(groups, "items") else type(groups).__name__
            raise UsageError(f"{what}: groups= maps sliding groups {list(self.names)} to device slots, got {got}")
        out = {}
        for g in self.names:
            slots = groups.get(g)
            if slots is None:
                out[g] = np.full(tokens // ps, HOLE, dtype=np.int64)
                continue
            if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.numel() != tokens \
                    or slots.dtype not in (torch.int64, torch.int32):
                got = tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
                raise UsageError(f"{what}: groups[{g!r}] must be a 1-D int64 tensor of {tokens} slots "
                                 f"(-1 for pages not given), got {got}")
            out[g] = self._given_pages(g, slots, what)
        return out
