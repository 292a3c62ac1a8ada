"""A page-granular radix tree over token ids whose nodes record where their KV lives.

Each node holds a run of whole pages (``key``, a multiple of ``page_size`` token ids)
and, per tier, the slots of those pages: ``device`` (engine pool), ``host`` (host
pool), ``stored`` (written to L3 storage). Invariants kept by ``HierarchicalCache``:

- a node on the device has its parent on the device (device copies are
  prefix-closed), so a match hits the device first, then the host;
- a node with no copy in any tier is removed (it is then a leaf);
- ``lock_ref`` counts users of a node and all its ancestors: locked nodes are never
  evicted. Locks are taken and released by walking up from the last node, so a
  split (which inserts a node above) keeps the counts right.
"""

from __future__ import annotations

import itertools
from typing import Iterator

import torch

_tick = itertools.count(1)


def now() -> int:
    """A logical clock for LRU order: deterministic, unlike wall time."""
    return next(_tick)


class Node:
    __slots__ = ("key", "children", "parent", "device", "host", "stored", "store_keys", "lock_ref",
                 "last_access", "hits", "loading")

    def __init__(self, key: list[int], parent: "Node | None") -> None:
        self.key = key
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.device: torch.Tensor | None = None  # (len(key),) device slots
        self.host: torch.Tensor | None = None    # (len(key),) host slots
        self.stored = False                       # every page written to L3
        self.store_keys: list[str] | None = None  # per page, chained storage keys (lazy)
        self.lock_ref = 0
        self.last_access = now()
        self.hits = 0
        self.loading = None  # the LoadHandle filling this node's device slots, until it is done

    def __repr__(self) -> str:
        tiers = "".join(t for t, on in (("D", self.device is not None), ("H", self.host is not None),
                                        ("S", self.stored)) if on)
        return f"Node({len(self.key)} tokens, {tiers or '-'}, lock={self.lock_ref})"

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def path(self) -> list["Node"]:
        """Nodes from the first below the root down to this one."""
        out, node = [], self
        while not node.is_root:
            out.append(node)
            node = node.parent
        return out[::-1]


class RadixTree:
    """The tree (one root per tenant salt) and its structural operations."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.roots: dict[object, Node] = {}

    def root(self, salt) -> Node:
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = Node([], None)
            root.lock_ref = 1  # roots are never evicted
        return root

    def _first_page(self, tokens: list[int], start: int = 0) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.page_size])

    def match(self, tokens: list[int], salt) -> tuple[list[Node], int]:
        """The path of nodes covering the longest page-aligned cached prefix of
        ``tokens``, splitting a node where the match ends inside it. Returns
        ``(path, matched tokens)`` and marks the path as just used."""
        ps, node, pos, path = self.page_size, self.root(salt), 0, []
        usable = len(tokens) - len(tokens) % ps
        stamp = now()
        while pos < usable:
            child = node.children.get(self._first_page(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos, usable)
            if n < len(child.key):
                child = self.split(child, n)
            child.last_access = stamp
            path.append(child)
            pos += n
            node = child
        return path, pos

    def _common_pages(self, key: list[int], tokens: list[int], pos: int, usable: int) -> int:
        """Tokens of ``key`` matching ``tokens[pos:]``, in whole pages."""
        n = min(len(key), usable - pos)
        if tokens[pos:pos + n] == key[:n]:
            return n
        ps, i = self.page_size, self.page_size  # the first page matched (child lookup)
        while i < n and tokens[pos + i:pos + i + ps] == key[i:i + ps]:
            i += ps
        return i

    def split(self, node: Node, n: int) -> Node:
        """Cut ``node`` after ``n`` tokens (a multiple of the page size); returns the new
        upper node, which inherits the lock count, LRU stamp and hits."""
        assert 0 < n < len(node.key) and n % self.page_size == 0, (n, len(node.key))
        top = Node(node.key[:n], node.parent)
        top.device = None if node.device is None else node.device[:n]
        top.host = None if node.host is None else node.host[:n]
        top.stored = node.stored
        if node.store_keys is not None:
            top.store_keys = node.store_keys[:n // self.page_size]
            node.store_keys = node.store_keys[n // self.page_size:]
        top.lock_ref, top.last_access, top.hits, top.loading = node.lock_ref, node.last_access, node.hits, node.loading
        node.parent.children[self._first_page(node.key)] = top
        node.key = node.key[n:]
        node.device = None if node.device is None else node.device[n:]
        node.host = None if node.host is None else node.host[n:]
        node.parent = top
        top.children[self._first_page(node.key)] = node
        return top

    def add_child(self, parent: Node, key: list[int]) -> Node:
        child = Node(key, parent)
        parent.children[self._first_page(key)] = child
        return child

    def remove(self, node: Node) -> None:
        assert not node.children and not node.is_root and node.lock_ref == 0, node
        del node.parent.children[self._first_page(node.key)]

    def attached(self, node: Node) -> bool:
        """Whether ``node`` is still in the tree (not removed by an eviction)."""
        while node.parent is not None:
            if node.parent.children.get(self._first_page(node.key)) is not node:
                return False
            node = node.parent
        return True

    def nodes(self) -> Iterator[Node]:
        """Every node below the roots."""
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def lock(node: Node, delta: int) -> None:
        """Add ``delta`` to the lock count of ``node`` and every ancestor."""
        while node is not None:
            node.lock_ref += delta
            assert node.lock_ref >= 0, f"unlock without lock on {node}"
            node = node.parent
