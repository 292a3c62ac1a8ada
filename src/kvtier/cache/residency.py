"""A node's copy in each tier, as one object per tier.

A :class:`~kvtier.cache.radix.Node` holds ``device``, ``host`` and ``storage``: each
``None`` (no copy, nothing in flight) or the tier's copy with the transfer filling
it, if any. Every copy knows how to cut itself in two, so a split of a node is one
``split`` per tier, not a copy of each field.

The marks (:class:`~kvtier.cache.inflight.InFlight`) live on the copy they fill:
``DeviceCopy.loading`` (host -> device), ``HostCopy.backup`` (device -> host),
``StorageCopy.writing`` (host -> storage). A split shares the mark with both pieces
(the transfer settles every piece of the run it started with).
"""

from __future__ import annotations

import numpy as np
import torch

from .sides import highest


def held_count(side: dict | None) -> int:
    """How many sliding pages (entries not ``-1``) the per-group arrays ``side`` hold."""
    return 0 if side is None else sum(int(np.count_nonzero(a >= 0)) for a in side.values())


def _split_side(copy, pages: int) -> tuple[dict | None, int]:
    """Cut ``copy``'s side arrays after ``pages`` pages: ``copy`` keeps the rest and
    its count; returns the first pages' arrays and their count."""
    side = copy.side
    if side is None:
        return None, 0
    if len(side) == 1:  # one sliding group (every preset): no comprehension frames
        for g, a in side.items():
            top, copy.side = {g: a[:pages]}, {g: a[pages:]}
    else:
        top = {g: a[:pages] for g, a in side.items()}
        copy.side = {g: a[pages:] for g, a in side.items()}
    held = 0
    if copy.held:
        for a in top.values():
            if highest(a) >= 0:  # NOTE: windows end nodes, so the first pages mostly hold none
                held += int(np.count_nonzero(a >= 0))
        copy.held -= held
    return top, held


class DeviceCopy:
    """Device page numbers ``pages``, the run ``base[at:at + len(pages)]``: the pieces
    of a split stay views of one array, so a path's pages gather a run at a time.
    ``side`` (hybrid models): per sliding group, a page number per page or ``-1``
    (``kvtier.cache.sides``); ``held``: how many of those are not ``-1``, kept by
    every change to them (most copies hold none, and then need no look at the arrays)."""

    __slots__ = ("pages", "base", "at", "loading", "side", "held")

    def __init__(self, pages: np.ndarray, base: np.ndarray | None = None, at: int = 0,
                 side: dict | None = None, held: int = 0) -> None:
        self.pages = pages
        self.base = pages if base is None else base
        self.at = at
        self.loading = None  # the load filling these pages, if any
        self.side, self.held = side, held

    def split(self, pages: int) -> "DeviceCopy":
        """Keep the pages after the first ``pages``; return a copy holding those."""
        top = DeviceCopy(self.pages[:pages], self.base, self.at, *_split_side(self, pages))
        top.loading = self.loading
        self.pages = self.pages[pages:]
        self.at += pages
        return top


class HostCopy:
    """Host token slots ``slots``; ``backup`` is the device -> host copy filling them.
    ``side`` (hybrid models): per sliding group, a host page number per page or ``-1``;
    ``held``: how many are not ``-1`` (as :class:`DeviceCopy`'s)."""

    __slots__ = ("slots", "backup", "side", "held")

    def __init__(self, slots: torch.Tensor, side: dict | None = None, held: int = 0) -> None:
        self.slots = slots
        self.backup = None
        self.side, self.held = side, held

    @property
    def ready(self) -> bool:
        """Filled: no backup still writing it."""
        return self.backup is None

    def split(self, tokens: int, page_size: int = 1) -> "HostCopy":
        top = HostCopy(self.slots[:tokens], *_split_side(self, tokens // page_size))
        top.backup = self.backup
        self.slots = self.slots[tokens:]
        return top


class StorageCopy:
    """``stored``: written to L3; ``writing``: a write queued or running."""

    __slots__ = ("stored", "writing")

    def __init__(self, stored: bool = False) -> None:
        self.stored = stored
        self.writing = None

    def split(self, tokens: int) -> "StorageCopy":
        top = StorageCopy(self.stored)
        top.writing = self.writing
        return top


#: The tier attribute of a node and the attribute of its copy that carries a mark of
#: each transfer kind.
MARKS = {"load": ("device", "loading"), "backup": ("host", "backup"), "store": ("storage", "writing")}


def mark_of(node, kind: str):
    """The ``kind`` mark on ``node``'s copy, or ``None``."""
    tier, attr = MARKS[kind]
    copy = getattr(node, tier)
    return None if copy is None else getattr(copy, attr)


def set_mark(node, kind: str, mark) -> None:
    """Put ``mark`` on ``node``'s copy (``None`` takes it off). A storage copy with
    neither an object nor a write is no copy: taking its write off removes it."""
    tier, attr = MARKS[kind]
    copy = getattr(node, tier)
    setattr(copy, attr, mark)
    if mark is None and kind == "store" and not copy.stored:
        node.storage = None
