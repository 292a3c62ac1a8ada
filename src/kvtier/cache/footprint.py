"""What the cache's own structures take in host memory (``HierarchicalCache.memory_bytes``).

Each object is counted as ``sys.getsizeof`` reports it (what Python allocated for it,
not the allocator's overhead), and each array's or tensor's buffer once however many
views share it: the pieces of a split node are views of one array.
"""

from __future__ import annotations

import sys

import numpy as np
import torch


class Footprint:
    """A running total of host bytes that counts every shared buffer once."""

    def __init__(self) -> None:
        self.total = 0
        self._buffers: dict[int, object] = {}  # id or data pointer -> owner (kept alive while counting)

    def add(self, *objects) -> None:
        """Each object's own size (a container's, not its items')."""
        self.total += sum(map(sys.getsizeof, objects))

    def array(self, a: np.ndarray) -> None:
        """A numpy array: its header, and the buffer it views once."""
        owner = a
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        # NOTE: getsizeof of an array that owns its data includes the data: the header is the rest
        self.total += sys.getsizeof(a) - (a.nbytes if a.base is None else 0)
        if id(owner) not in self._buffers:
            self._buffers[id(owner)] = owner
            self.total += owner.nbytes

    def tensor(self, t: torch.Tensor) -> None:
        """A tensor: its header, and its storage once."""
        self.total += sys.getsizeof(t)
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._buffers:
            self._buffers[storage.data_ptr()] = storage
            self.total += storage.nbytes()

    def side(self, side: dict | None) -> None:
        """A copy's per sliding group page arrays (hybrid caches), if any."""
        if side is not None:
            self.add(side)
            for pages in side.values():
                self.array(pages)

    def node(self, node) -> None:
        """A tree node: itself, its child map, key, edge and storage keys, and its copy
        in each tier with the page numbers or slots it holds."""
        self.add(node, node.children, node.key)
        if isinstance(node.edge, bytes):  # a colliding child's key: its first page as bytes
            self.add(node.edge)
        if node.device is not None:
            self.add(node.device)
            self.array(node.device.pages)
            self.side(node.device.side)
        if node.host is not None:
            self.add(node.host)
            self.tensor(node.host.slots)
            self.side(node.host.side)
        if node.storage is not None:
            self.add(node.storage)
        if node.store_keys is not None:
            self.add(node.store_keys, *node.store_keys)
