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


class DeviceCopy:
    """Device page numbers ``pages``, the run ``base[at:at + len(pages)]``: the pieces
    of a split stay views of one array, so a path's pages gather a run at a time."""

    __slots__ = ("pages", "base", "at", "loading")

    def __init__(self, pages: np.ndarray, base: np.ndarray | None = None, at: int = 0) -> None:
        self.pages = pages
        self.base = pages if base is None else base
        self.at = at
        self.loading = None  # the load filling these pages, if any

    def split(self, pages: int) -> "DeviceCopy":
        """Keep the pages after the first ``pages``; return a copy holding those."""
        top = DeviceCopy(self.pages[:pages], self.base, self.at)
        top.loading = self.loading
        self.pages = self.pages[pages:]
        self.at += pages
        return top


class HostCopy:
    """Host token slots ``slots``; ``backup`` is the device -> host copy filling them."""

    __slots__ = ("slots", "backup")

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots
        self.backup = None

    @property
    def ready(self) -> bool:
        """Filled: no backup still writing it."""
        return self.backup is None

    def split(self, tokens: int) -> "HostCopy":
        top = HostCopy(self.slots[:tokens])
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
