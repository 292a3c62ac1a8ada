"""The cache's state with no threads: the tree, who owns which slot, LRU order, and
every transition of a run of pages between tiers.

Every method of :class:`CacheState` runs with ``state.lock`` held (the cache and the
mover take it); none blocks on I/O. Per node and tier (see ``radix.Node``):

    device   resident (``device``), or being filled from the host (``loading``)
    host     resident (``host`` and no ``backup``), or being filled (``backup``)
    storage  ``stored``, or a write queued / running (``storing``)

What each state pins against eviction:

- a request lock (``lock_ref``): the node and its ancestors, in every tier;
- ``loading``: the device slots being filled and the host copy they come from;
  the load also locks the path above it (device copies are prefix-closed);
- ``backup``: the device copy being read, until its copy lands;
- ``storing``: the host copy, and only while the write runs (a queued write is
  dropped if its host copy is evicted first); never the device copy or ancestors.

A prefetch holds host slots outside the tree while it fills them: ``fetching``
counts them, so that :meth:`CacheState.check_integrity` tells them from a leak.
"""

from __future__ import annotations

import itertools
import sys
import threading
from array import array
from typing import Callable

import numpy as np
import torch

from ..errors import IntegrityError, UsageError
from ..compiled import load
from ..pools.indices import COMPILED, first_flagged, from_capsule, slot_tensor
from ..storage.keys import extend_keys
from .footprint import Footprint
from .handles import LoadHandle
from .hybrid_state import HybridState, Probe
from .inflight import InFlight
from .lru import LruIndex
from .radix import Node, RadixTree, now
from .residency import DeviceCopy, HostCopy, StorageCopy, set_mark
from .sides import Sides
from .stats import CacheStats


_NO_PAGES = np.empty(0, dtype=np.int64)


def _device_count(path) -> int:
    """How many nodes of ``path`` have a device copy: device copies are prefix-closed,
    so they are ``path[:k]``, found by bisection (a fragmented path crosses hundreds)."""
    if path and path[-1].device is not None:  # a whole device hit, the common case
        return len(path)
    lo, hi = 0, len(path)
    while lo < hi:
        mid = (lo + hi) // 2
        if path[mid].device is None:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _joined(pages: np.ndarray | list | tuple) -> np.ndarray:
    """Page numbers, or a list or tuple of runs of them, as one array."""
    if isinstance(pages, (list, tuple)):
        return np.concatenate(pages) if pages else _NO_PAGES
    return pages


def _tier_lens(path, matched: int, inner: int) -> tuple[int, int]:
    """``(device_len, host_len)`` of a walked ``path`` (``matched`` tokens, ``inner`` of
    them in its last node); cuts ``path`` before its first node with no ready copy."""
    k = _device_count(path)
    if k == len(path):
        return matched, 0
    device_len = matched - inner - sum(len(node.key) for node in path[k:-1])  # not a scan of the device part
    host_len, last = 0, len(path) - 1
    for i in range(k, len(path)):
        if not path[i].host_ready:  # neither copy is ready: the match ends
            del path[i:]
            break
        host_len += inner if i == last else len(path[i].key)
    return device_len, host_len


class CacheState(HybridState):
    """``sides``: the sliding groups of a hybrid spec (``device_pool`` and ``host_pool``
    are then its first full group's pools, whose slots every full group shares)."""

    def __init__(self, device_pool, host_pool, allocator, *, write_policy: str, stats: CacheStats,
                 namespace: str | None, hash: str, has_storage: bool, sides: Sides | None = None) -> None:
        self.device_pool, self.host_pool, self.allocator = device_pool, host_pool, allocator
        self.page_size = host_pool.page_size
        self.write_policy, self.stats = write_policy, stats
        self.namespace, self.hash, self.has_storage = namespace, hash, has_storage
        self.lock = threading.RLock()
        self.tree = RadixTree(self.page_size)
        self.sides = sides
        self._miss = None if sides is None else Probe(0, sides.none_held, windows=sides.no_windows)  # shared
        self.lru = LruIndex(sides.names if sides is not None else ())
        self._nodes = 0
        self._removed = 0  # hybrid: nodes removed since the LRU index was last compacted
        self._owned = np.zeros(device_pool.size // self.page_size, dtype=bool)  # device pages held by nodes
        # 0 .. page_size - 1 on an accelerator that holds the slot tensors (``slots_of``
        # expands pages there); None when they live on the CPU (numpy expands them)
        index_device = device_pool.index_device
        self._offsets = None if index_device.type == "cpu" else torch.arange(self.page_size, device=index_device)
        # NOTE: a miss's slots are a new empty tensor made from this one (new_empty: 1.4 us;
        # the expansion of no pages took 4, a third of a miss's whole match)
        self._no_slots = torch.empty(0, dtype=torch.int64, device=index_device)
        self.backups: set[InFlight] = set()  # device -> host copies in flight
        self.fetching = 0  # host slots prefetches hold outside the tree (fetched, not yet adopted)
        self.schedule: Callable[[InFlight], None] = lambda mark: None  # the mover's; set by the cache

    # -- matching ---------------------------------------------------------------------------
    def match(self, tokens: array, salt: bytes, probe: list | None = None, walked=None) -> tuple[list[Node], int, int]:
        """``(path, device_len, host_len)`` of the longest resident prefix; touches it.
        Hybrid: the longest resumable one (``path`` ends there), and ``probe`` (a list)
        gets what was resident (:class:`~kvtier.cache.hybrid_state.Probe`). ``walked``:
        what ``tree.walk`` just returned for the same arguments."""
        path, matched, made = self.tree.match(tokens, salt, walked)
        for node in made:
            self._added(node)
        if self.sides is not None and not path:  # a hybrid miss: no window to look for, nothing to cut
            if probe is not None:
                probe.append(self._miss)
            return path, 0, 0
        device_len, host_len = _tier_lens(path, matched, len(path[-1].key) if path else 0)
        if self.sides is not None:
            device_len, host_len, found = self._hybrid_lens(path, device_len, host_len)
            if device_len + host_len < path[-1].depth:  # (else nothing to cut: a full hit's case)
                self._cut(path, device_len + host_len, split=True)
            if probe is not None:
                probe.append(found)
        return path, device_len, host_len

    def match_slots(self, tokens: array, salt: bytes, probe: list | None = None) -> tuple:
        """:meth:`match`, and the path's device slots: ``(path, device_len, host_len,
        slots)``. A match whose every node is matched whole and on the device, and, hybrid,
        every sliding window too (a full hit, the common case), is taken straight from the
        walk."""
        # the walk stamps the nodes matched whole; where the slots are host tensors, it
        # takes them too when the path is on the device
        if self._offsets is None:
            path, matched, inner, slots = self.tree.walk_slots(tokens, salt, now())
        else:
            (path, matched, inner), slots = self.tree.walk(tokens, salt, now()), None
        # NOTE: what match and device_slots would do for such a path (no split, every node
        # stamped, device_len = matched, hybrid: no cut), without their layers: 3 of a
        # uniform full hit's 17 us on the Zen 2 VM went to them and the checks they make
        # for other paths
        if path and path[-1].device is not None and inner == len(path[-1].key):
            if self.sides is None:
                return path, matched, 0, self._path_slots(path, slots)
            pages = matched // self.page_size
            sides = self._full_hit_sides(path, pages)
            if sides is not None:
                if probe is not None:
                    probe.append(self._probe(path, pages, None, sides))
                return path, matched, 0, self._path_slots(path, slots)
        path, device_len, host_len = self.match(tokens, salt, probe, (path, matched, inner))
        return path, device_len, host_len, self.device_slots(path, device_len)

    def match_all(self, tokens: array, salt: bytes) -> list[Node]:
        """The path of the whole cached part of ``tokens``, however resumable; touches it."""
        path, _, made = self.tree.match(tokens, salt)
        for node in made:
            self._added(node)
        return path

    def peek(self, tokens: array, salt: bytes, probe: list | None = None) -> tuple[list[Node], int, int, int]:
        """``(path, device_len, host_len, used)``: what :meth:`match` would find, with
        no split and no LRU stamp. The last node of ``path`` may be matched only in
        part: ``used`` of its tokens."""
        path, matched, inner = self.tree.walk(tokens, salt)
        walked = len(path)
        device_len, host_len = _tier_lens(path, matched, inner)
        if len(path) < walked:  # cut: it ends with a whole node (or is empty)
            inner = len(path[-1].key) if path else 0
        if self.sides is not None:
            device_len, host_len, found = self._hybrid_lens(path, device_len, host_len)
            inner = self._cut(path, device_len + host_len, split=False)
            if probe is not None:
                probe.append(found)
        return path, device_len, host_len, inner

    def device_slots(self, path, count: int | None = None) -> torch.Tensor:
        """The device slots of ``path`` (its device nodes come first), in a new tensor;
        its first ``count`` where given (a match's ``device_len``)."""
        k = _device_count(path)
        slots = self._run_slots(path, k) if k else self._no_slots.new_empty(0)
        # NOTE: a torch slice costs about 1 µs, a full hit's tenth: only where it cuts
        return slots if count is None or slots.numel() == count else slots[:count]

    def _path_slots(self, path, slots) -> torch.Tensor:
        """The device slots of ``path``, every node of it on the device: ``slots``, the
        walk's capsule, where it took them."""
        return self._run_slots(path, len(path)) if slots is None else from_capsule(slots)

    def _run_slots(self, path, k: int) -> torch.Tensor:
        """The device slots of ``path[:k]``, every one of them on the device (``k > 0``)."""
        first, last = path[0].device, path[k - 1].device
        if first.base is last.base:
            # NOTE: the nodes of a path that share a base are one run of it, in order
            # (only a split shares a base, and its pieces stay parent and child; a piece
            # leaves the device only after the pieces below it): one slice, no loop
            return self.slots_of((first.base[first.at:last.at + len(last.pages)],), path[k - 1].depth)
        return self.slots_of([n.device.pages for n in path[:k]], path[k - 1].depth)  # run by run, not joined

    def slots_of(self, pages: np.ndarray | list | tuple, count: int | None = None) -> torch.Tensor:
        """The device token slots of ``pages`` (page numbers, or a list or tuple of runs
        of them taken one after another), a new tensor on the pool's index device.
        ``count``: how many slots that is, where the caller knows it (a path's depth)."""
        if self._offsets is None:
            compiled = load(COMPILED)
            if compiled is not None:
                # NOTE: called as is (it checks its arguments, the count among them), one call
                # for every run: the checks and concatenation around it were 2.5 of a full
                # hit's 6 us of slots
                runs = pages if isinstance(pages, (list, tuple)) else (pages,)
                if count is None:
                    count = sum([len(r) for r in runs]) * self.page_size
                try:  # straight into the new tensor's memory (slot_tensor)
                    return from_capsule(compiled.expand_runs(runs, self.page_size, count))
                except (TypeError, ValueError):  # a run not of contiguous int64: numpy's way below
                    pass
            return slot_tensor(_joined(pages), self.page_size)
        # NOTE: on an accelerator only the page numbers cross (1/page_size of the slots'
        # bytes), and the expansion runs there, queued like any kernel
        on = torch.from_numpy(_joined(pages)).to(self._offsets.device)
        return (on[:, None] * self.page_size + self._offsets).reshape(-1)

    # -- locks ------------------------------------------------------------------------------------
    def lock_node(self, node: Node) -> None:
        self.tree.lock(node)

    def unlock_node(self, node: Node) -> None:
        for freed in self.tree.unlock(node):
            if not freed.is_root:
                self._settle(freed)
        # NOTE: each unlocked node was pushed again; with no node added (a stream of full
        # hits) nothing else would bound the heaps' stale entries
        self._bound_lru()

    # -- residency primitives -----------------------------------------------------------------------
    def _added(self, node: Node) -> None:
        self._nodes += 1
        self.lru.push(node)
        self._bound_lru()

    def _bound_lru(self) -> None:
        """Compact the LRU index once its stale entries (a node pushed again whenever it
        may have become evictable) outnumber the live ones a few times over."""
        # NOTE: a hybrid cache's sliding heaps pop only when a sliding pool runs short, so
        # the entries of nodes that full-page eviction removed (each holding its node and
        # key) would stay until the duplicate bound; compacting after as many removals as
        # half the live nodes keeps them a bounded share of the tree, at O(1) amortized.
        # The index's running bound first: the heaps are counted only once it passes (a
        # count per insert cost about 1 us of an 8K-token insert's 45 on the Zen 2 VM)
        limit = 4 * self._nodes + 1024
        if self.lru.bound > limit and self.lru.longest() > limit:
            self.lru.rebuild(self.tree.nodes())
            self._removed = 0
        elif self._removed > self._nodes // 2 + 64:
            self.lru.rebuild(self.tree.nodes(), sides_only=True)
            self._removed = 0

    def _set_device(self, node: Node, pages: np.ndarray) -> None:
        """Give ``node`` the device pages ``pages`` (an array the node may keep) and, for
        a hybrid spec, no sliding pages yet."""
        node.device = DeviceCopy(pages, side=None if self.sides is None else self.sides.empty(pages.size))
        self._owned[pages] = True

    def _drop_device(self, node: Node) -> None:
        if node.device.held:
            self._drop_sides(node.device, "device")
        self._owned[node.device.pages] = False
        if self.allocator is self.device_pool:
            # NOTE: by page number, still checked: through the slots (made, then checked
            # back into pages) the two evictions of an 8K-token alloc_device into a full
            # pool took 22-25 us more (Zen 2)
            self.device_pool.free_pages(node.device.pages)
        else:  # the engine's allocator takes slots
            self.allocator.free(self.slots_of(node.device.pages))
        node.device = None
        if not node.parent.is_root:
            self.lru.push(node.parent)  # it may now be a device leaf

    def _drop_host(self, node: Node) -> None:
        if node.storing is not None:  # a queued write of this copy is dropped with it
            set_mark(node, "store", None)
        if node.host.held:
            self._drop_sides(node.host, "host")
        self.host_pool.free(node.host.slots)
        node.host = None

    def _settle(self, node: Node) -> None:
        """Remove ``node`` if it holds nothing and nothing is in flight on it, else
        offer it to the LRU index again."""
        busy = node.loading or node.backup or node.storing
        if node.resident or busy or node.children or node.lock_ref or node.is_root:
            self.lru.push(node)
            return
        if self.tree.attached(node):
            self.tree.remove(node)
            self._nodes -= 1
            self._removed += self.sides is not None  # its sliding entries are dead (see _added)
            if not node.parent.is_root:
                self.lru.push(node.parent)

    def _pages(self, slots: torch.Tensor) -> np.ndarray:
        """The page numbers of ``slots`` (whole pages), a new array on the CPU."""
        ps = self.page_size
        flat = (slots if slots.device.type == "cpu" else slots.cpu()).numpy()  # numpy: less per-call cost
        return (flat[::ps] // ps).astype(np.int64, copy=False) if ps > 1 else flat.astype(np.int64)

    def owned(self, slots: torch.Tensor) -> np.ndarray:
        """``(pages,)`` bool: which whole pages of ``slots`` a node holds."""
        return self._owned[self._pages(slots)]

    def first_owned(self, pages: np.ndarray) -> int:
        """The index of the first of the device page numbers ``pages`` (checked, int64) that
        a node holds, or -1."""
        return first_flagged(self._owned, pages, 0, True)

    # -- allocation and eviction --------------------------------------------------------------------
    def alloc(self, tier: str, n: int, group: str | None = None) -> torch.Tensor | None:
        """``n`` slots of ``tier``, evicting that tier's LRU unlocked pages if it is full
        (``group``: of that sliding group's pool, hybrid specs)."""
        if group is not None:
            pages = self.alloc_side(tier, group, -(-n // self.page_size))
            return None if pages is None else self.sides.slots(pages)
        pool = self.allocator if tier == "device" else self.host_pool
        slots = pool.alloc(n)
        if slots is None:
            if n > (self.device_pool if tier == "device" else self.host_pool).size:
                return None  # more than the whole pool: evicting could not make room, so nothing goes
            self.evict(tier, n - pool.available_size())
            slots = pool.alloc(n)
        return slots

    def evict(self, tier: str, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots of ``tier`` (whole pages, least recently
        used first; a node is split so that no more pages go than asked). A device
        page without a host copy that must keep one (``write_back``, or host-only
        pages hang below it) starts a backup instead and goes once it lands."""
        ps, freed, skipped = self.page_size, 0, []
        evictable = self._device_evictable if tier == "device" else self._host_evictable
        while freed < num_tokens:
            node = self.lru.pop(tier, evictable)
            if node is None:
                break
            want = -(-(num_tokens - freed) // ps) * ps
            if len(node.key) > want:
                self._added(self.tree.split(node, len(node.key) - want))  # ``node`` keeps the tail
            if tier == "device":
                if not node.host_ready and (self.write_policy == "write_back" or node.children):
                    if not self.begin_backup(node):
                        skipped.append(node)
                    continue
                if self.sides is not None and node.host_ready:
                    missing = self.unbacked_sides(node)  # windows the host copy lacks go down first
                    if any(idx.size for idx in missing.values()) and self._backup_new_sides(node, missing):
                        continue
                self._drop_device(node)
            else:
                self._drop_host(node)
            freed += len(node.key)
            self.stats.evicted(tier, len(node.key))
            self._settle(node)
        for node in skipped:
            self.lru.push(node)
        return freed

    @staticmethod
    def _device_evictable(node: Node) -> bool:
        if node.device is None or node.lock_ref or node.device.loading is not None or node.backup is not None:
            return False
        return not node.children or all(c.device is None for c in node.children.values())  # children leave first

    @staticmethod
    def _host_evictable(node: Node) -> bool:
        if node.host is None or node.lock_ref or node.loading is not None or node.backup is not None:
            return False
        if node.storing is not None and node.storing.started:
            return False
        return node.device is not None or not node.children  # a host-only node goes with its leaf

    # -- host -> device -----------------------------------------------------------------------------------
    def begin_load(self, path: list[Node], layer_num: int, reserved: torch.Tensor | None = None,
                   device_len: int = 0):
        """Give device slots to the host-only nodes of ``path`` (as many as fit; first
        from ``reserved``, slots the caller allocated for this, whose rest is freed)
        and mark them loading. Returns ``(handle, mark)``; ``mark`` is ``None`` when
        nothing needs loading (the handle is then finished). Hybrid: see
        :meth:`begin_load_hybrid` (``device_len``: the device hit of ``path``)."""
        if self.sides is not None:
            return self.begin_load_hybrid(path, layer_num, reserved, device_len)
        if not path:
            if reserved is not None and reserved.numel():
                self.allocator.free(reserved)
            return LoadHandle(self.slots_of(_NO_PAGES), layer_num, finished=True), None
        pin = path[-1]
        self.tree.lock(pin)  # our own path is not evicted to make room for it
        depends, nodes, pages = {}, [], []
        for node in path:
            if node.device is None:
                if not node.host_ready:
                    break
                n = len(node.key)
                if reserved is not None and reserved.numel() >= n:
                    got, reserved = reserved[:n], reserved[n:]
                else:
                    got = self.alloc("device", n)
                if got is None:
                    break
                self._set_device(node, self._pages(got))
                nodes.append(node)
            elif node.device.loading is not None:
                depends[id(node.device.loading)] = node.device.loading.handle
            pages.append(node.device.pages)
        if reserved is not None and reserved.numel():
            self.allocator.free(reserved)
        handle = LoadHandle(self.slots_of(pages), layer_num, tuple(depends.values()), finished=not nodes)
        if not nodes:
            self.unlock_node(pin)
            return handle, None
        mark = InFlight("load", nodes, device=self.slots_of([n.device.pages for n in nodes]),
                        host=torch.cat([n.host.slots for n in nodes]))
        mark.handle, mark.pin = handle, pin
        for node in nodes:
            node.device.loading = mark
        self.schedule(mark)
        return handle, mark

    def finish_load(self, mark: InFlight) -> None:
        for node in mark.clear():
            self.lru.push(node)
        self.unlock_node(mark.pin)
        self.stats.add(loaded_tokens=mark.host.numel())
        mark.done.set()

    def fail_load(self, mark: InFlight) -> None:
        """Undo a failed (or cancelled) load: its pages, and every device page below
        them, leave the device; loads that depended on it are cancelled."""
        for node in mark.clear():
            if mark.side is None or not self.fail_load_sides(mark, node):
                self._drop_device_subtree(node)
        self.unlock_node(mark.pin)
        self.stats.error("load")
        mark.done.set()

    def _drop_device_subtree(self, node: Node) -> None:
        for child in list(node.children.values()):
            if child.device is not None:
                self._drop_device_subtree(child)
        if node.device is None:
            return
        if node.device.loading is not None:
            node.device.loading.cancelled = True
            node.device.loading = None
        if node.backup is not None:  # a copy of KV computed on a failed prefix: discard it
            node.backup.cancelled = True
        self._drop_device(node)
        self._settle(node)

    # -- device -> host -----------------------------------------------------------------------------------
    def begin_backup(self, node: Node) -> bool:
        """Copy ``node`` to the host (on the mover's worker), then to storage. True if
        it has or will have a host copy."""
        if node.host_ready:
            self.queue_store(node)
            return True
        if node.device is None or node.device.loading is not None or node.backup is not None:
            return node.backup is not None
        if len(node.key) > self.host_pool.size:  # never fits, however much is evicted
            return False
        host = self.alloc("host", len(node.key))
        if host is None:
            return False
        side, moved, held = self.backup_sides(node) if self.sides is not None else (None, None, 0)
        node.host = HostCopy(host, side, held)
        mark = node.host.backup = InFlight("backup", [node], device=self.slots_of(node.device.pages), host=host)
        mark.side = moved
        self.backups.add(mark)
        self.schedule(mark)
        return True

    def finish_backup(self, mark: InFlight, ok: bool) -> None:
        self.backups.discard(mark)
        if mark.side is not None and not mark.host.numel():
            self.finish_side_backup(mark, ok)
            mark.done.set()
            return
        holders = mark.clear()
        if mark.cancelled or not ok:
            for node in holders:
                self._drop_host(node)
                self._settle(node)
            if not ok:
                self.stats.error("backup")
        else:
            self.stats.add(backed_up_tokens=sum(len(n.key) for n in holders))
            for node in holders:
                self.lru.push(node)
                self.queue_store(node)
        mark.done.set()

    # -- host -> storage ----------------------------------------------------------------------------------
    def queue_store(self, node: Node) -> None:
        if not self.has_storage or node.stored or node.storing is not None or not node.host_ready:
            return
        if node.storage is None:
            node.storage = StorageCopy()
        mark = node.storage.writing = InFlight("store", [node])
        self.schedule(mark)

    def start_store(self, mark: InFlight):
        """The keys and host slots to write, pinning them (hybrid: and per sliding
        group the pages and host slots, :meth:`store_sides`); ``None`` if every node
        of the mark lost its host copy while the write was queued."""
        holders = mark.holders()
        if not holders:
            return None
        mark.started = True
        keys = [k for node in holders for k in self.store_keys(node)]
        slots = torch.cat([node.host.slots for node in holders])
        if self.sides is not None:
            return keys, slots, self.store_sides(holders)
        return keys, slots

    def finish_store(self, mark: InFlight, ok: bool) -> None:
        holders = mark.clear()
        if ok:
            self.stats.add(stored_tokens=sum(len(n.key) for n in holders))
        elif holders:
            self.stats.error("store")
        for node in holders:
            if ok and node.storage is None:  # its write was taken off: the copy went with it
                node.storage = StorageCopy(stored=True)
            elif ok:
                node.storage.stored = True
            self.lru.push(node)

    def store_keys(self, node: Node) -> list[str]:
        """Storage keys of ``node``'s pages, chained from its parent's (computed once)."""
        todo = []
        while node.store_keys is None:
            todo.append(node)
            if node.parent.is_root:
                break
            node = node.parent
        for n in reversed(todo):
            if n.parent.is_root:
                parent_key, salt = None, self.tree.salt_of(n.parent)
            else:
                parent_key, salt = n.parent.store_keys[-1], b""  # the salt is in the parent's key
            n.store_keys = extend_keys(parent_key, n.key, self.page_size, self.namespace, salt, self.hash)
        return todo[0].store_keys if todo else node.store_keys

    # -- storage -> host -------------------------------------------------------------------------------------
    def alloc_fetch(self, n: int) -> torch.Tensor | None:
        """``n`` host slots for a prefetch to fill; they count in ``fetching`` until
        :meth:`adopt_host` takes them or :meth:`free_fetch` returns them."""
        host = self.alloc("host", n)
        if host is not None:
            self.fetching += n
        return host

    def free_fetch(self, host_slots: torch.Tensor) -> None:
        self.host_pool.free(host_slots)
        self.fetching -= host_slots.numel()

    def adopt_host(self, tokens: array, host_slots: torch.Tensor, start: int, salt: bytes, keys: list[str],
                   side: dict | None = None) -> bool:
        """Insert ``tokens[start:]`` as host-resident pages in ``host_slots`` (fetched
        from storage, from :meth:`alloc_fetch`; hybrid: ``side``, per sliding group a
        host page or ``-1`` per page, counted in ``sides.fetching``). False, taking
        nothing, when the pages before ``start`` left the tree meanwhile."""
        path, matched, made = self.tree.match(tokens, salt)
        for node in made:
            self._added(node)
        if matched < start:
            return False
        ps, cut, kept = self.page_size, (matched - start) // self.page_size, 0
        if side is not None:
            for g, pages in side.items():
                n = int(np.count_nonzero(pages >= 0))
                self.sides.fetching[g] -= n * ps
                if cut:  # pages someone cached meanwhile: theirs stay, these go back
                    n -= self.free_side("host", g, pages[:cut])
                kept += n
        if matched > start:  # someone cached part of it meanwhile: keep theirs
            self.host_pool.free(host_slots[:matched - start])
        if matched < len(tokens):
            node = self.tree.add_child(path[-1] if path else self.tree.root(salt), tokens[matched:])
            rest = None if side is None else {g: a[cut:] for g, a in side.items()} if cut else side
            node.host = HostCopy(host_slots[matched - start:], rest, kept)
            node.storage = StorageCopy(stored=True)
            node.store_keys = keys[(matched - start) // self.page_size:]
            self._added(node)
        self.fetching -= host_slots.numel()  # adopted, or freed above
        return True

    # -- inserting ------------------------------------------------------------------------------------------
    def check_insert(self, tokens: array, pages: np.ndarray, salt: bytes):
        """``ValueError`` unless every device page (``pages``, the page numbers of the
        slots) that the tree would adopt is the caller's: not held by a node (and
        allocated, when the cache allocates for the engine). Returns the tree walk,
        for :meth:`insert` right after."""
        walked = path, _, inner = self.tree.walk(tokens, salt)
        ps, held, theirs = self.page_size, 0, []
        for i, node in enumerate(path):  # the prompt's pages the path holds on the device
            if node.device is None:
                break
            n = (inner if i == len(path) - 1 else len(node.key)) // ps
            theirs.append(node.device.pages[:n])
            held += n
        page = first_flagged(self._owned, pages, 0, True)  # a page some node holds may only be that node's own
        if 0 <= page < held:  # the caller's copy of a held page is either the node's or a duplicate
            bad = self._owned[pages[:held]] & (pages[:held] != np.concatenate(theirs))
            found = np.flatnonzero(bad)
            page = int(found[0]) if found.size else first_flagged(self._owned, pages, held, True)
        if page >= 0:
            raise UsageError(f"insert: device slot {int(pages[page]) * ps} (page {page} of the prompt) already "
                             "holds another cached page; pass slots from alloc_device, or the match's own")
        if self.allocator is self.device_pool and held < pages.size:  # the pages the tree would adopt
            page = self.device_pool.first_unallocated(pages, held)
            if page >= 0:
                raise UsageError(f"insert: device slot {int(pages[page]) * ps} is not allocated; get slots from "
                                 "alloc_device")
        return walked

    def insert(self, tokens: array, pages: np.ndarray, salt: bytes, walked,
               side: dict | None = None, resume_at=(), owned=frozenset()) -> tuple[int, int]:
        """Cache ``tokens`` (whole pages) whose KV is in the device pages ``pages`` (an
        array the tree may keep); ``walked`` is what :meth:`check_insert` returned, with
        the lock held since. Hybrid: ``side`` holds the engine's sliding pages, which
        :meth:`check_sides` passed and answered ``owned`` for, the lock held since too
        (:meth:`adopt_sides`). Returns ``(tokens already on the device, new tokens)``."""
        path, matched, made = self.tree.match(tokens, salt, walked)
        for node in made:
            self._added(node)
        already, offset, ps = 0, 0, self.page_size
        for node in path:
            if node.device is None:  # host-only (or empty): adopt the caller's freshly computed pages
                self._set_device(node, pages[offset // ps:(offset + len(node.key)) // ps])
                self.lru.push(node)
            elif already == offset:
                already += len(node.key)
            offset += len(node.key)
        if matched < len(tokens):
            node = self.tree.add_child(path[-1] if path else self.tree.root(salt), tokens[matched:])
            self._set_device(node, pages[matched // ps:])
            self._added(node)
            path.append(node)
        if self.sides is not None and path:
            if side is None:  # no page given: nothing to check, none to free
                side, owned = self.sides.empty(len(tokens) // ps), frozenset()
            self.adopt_sides(path, side, len(tokens), resume_at, owned)
        if self.write_policy == "write_through":
            for node in path:
                self.begin_backup(node)
        return already, len(tokens) - matched

    # -- accounting --------------------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Host bytes of the tree's metadata (``HierarchicalCache.memory_bytes`` says what
        is counted): every node, roots included, with its copies; the LRU index; the
        device-page ownership maps."""
        counted = Footprint()
        for node in itertools.chain(self.tree.roots.values(), self.tree.nodes()):
            counted.node(node)
        sides = self.sides.memory_bytes() if self.sides is not None else 0
        return counted.total + self.lru.memory_bytes() + sys.getsizeof(self._owned) + sides

    # -- integrity ---------------------------------------------------------------------------------------------
    def _check_base_run(self, node: Node) -> None:
        """The ancestors of ``node`` that share its device base are its parent, its
        parent's parent, ... with adjacent offsets, and no higher ancestor shares it
        (what :meth:`device_slots` relies on)."""
        up, at, base = node.parent, node.device.at, node.device.base
        while not up.is_root and up.device.base is base:
            if up.device.at + len(up.device.pages) != at:
                raise IntegrityError(f"{up}: not adjacent to the next piece of its base")
            at, up = up.device.at, up.parent
        while not up.is_root:
            if up.device.base is base:
                raise IntegrityError(f"{node}: its base reappears above a gap")
            up = up.parent

    def _check_node(self, node: Node) -> None:
        """One node's own invariants: whole pages, device pages a prefix-closed run of
        their base, indexed for LRU if evictable."""
        pages = len(node.key) // self.page_size
        if len(node.key) % self.page_size or not pages:
            raise IntegrityError(f"{node}: its key is not a positive number of whole pages")
        if node.depth != node.parent.depth + len(node.key):
            raise IntegrityError(f"{node}: depth {node.depth}, not its parent's {node.parent.depth} plus its key")
        dev = node.device
        if dev is not None:
            if not (node.parent.is_root or node.parent.device is not None):
                raise IntegrityError(f"{node}: device not prefix-closed")
            if dev.pages.dtype != np.int64 or dev.pages.shape != (pages,):
                raise IntegrityError(f"{node}: device pages {dev.pages.dtype} {dev.pages.shape}, "
                                     f"not int64 ({pages},)")
            if not np.array_equal(dev.base[dev.at:dev.at + pages], dev.pages):
                raise IntegrityError(f"{node}: device pages are not its base's run")
            self._check_base_run(node)
        if node.host is not None and tuple(node.host.slots.shape) != (len(node.key),):
            raise IntegrityError(f"{node}: host slots {tuple(node.host.slots.shape)}, not ({len(node.key)},)")
        if node.storage is not None and not node.storage.stored and node.storage.writing is None:
            raise IntegrityError(f"{node}: an empty storage copy (no object, no write)")
        for tier, ok in (("device", self._device_evictable), ("host", self._host_evictable)):
            if ok(node) and not self.lru.contains(tier, node):
                raise IntegrityError(f"{node}: evictable but not in the {tier} LRU")

    def check_integrity(self, engine_device_slots: int | None = None) -> None:
        """Raise :class:`~kvtier.errors.IntegrityError` unless the structural invariants
        hold (tests call it after every step; ``KVTIER_CHECK=1`` after every call):
        slots owned once, ownership map exact, device copies prefix-closed, no slot
        leaked, every evictable node indexed for LRU."""
        dev_pages, host_slots = [], []
        for node in self.tree.nodes():
            self._check_node(node)
            if node.device is not None:
                dev_pages += node.device.pages.tolist()
            if node.host is not None:
                host_slots += node.host.slots.tolist()
        if len(dev_pages) != len(set(dev_pages)):
            raise IntegrityError("a device page is held by two nodes")
        if len(host_slots) != len(set(host_slots)):
            raise IntegrityError("a host slot is held by two nodes")
        if sorted(np.flatnonzero(self._owned).tolist()) != sorted(dev_pages):
            raise IntegrityError("ownership map is stale")
        if self.host_pool.available_size() + len(host_slots) + self.fetching != self.host_pool.size:
            raise IntegrityError("host slots leaked")
        if self.sides is not None:
            self.check_side_integrity(list(self.tree.nodes()))
        if engine_device_slots is not None:
            held = len(dev_pages) * self.page_size + engine_device_slots
            if self.allocator.available_size() + held != self.device_pool.size:
                raise IntegrityError("device slots leaked")
