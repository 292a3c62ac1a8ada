"""A page-granular radix tree over token ids whose nodes record where their KV lives.

Each node holds a run of whole pages (``key``, an ``array('q')`` of a multiple of
``page_size`` token ids) and, per tier, the slots of those pages. The tree is pure
structure: no threads, no pools. ``CacheState`` keeps these invariants:

- a node on the device has its parent on the device (device copies are
  prefix-closed), so a match hits the device first, then the host;
- a node with no copy in any tier and no transfer in flight is removed (it is then
  a leaf); nodes with children are never removed;
- ``lock_ref`` counts users of a node and all its descendants: locked nodes are
  never evicted from any tier. Locks are taken and released by walking up from
  the last node, so a split (which inserts a node above) keeps the counts right.
"""

from __future__ import annotations

import itertools
from array import array
from typing import Iterator

import numpy as np

from ..compiled import load
from ..errors import IntegrityError
from .residency import DeviceCopy, HostCopy, StorageCopy
from .tokens import COMPILED

_tick = itertools.count(1)
_serial = itertools.count(1)


def now() -> int:
    """A logical clock for LRU order: deterministic, unlike wall time."""
    return next(_tick)


class Node:
    """One run of cached pages. Per tier a copy (``kvtier.cache.residency``) or
    ``None``; see ``kvtier.cache.state`` for the rules:

    - ``device``: a :class:`DeviceCopy` (page numbers; ``loading`` while a host ->
      device copy fills them);
    - ``host``: a :class:`HostCopy` (``(len(key),)`` token slots; ``backup`` while a
      device -> host copy fills them);
    - ``storage``: a :class:`StorageCopy` (``stored`` in L3; ``writing`` while a write
      is queued or running).
    """

    __slots__ = ("key", "children", "parent", "edge", "collisions", "device", "host", "storage", "store_keys",
                 "lock_ref", "last_access", "hits", "serial", "ends", "depth")

    def __init__(self, key: array, parent: "Node | None") -> None:
        self.key = key
        # NOTE: children are keyed by the first token id of their key (an int: a cheap
        # hash and lookup per step of a walk). Two children whose first pages start with
        # the same id but differ later share no int: the later one is keyed by its whole
        # first page as bytes instead, and ``collisions`` counts such children.
        self.children: dict[int | bytes, Node] = {}
        self.collisions = 0
        self.parent = parent
        # tokens from the root to this node's end: where it sits in any prompt it matches
        # (a split keeps the lower part's, so it never changes)
        self.depth: int = (parent.depth if parent is not None else 0) + len(key)
        self.edge: int | bytes = key[0] if key else 0  # this node's key in ``parent.children``
        # NOTE: page numbers on the device, not token slots: 1/page_size of the memory,
        # and the slots are a cheap expansion when a match hands them out
        self.device: DeviceCopy | None = None
        self.host: HostCopy | None = None
        self.storage: StorageCopy | None = None
        self.store_keys: list[str] | None = None  # per page, chained storage keys (lazy)
        self.lock_ref = 0
        self.last_access = now()
        self.hits = 0
        self.serial = next(_serial)  # creation order: breaks LRU ties the same way in every replay
        self.ends = False  # a committed sequence ends here: a resume point (hybrid models keep its window)

    def __repr__(self) -> str:
        tiers = "".join(t for t, on in (("D", self.device is not None), ("H", self.host_ready),
                                        ("S", self.stored)) if on)
        return f"Node({len(self.key)} tokens, {tiers or '-'}, lock={self.lock_ref})"

    @property
    def dev_pages(self) -> np.ndarray | None:
        """The device copy's page numbers, ``(len(key) // page_size,)`` int64, or ``None``."""
        return None if self.device is None else self.device.pages

    @property
    def host_ready(self) -> bool:
        """Whether the host copy exists and is filled (not still being backed up)."""
        return self.host is not None and self.host.backup is None

    @property
    def stored(self) -> bool:
        return self.storage is not None and self.storage.stored

    @property
    def loading(self):
        """The host -> device copy filling the device copy, or ``None``."""
        return None if self.device is None else self.device.loading

    @property
    def backup(self):
        """The device -> host copy filling the host copy, or ``None``."""
        return None if self.host is None else self.host.backup

    @property
    def storing(self):
        """The storage write of the host copy, queued or running, or ``None``."""
        return None if self.storage is None else self.storage.writing

    @property
    def resident(self) -> bool:
        return self.device is not None or self.host_ready

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
        self.roots: dict[bytes, Node] = {}

    def root(self, salt: bytes) -> Node:
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = Node(array("q"), None)
            root.lock_ref = 1  # roots are never evicted
        return root

    def salt_of(self, node: Node) -> bytes:
        while node.parent is not None:
            node = node.parent
        return next(salt for salt, root in self.roots.items() if root is node)

    def walk(self, tokens: array, salt: bytes, stamp: int | None = None) -> tuple[list[Node], int, int]:
        """Match without changing the tree: ``(nodes, matched tokens, tokens matched in
        the last node)``; the last count is less than its key when the match ends inside
        it. With ``stamp``, every node matched whole gets it as its LRU time."""
        node, path, pos, inner = self.roots.get(salt), [], 0, 0
        if node is None:
            return path, pos, inner
        usable = len(tokens) - len(tokens) % self.page_size
        # NOTE: the run is the hot path of every match: one int lookup and one memcmp of a
        # whole key per node (compiled: the whole run in C, keys compared in place, which
        # made a whole match over a node per page 1.5-1.7x faster; else array slices of
        # one typecode, which compare with memcmp after a copy). The rare cases (a
        # first-id collision, a match ending inside a node) take the outer loop. The
        # switch is read here, once per walk.
        compiled = load(COMPILED)
        run = self._run if compiled is None else compiled.walk_run
        pos, inner, node = run(node, tokens, pos, inner, usable, path, stamp)
        return self._walk_on(node, tokens, pos, inner, usable, path, stamp, run)

    def walk_slots(self, tokens: array, salt: bytes, stamp: int) -> tuple[list[Node], int, int, object | None]:
        """:meth:`walk` (stamping), and ``slots``: where every node of the path is matched
        whole, on the device and keyed by its first id (not a collision's), and the walk
        ended at the usable tokens or at a node with no child keyed by the next id and
        no collisions, the path's device slots, ``page_size`` a page, as int64 in a new
        DLPack capsule (``torch.utils.dlpack.from_dlpack`` takes it as a tensor, once);
        else ``None`` (and always without the compiled walk)."""
        node, compiled = self.roots.get(salt), load(COMPILED)
        if node is None or compiled is None:
            return *self.walk(tokens, salt, stamp), None
        # NOTE: one C call walks and expands: a uniform full hit's walk and slots took 8.6
        # us through walk and CacheState.slots_of, their Python 1.6 us of it (Zen 2 VM)
        usable, path = len(tokens) - len(tokens) % self.page_size, []
        pos, inner, node, slots = compiled.walk_slots(node, tokens, usable, path, stamp, self.page_size)
        if slots is not None:
            return path, pos, inner, slots
        return *self._walk_on(node, tokens, pos, inner, usable, path, stamp, compiled.walk_run), None

    def _walk_on(self, node: Node, tokens: array, pos: int, inner: int, usable: int, path: list, stamp,
                 run) -> tuple[list[Node], int, int]:
        """The walk's outer loop, from where a ``run`` stopped at ``node``."""
        while True:
            child = self._child(node, tokens, pos) if pos < usable else None
            if child is None:
                return path, pos, inner
            inner = self._common_pages(child.key, tokens, pos, usable)
            path.append(child)
            pos += inner
            if inner < len(child.key):
                return path, pos, inner  # not stamped: its unmatched tail was not used
            if stamp is not None:
                child.last_access = stamp
            # a child keyed by its first page (a collision) matched whole
            pos, inner, node = run(child, tokens, pos, inner, usable, path, stamp)

    @staticmethod
    def _run(node: Node, tokens: array, pos: int, inner: int, usable: int, path: list, stamp) -> tuple:
        """The compiled ``walk_run`` in Python: from ``node`` at ``tokens[pos]``, children
        keyed by their first id whose whole key matches, each appended to ``path`` and
        stamped; ``(pos, inner, node)`` where it stopped."""
        append = path.append
        while pos < usable:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            key = child.key
            end = pos + len(key)
            if end > usable or tokens[pos:end] != key:
                break
            append(child)
            pos, inner, node = end, len(key), child
            if stamp is not None:
                child.last_access = stamp
        return pos, inner, node

    def _child(self, node: Node, tokens: array, pos: int) -> Node | None:
        """The child of ``node`` whose first page is ``tokens[pos:pos + page_size]``."""
        ps = self.page_size
        child = node.children.get(tokens[pos])
        if child is not None and child.key[:ps] == tokens[pos:pos + ps]:
            return child
        if node.collisions:
            return node.children.get(tokens[pos:pos + ps].tobytes())
        return None

    def match(self, tokens: array, salt: bytes, walked=None) -> tuple[list[Node], int, list[Node]]:
        """The path covering the longest page-aligned cached prefix of ``tokens``,
        splitting the node where the match ends inside it; marks the path as just
        used. Returns ``(path, matched tokens, new nodes made by the split)``.
        ``walked``: what :meth:`walk` just returned for the same arguments."""
        stamp = now()
        if walked is None:
            path, matched, inner = self.walk(tokens, salt, stamp)  # stamps the nodes matched whole
        else:
            path, matched, inner = walked
        made = []
        if path and inner < len(path[-1].key):
            path[-1] = self.split(path[-1], inner)  # the tail keeps its LRU time: it was not used
            made.append(path[-1])
        if walked is not None:
            for node in path:
                node.last_access = stamp
        elif made:
            made[0].last_access = stamp
        return path, matched, made

    def _common_pages(self, key: array, tokens: array, pos: int, usable: int) -> int:
        """Tokens of ``key`` matching ``tokens[pos:]``, in whole pages."""
        n = min(len(key), usable - pos)
        if tokens[pos:pos + n] == key[:n]:
            return n
        ours = np.frombuffer(tokens, dtype=np.int64, count=n, offset=pos * 8)
        first = int(np.argmax(ours != np.frombuffer(key, dtype=np.int64, count=n)))
        return first - first % self.page_size

    def split(self, node: Node, n: int) -> Node:
        """Cut ``node`` after ``n`` tokens (a multiple of the page size); returns the new
        upper node, which inherits the lock count, LRU stamp, hits and every transfer
        in flight (it joins that transfer's nodes, so the transfer settles both)."""
        if not 0 < n < len(node.key) or n % self.page_size:
            raise IntegrityError(f"split of a {len(node.key)}-token node after {n} tokens: not inside it in whole "
                                 f"{self.page_size}-token pages")
        top = Node(node.key[:n], node.parent)
        pages = n // self.page_size
        if node.device is not None:
            top.device = node.device.split(pages)
        if node.host is not None:
            top.host = node.host.split(n, self.page_size)
        if node.storage is not None:
            top.storage = node.storage.split(n)
        for mark in (top.loading, top.backup, top.storing):
            if mark is not None:
                mark.nodes.append(top)
        if node.store_keys is not None:
            top.store_keys = node.store_keys[:pages]
            node.store_keys = node.store_keys[pages:]
        top.lock_ref, top.last_access, top.hits = node.lock_ref, node.last_access, node.hits
        top.edge = node.edge
        node.parent.children[node.edge] = top  # same first page: ``top`` takes ``node``'s place
        node.key = node.key[n:]
        node.parent = top
        node.edge = node.key[0]
        top.children[node.edge] = node
        return top

    def add_child(self, parent: Node, key: array) -> Node:
        """A new child of ``parent`` holding ``key``, whose first page no child has."""
        child = Node(key, parent)
        if child.edge in parent.children:  # another first page starting with the same id
            child.edge = key[:self.page_size].tobytes()
            if child.edge in parent.children:
                raise IntegrityError(f"{parent}: a child with this first page exists")
            parent.collisions += 1
        parent.children[child.edge] = child
        return child

    def remove(self, node: Node) -> None:
        if node.children or node.is_root or node.lock_ref:
            raise IntegrityError(f"remove of {node}: only an unlocked leaf leaves the tree")
        del node.parent.children[node.edge]
        if isinstance(node.edge, bytes):
            node.parent.collisions -= 1

    def attached(self, node: Node) -> bool:
        """Whether ``node`` is still in the tree (not removed by an eviction)."""
        while node.parent is not None:
            if node.parent.children.get(node.edge) is not node:
                return False
            node = node.parent
        return node in self.roots.values()

    def nodes(self) -> Iterator[Node]:
        """Every node below the roots."""
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def lock(node: Node) -> None:
        """Add one user to ``node`` and every ancestor."""
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    @staticmethod
    def unlock(node: Node) -> list[Node]:
        """Remove one user from ``node`` and every ancestor, checked before any count
        moves; returns the nodes that became unlocked."""
        walk = node
        while walk is not None:
            if walk.lock_ref < 1:
                raise IntegrityError(f"unlock without a matching lock on {walk}")
            walk = walk.parent
        freed = []
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                freed.append(node)
            node = node.parent
        return freed
