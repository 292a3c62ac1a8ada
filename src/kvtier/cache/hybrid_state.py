"""The hybrid half of ``CacheState``: sliding-window pages beside the full pages.

Mixed into :class:`~kvtier.cache.state.CacheState`; every method runs with the
state's lock held and only when the cache serves a hybrid spec (``self.sides``).
The full groups keep the uniform rules (prefix-closed device copies, LRU per node);
the sliding groups' pages are optional extras of a node's device and host copies
(``kvtier.cache.sides``), so dropping one never breaks an invariant: it only makes
the prefixes whose window it was in no longer resumable, which every match checks.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from ..errors import IntegrityError, UsageError
from .handles import LoadHandle
from .inflight import InFlight
from .lru import side_tier
from .residency import held_count
from ..compiled import load
from ..pools.indices import COMPILED, first_flagged, from_capsule, page_token_slots
from .sides import HOLE, highest, lowest, resumable, runs

_NONE = np.empty(0, dtype=np.int64)
_NO_SLOTS = torch.empty(0, dtype=torch.int64)  # what a group's empty slots are made from (new_empty)


class Probe:
    """What a hybrid match found resident, for the storage lookup after it: its
    resident full pages and per sliding group the pages held on the device or the
    host (``held``, worked out from the path on first use, lock held). ``windows``:
    where every window before ``pages`` was found on the device, the pieces of it, or
    (a full hit's) ``slots``, the groups' device slots made from them
    (:meth:`HybridState.side_slots` takes them, rather than walk the path again)."""

    __slots__ = ("pages", "_held", "_make", "windows", "slots")

    def __init__(self, pages: int, held: dict[str, np.ndarray] | None, make=None, windows=None,
                 slots=None) -> None:
        self.pages, self._held, self._make, self.windows, self.slots = pages, held, make, windows, slots

    @property
    def held(self) -> dict[str, np.ndarray]:
        if self._held is None:
            self._held, self._make = self._make(), None
        return self._held


class HybridState:
    # -- matching -------------------------------------------------------------------------------
    def _side_held(self, path, pages: int) -> dict[str, tuple[list[int], list[int]]]:
        """Per sliding group, ``(device-held, host-held)``: the indices of the pages of
        ``path`` whose sliding page the device, or the ready host copy, holds (the first
        ``pages`` pages and perhaps some after them). Copies that hold none are skipped."""
        out = {g: ([], []) for g in self.sides.names}
        at, ps = 0, self.page_size
        for node in path:
            if at >= pages:
                break
            d, h = node.device, node.host
            for copy, k in ((d, 0), (h if h is not None and h.backup is None else None, 1)):
                if copy is not None and copy.held:
                    for g, (dev, host) in out.items():
                        idx = np.flatnonzero(copy.side[g] >= 0)
                        (dev, host)[k].extend((idx + at).tolist() if at else idx.tolist())
            at += len(node.key) // ps
        return out

    @staticmethod
    def _held_mask(held: dict[str, tuple[list[int], list[int]]], pages: int) -> dict[str, np.ndarray]:
        """Per sliding group, a bool array over ``pages`` pages: held on the device or the host."""
        out = {}
        for g, (dev, host) in held.items():
            mask = np.zeros(pages, dtype=bool)
            mask[[i for i in (*dev, *host) if i < pages]] = True
            out[g] = mask
        return out

    def _device_windows(self, path, pages: int) -> dict[str, list] | None:
        """Per sliding group, its window before ``pages`` pages of ``path`` as pieces
        ``(first page, the device's page numbers from there)``, where every group's window
        is wholly on the device (the common full hit: found from the path's end, no arrays
        built); else ``None``. The path's last node may reach past ``pages`` (a peek's)."""
        ps, out = self.page_size, {}
        for g in self.sides.names:
            w = self.sides.window_pages(g, pages * ps)
            pieces, held_pages = self._window_pieces(path, g, w), 0
            for _, held in pieces:
                if lowest(held) < 0:
                    return None  # a hole: the device lacks that page of the window
                held_pages += len(held)
            if held_pages < len(w):
                return None  # a node of the window not on the device
            out[g] = pieces
        return out

    def _hybrid_lens(self, path, device_len: int, host_len: int) -> tuple[int, int, Probe]:
        """The hybrid reuse rule (docs/hybrid.md) on a walked path: ``(device_len, host_len, probe)``, the device hit
        being the longest prefix whose every group is on the device, the host hit
        what device and host hold together beyond it."""
        ps, windows = self.page_size, self.sides.windows
        if not path:  # a miss (most requests of a trace): nothing to look at
            return 0, 0, self._miss
        pages = (device_len + host_len) // ps
        on_device = None if host_len else self._device_windows(path, pages)
        if on_device is not None:
            return device_len, 0, self._probe(path, pages, on_device)
        if self._windows_held(path, pages):  # the common host hit: it resumes at its end
            # NOTE: then the device part resumes at its own end when its windows are on the
            # device (none are needed before page 0); else the search below finds where
            p_dev = 0 if not device_len else device_len // ps if self._device_windows(path, device_len // ps) \
                else None
            if p_dev is not None:
                return p_dev * ps, pages * ps - p_dev * ps, self._probe(path, pages, None)
        held = self._side_held(path, pages)
        p_dev = resumable(windows, {g: runs(dev) for g, (dev, _) in held.items()}, device_len // ps, ps)
        p_all = max(p_dev, resumable(windows, {g: runs(dev + host) for g, (dev, host) in held.items()}, pages, ps))
        # NOTE: the masks come from the index lists, not the path: the cut after this may split its last node
        return p_dev * ps, (p_all - p_dev) * ps, Probe(pages, None, lambda: self._held_mask(held, pages))

    def _probe(self, path, pages: int, windows, slots=None) -> Probe:
        """The probe of a match that resumes after all ``pages`` pages of ``path`` (so the
        cut after it splits nothing): what is held is worked out from the path on first
        use, when storage asks."""
        if not self.has_storage:  # nothing will ask what is held
            return Probe(pages, {}, None, windows, slots)
        snapshot = list(path)
        return Probe(pages, None, lambda: self._held_mask(self._side_held(snapshot, pages), pages), windows, slots)

    def _full_hit_sides(self, path, pages: int) -> dict[str, torch.Tensor] | None:
        """Per sliding group, what :meth:`side_slots` gives for ``pages`` pages of ``path``
        (a full hit: its last node ends there), where every group's window before them
        is wholly on the device (:meth:`_device_windows`' test); else ``None``."""
        # NOTE: one pass: the expansion counts the window's pages it wrote, which are all
        # of them where no page is a hole and no node of the window is off the device
        # (_window_pieces leaves those out): 1.5 us of a MiMo full hit's 13 beyond a
        # uniform one's went to _device_windows' own pass and side_slots' layers
        ps, out, compiled = self.page_size, {}, load(COMPILED)
        for g in self.sides.names:
            w = self.sides.window_pages(g, pages * ps)
            slots, written = self._window_slots(self._window_pieces(path, g, w), pages, compiled)
            if written < len(w):
                return None
            out[g] = slots
        return out

    def _windows_held(self, path, pages: int) -> bool:
        """Whether each sliding group's window before ``pages`` pages of ``path`` is
        held, page by page, on the device or in a ready host copy."""
        for g in self.sides.names:
            w = self.sides.window_pages(g, pages * self.page_size)
            need = len(w)
            for node, _, span in self._window_spans(path, w):
                d, h = node.device, node.host
                dev = d.side[g][span].tolist() if d is not None and d.held else None
                host = h.side[g][span].tolist() if h is not None and h.held and h.backup is None else None
                if dev is None and host is None:
                    return False
                for i in range(span.stop - span.start):
                    if (dev is None or dev[i] < 0) and (host is None or host[i] < 0):
                        return False
                need -= span.stop - span.start
            if need:
                return False
        return True

    def _cut(self, path, tokens: int, split: bool) -> int:
        """Cut ``path`` after ``tokens`` tokens (splitting the node it ends inside when
        ``split``); returns the tokens used of its last node."""
        # NOTE: from the end, by depth: a full hit cuts nothing and looks at one node
        keep = len(path)
        while keep and path[keep - 1].depth - len(path[keep - 1].key) >= tokens:  # wholly past the cut
            keep -= 1
        del path[keep:]
        if not path:
            return 0
        node = path[-1]
        start = node.depth - len(node.key)
        if tokens >= node.depth:
            return len(node.key)
        if split:
            top = self.tree.split(node, tokens - start)
            self._added(top)
            path[-1] = top
        return tokens - start

    def side_slots(self, path, prefix: int, probe: Probe | None = None) -> dict[str, torch.Tensor]:
        """Per sliding group, the device slots of ``prefix`` tokens of ``path``: the
        window before ``prefix``, ``-1`` elsewhere (and where the device lacks a page).
        ``probe``: the match's, whose windows are taken when they end at ``prefix``
        (the tree unchanged since, lock held)."""
        ps, out = self.page_size, {}
        pages = prefix // ps
        if probe is not None and probe.slots is not None and probe.pages == pages:
            return probe.slots
        if not pages:  # a miss's: new empty tensors (new_empty: 1.4 us; numpy's way 4.5 a group)
            return {g: _NO_SLOTS.new_empty(0) for g in self.sides.names}
        compiled = load(COMPILED)
        found = probe.windows if probe is not None and probe.pages == pages else None
        for g in self.sides.names:
            if found is not None:
                pieces = found[g]
            else:
                pieces = self._window_pieces(path, g, self.sides.window_pages(g, pages * ps))
            out[g] = self._window_slots(pieces, pages, compiled)[0]
        return out

    def _window_slots(self, pieces, pages: int, compiled) -> tuple[torch.Tensor, int]:
        """A sliding group's device slots of ``pages`` pages: its window's ``pieces``
        (:meth:`_window_pieces`), ``-1`` elsewhere and at holes; and how many pages the
        pieces gave (those that are not holes). ``compiled``: the indices module, or
        ``None`` for numpy's way."""
        ps = self.page_size
        if compiled is not None:
            # NOTE: one call fills the -1s and expands every piece (holes kept): with a
            # copy of a kept array of -1s and a call per piece, side_slots took 6.1 us of
            # a MiMo full hit's 17 beyond a uniform one's (page 64), 4.4 with it
            slots, written = compiled.window_slots(pieces, ps, pages * ps)  # a new tensor's memory (slot_tensor)
            return from_capsule(slots), written
        slots, written = self.sides.holes(pages * ps), 0
        for lo, held in pieces:
            piece = page_token_slots(np.maximum(held, 0), ps)
            piece[np.repeat(held < 0, ps)] = HOLE
            slots[lo * ps:lo * ps + piece.size] = piece
            written += int((held >= 0).sum())
        return torch.from_numpy(slots), written

    def _window_spans(self, path, w: range):
        """The nodes of ``path`` that window ``w`` (page indices) lies in, from the path's
        end, each as ``(node, the window's first page in it, those pages' slice of the
        node's own)``."""
        ps = self.page_size
        # NOTE: from the path's end, by each node's depth: only the nodes past the prefix
        # and those the window lies in are visited (a path of one node per page took
        # 0.3 us a node from the root)
        for node in reversed(path):
            end = node.depth // ps
            at = end - len(node.key) // ps
            if end <= w.start:
                return
            if at < w.stop:  # (else past the prefix)
                lo = max(w.start, at)
                yield node, lo, slice(lo - at, min(w.stop, end) - at)

    def _window_pieces(self, path, g: str, w: range) -> list:
        """Group ``g``'s window ``w`` (page indices) along ``path`` as pieces ``(first page,
        the device's page numbers from there)``, holes included; pages not on the device
        are left out."""
        if w and path:
            # NOTE: a window within the path's last node (a full hit's, past a short last
            # node's start) is that node's one piece: no generator walks the path for it
            node = path[-1]
            end = node.depth // self.page_size
            at = end - len(node.key) // self.page_size
            if at <= w.start and w.stop <= end:
                return [] if node.device is None else [(w.start, node.device.side[g][w.start - at:w.stop - at])]
        return [(lo, node.device.side[g][span]) for node, lo, span in self._window_spans(path, w)
                if node.device is not None]

    # -- side pages in and out ------------------------------------------------------------------
    def free_side(self, tier: str, g: str, pages: np.ndarray) -> int:
        """Give sliding group ``g``'s pages ``pages`` (holes skipped) back to its ``tier``
        pool; returns how many that was."""
        pages = pages[pages >= 0]
        if not pages.size:
            return 0
        if tier == "device":
            self.sides.owned[g][pages] = False
            self.sides.device[g].free_pages(pages)
        else:
            self.sides.host[g].free_pages(pages)
        return pages.size

    def _drop_sides(self, copy, tier: str) -> None:
        for g, pages in copy.side.items():
            self.free_side(tier, g, pages)
            pages[:] = HOLE
        copy.held = 0

    def alloc_side(self, tier: str, g: str, n: int) -> np.ndarray | None:
        """``n`` pages of sliding group ``g`` in ``tier``, evicting that group's LRU
        unlocked pages there if it is full."""
        pool = (self.sides.device if tier == "device" else self.sides.host)[g]
        got = self.sides.alloc_pages(pool, n)
        if got is None:
            if n * self.page_size > pool.size:
                return None  # more than the whole pool: no eviction could make room
            self.evict_side(tier, g, n * self.page_size - pool.available_size())
            got = self.sides.alloc_pages(pool, n)
        return got

    def evict_side(self, tier: str, g: str, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots of sliding group ``g`` in ``tier``: every
        page of ``g`` of the least recently used unlocked nodes, until enough."""
        freed, heap = 0, side_tier(tier, g)
        evictable = self._side_device_evictable if tier == "device" else self._side_host_evictable
        while freed < num_tokens:
            node = self.lru.pop(heap, lambda n: evictable(n, g))
            if node is None:
                break
            copy = getattr(node, tier)
            n = self.free_side(tier, g, copy.side[g])
            copy.side[g][:] = HOLE
            copy.held -= n
            freed += n * self.page_size
            self.lru.push(node)
        return freed

    @staticmethod
    def _side_device_evictable(node, g: str) -> bool:
        d = node.device
        if d is None or not d.held or node.lock_ref or d.loading is not None or node.backup is not None:
            return False
        return highest(d.side[g]) >= 0

    @staticmethod
    def _side_host_evictable(node, g: str) -> bool:
        h = node.host
        if h is None or not h.held or node.lock_ref or h.backup is not None or node.loading is not None:
            return False
        if node.storing is not None and node.storing.started:
            return False
        return highest(h.side[g]) >= 0

    # -- inserting ------------------------------------------------------------------------------
    def check_sides(self, given: dict[str, np.ndarray], walked) -> set[str]:
        """``ValueError`` unless every sliding page the engine gives is its own: not
        held by a node (but that node's own page at the same place), and allocated.
        Returns the groups where some given page is such a node's own (mostly none)."""
        path, _, inner = walked
        ps, owned = self.page_size, set()
        for g, pages in given.items():
            mine = pages >= 0
            fresh = pages[mine]
            if first_flagged(self.sides.owned[g], fresh, 0, True) >= 0:  # only the node's own page at the same place
                own = np.full(pages.size, HOLE, dtype=np.int64)
                at = 0
                for i, node in enumerate(path):
                    if node.device is None:
                        break
                    n = (inner if i == len(path) - 1 else len(node.key)) // ps
                    own[at:at + n] = node.device.side[g][:n]
                    at += n
                bad = mine & self.sides.owned[g][np.maximum(pages, 0)] & (pages != own)
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    raise UsageError(f"groups[{g!r}]: device slot {int(pages[i]) * ps} (page {i} of the prompt) "
                                     "already holds another cached page; pass slots from alloc_device(n, group=...)")
                fresh = pages[mine & (pages != own)]
                owned.add(g)
            free = self.sides.device[g].first_unallocated(fresh) if fresh.size else -1
            if free >= 0:
                raise UsageError(f"groups[{g!r}]: device slot {int(fresh[free]) * ps} is not allocated; get slots "
                                 "from alloc_device(n, group=...)")
        return owned

    def adopt_sides(self, path, given: dict[str, np.ndarray], tokens: int, resume_at=(), owned=frozenset()) -> None:
        """Take the engine's sliding pages (``given``, one per page of ``tokens`` tokens
        along ``path``) where a resume point's window needs them and the node has
        none; free the rest. Marks the sequence's end as a resume point; ``resume_at``:
        more of them (token offsets, whole pages, within the sequence). ``given`` passed
        :meth:`check_sides`, which returned ``owned``, with the lock held since: its
        checks stand, and the pages are not looked at again."""
        ps = self.page_size
        path[-1].ends = True
        points, pos, starts = {tokens, *self.sides.retention_points(tokens), *resume_at}, 0, []
        for node in path:
            starts.append(pos // ps)
            pos += len(node.key)
            if node.ends or len(node.children) > 1:
                points.add(pos)
        keep = self.sides.keep_pages(tokens // ps, points)
        taken = {}  # node index -> {group: page indices in the node}
        for g, pages in given.items():
            rest = pages >= 0
            kept = keep[g]
            if type(kept) is range:  # one window: slices
                rest[kept.start:kept.stop] = False
                kept_pages = pages[kept.start:kept.stop].tolist()
            else:
                rest[kept] = False
                kept_pages, kept = pages[kept].tolist(), kept.tolist()
            freed = pages[rest]  # in no window: back to the pool at once
            if g in owned:
                own = self.sides.owned[g][freed]
                if np.count_nonzero(own):  # a node's own page, given back at its place (check_sides): it stays
                    freed = freed[~own]
            # NOTE: the engine's own pages, none a node's: check_sides found them allocated
            # (and _given_pages distinct), so they go back unchecked
            self.sides.device[g].release_pages(freed)
            drop = []
            for i, page in zip(kept, kept_pages):
                if page < 0:
                    continue
                k = bisect.bisect_right(starts, i) - 1
                copy = path[k].device
                mine, local = copy.side[g], i - starts[k]
                if mine[local] < 0:
                    mine[local] = page
                    copy.held += 1
                    self.sides.owned[g][page] = True
                    taken.setdefault(k, {}).setdefault(g, []).append(local)
                elif mine[local] != page:
                    drop.append(page)  # the node has its own copy: the engine's is a duplicate
            if drop:
                self.free_side("device", g, np.array(drop, dtype=np.int64))
        for k, mine in taken.items():  # (only these changed: the others' LRU entries stand)
            node = path[k]
            if node.host_ready:
                self._backup_new_sides(node, {g: np.array(idx, dtype=np.int64) for g, idx in mine.items()})
            self.lru.push(node)

    def unbacked_sides(self, node) -> dict[str, np.ndarray]:
        """Per sliding group, the pages of ``node``'s device copy its host copy lacks
        (no group when the device copy holds none)."""
        if not node.device.held:
            return {}
        return {g: np.flatnonzero((node.device.side[g] >= 0) & (node.host.side[g] < 0)) for g in self.sides.names}

    def _backup_new_sides(self, node, taken: dict[str, np.ndarray]) -> bool:
        """Copy the sliding pages ``taken`` of ``node``'s device copy to its ready host
        copy (a branch point made after the node was backed up, or a device copy about
        to be evicted): the window outlives the device copy, and the node's objects are
        written again with it. False when nothing was copied (no host page free)."""
        dev, host = {}, {}
        for g, idx in taken.items():
            idx = idx[node.host.side[g][idx] < 0]
            pages = self.alloc_side("host", g, idx.size) if idx.size else None
            if pages is None or node.host is None or not node.host_ready:
                if pages is not None:
                    self.free_side("host", g, pages)
                continue
            node.host.side[g][idx] = pages
            node.host.held += pages.size
            dev[g], host[g] = self.sides.slots(node.device.side[g][idx]), self.sides.slots(pages)
        if not dev:
            return False
        empty = torch.empty(0, dtype=torch.int64)
        mark = node.host.backup = InFlight("backup", [node], device=empty, host=empty)
        mark.side = (dev, host)
        self.backups.add(mark)
        self.schedule(mark)
        return True

    def finish_side_backup(self, mark, ok: bool) -> None:
        """Settle a backup of sliding pages alone (:meth:`_backup_new_sides`): undone, only
        its own pages go; done, the node's objects are written again."""
        for node in mark.clear():
            if mark.cancelled or not ok:
                for g, slots in mark.side[1].items():
                    pages = node.host.side[g]
                    ours = np.isin(pages, self.sides.pages_of(slots)) & (pages >= 0)
                    self.free_side("host", g, pages[ours])
                    pages[ours] = HOLE
                    node.host.held -= int(ours.sum())
            else:
                if node.stored and node.storing is None:
                    node.storage = None
                self.queue_store(node)
            self.lru.push(node)
        if not ok:
            self.stats.error("backup")

    # -- host -> device -------------------------------------------------------------------------
    def _plan_load(self, path, target: int):
        """What a load to resume after ``target`` tokens moves: the host-only nodes
        (their full pages, and their sliding pages in the window before ``target``)
        and, per device-resident node, the window pages only the host has: lists of
        ``(node, {group: page indices in the node})``. ``None`` when a node it needs
        is being loaded for another window already."""
        ps, whole, partial, depends = self.page_size, [], [], {}
        need = {g: self.sides.window_pages(g, target) for g in self.sides.names}
        at = 0
        for node in path:
            n = len(node.key) // ps
            missing = {}
            for g, w in need.items():
                lo, hi = max(w.start, at) - at, min(w.stop, at + n) - at
                if lo < hi:
                    idx = np.arange(lo, hi)
                    if node.device is not None:
                        idx = idx[node.device.side[g][idx] < 0]
                    if idx.size:
                        missing[g] = idx
            if missing and not (node.host_ready and all((node.host.side[g][idx] >= 0).all()
                                                        for g, idx in missing.items())):
                return None  # the host lost a page of the window since the match
            if node.device is None:
                if not node.host_ready:
                    return None
                whole.append((node, missing))
            else:
                if node.device.loading is not None:
                    if missing:
                        return None
                    depends[id(node.device.loading)] = node.device.loading.handle
                elif missing:
                    partial.append((node, missing))
            at += n
        return whole, partial, depends

    def _load_pages(self, whole, partial, reserved):
        """Device pages for a planned load, all or nothing: ``(full pages per whole
        node, {group: device pages in load order}, {group: host pages})``, or ``None``
        (every page taken is given back)."""
        ps, full, side_host, got_side = self.page_size, [], {g: [] for g in self.sides.names}, {}
        # NOTE: the reserved slots as page numbers once, taken node by node as slices
        ready = self._pages(reserved) if reserved is not None and reserved.numel() else _NONE
        used = 0
        for node, _ in whole:
            n = len(node.key) // ps
            if ready.size - used >= n:
                pages, used = ready[used:used + n], used + n
            else:
                slots = self.alloc("device", n * ps)
                if slots is None:
                    break
                pages = self._pages(slots)
            full.append(pages)
        for node, missing in whole + partial:
            for g, idx in missing.items():
                side_host[g].append(node.host.side[g][idx])
        for g in self.sides.names:
            side_host[g] = np.concatenate(side_host[g]) if side_host[g] else np.zeros(0, dtype=np.int64)
            if len(full) == len(whole):
                pages = self.alloc_side("device", g, side_host[g].size)
                if pages is not None:
                    got_side[g] = pages
        if used < ready.size:
            self.allocator.free(reserved[used * ps:])
        if len(full) < len(whole) or len(got_side) < len(self.sides.names):
            for pages in full:
                self.allocator.free(self.slots_of(pages))
            for g, pages in got_side.items():
                self.free_side("device", g, pages)
            return None
        return full, got_side, side_host

    def begin_load_hybrid(self, path, layer_num: int, reserved, device_len: int):
        """:meth:`CacheState.begin_load` for a hybrid spec: all or nothing, to resume
        after the whole of ``path``. When the pages cannot all be had, nothing loads
        and the handle holds the device hit (``device_len`` tokens) alone."""
        if not path:  # a miss: an empty handle, no window
            if reserved is not None and reserved.numel():
                self.allocator.free(reserved)
            handle = LoadHandle(self.device_slots([]), layer_num,
                                groups={g: torch.empty(0, dtype=torch.int64) for g in self.sides.names}, finished=True)
            return handle, None
        target = sum(len(n.key) for n in path)
        plan = self._plan_load(path, target)
        if plan is not None and not plan[0] and not plan[1]:  # all on the device already
            if reserved is not None and reserved.numel():
                self.allocator.free(reserved)
            handle = LoadHandle(self.device_slots(path), layer_num, tuple(plan[2].values()),
                                groups=self.side_slots(path, target), finished=True)
            return handle, None
        got = self._load_pages(plan[0], plan[1], reserved) if plan is not None else None
        if got is None:
            if plan is None and reserved is not None and reserved.numel():
                self.allocator.free(reserved)
            keep = path[:]
            self._cut(keep, device_len, split=False)
            handle = LoadHandle(self.device_slots(keep, device_len), layer_num,
                                groups=self.side_slots(keep, device_len), finished=True)
            return handle, None
        whole, partial, depends = plan
        full, side_dev, side_host = got
        for g, pages in side_dev.items():
            self.sides.owned[g][pages] = True
        pin = path[-1]
        self.tree.lock(pin)
        used = dict.fromkeys(self.sides.names, 0)
        for (node, _), pages in zip(whole, full):
            self._set_device(node, pages)
        for node, missing in whole + partial:
            for g, idx in missing.items():
                node.device.side[g][idx] = side_dev[g][used[g]:used[g] + idx.size]
                node.device.held += idx.size
                used[g] += idx.size
        nodes = [node for node, _ in whole + partial]
        handle = LoadHandle(self.device_slots(path), layer_num, tuple(depends.values()),
                            groups=self.side_slots(path, target), finished=not nodes)
        if not nodes:
            self.unlock_node(pin)
            return handle, None
        empty = torch.empty(0, dtype=torch.int64)
        mark = InFlight("load", nodes,
                        device=self.slots_of([n.device.pages for n, _ in whole]) if whole else empty,
                        host=torch.cat([n.host.slots for n, _ in whole]) if whole else empty)
        mark.side = ({g: self.sides.slots(side_dev[g]) for g in self.sides.names},
                     {g: self.sides.slots(side_host[g]) for g in self.sides.names})
        mark.handle, mark.pin = handle, pin
        for node in nodes:
            node.device.loading = mark
        self.schedule(mark)
        return handle, mark

    def fail_load_sides(self, mark, node) -> bool:
        """Undo a failed load's sliding pages on ``node`` when the load only added
        those (its full pages were there before); True if it did."""
        if node.device is None:  # dropped with an ancestor's failed pages already
            return True
        if mark.device.numel() and np.isin(node.device.pages, self._pages(mark.device)).any():
            return False
        for g, slots in mark.side[0].items():
            pages = node.device.side[g]
            ours = np.isin(pages, self.sides.pages_of(slots)) & (pages >= 0)
            self.free_side("device", g, pages[ours])
            pages[ours] = HOLE
            node.device.held -= int(ours.sum())
        node.device.loading = None
        self.lru.push(node)
        return True

    # -- device -> host -------------------------------------------------------------------------
    def backup_sides(self, node):
        """Host pages for the sliding pages of ``node``'s device copy (a group whose
        host pool is full of locked pages is left out: a hole); returns
        ``(host side arrays, ({group: device slots}, {group: host slots}), pages taken)``."""
        n = len(node.key) // self.page_size
        if not node.device.held:
            return self.sides.empty(n), ({}, {}), 0
        side, dev, host, taken = {}, {}, {}, 0
        one = len(self.sides.names) == 1  # then the copy's count is that group's
        for g in self.sides.names:
            mine = node.device.side[g]
            held = mine >= 0
            count = node.device.held if one else np.count_nonzero(held)
            pages = self.alloc_side("host", g, count) if count else None
            out = self.sides.holes(n)
            if pages is not None:
                out[held] = pages
                dev[g], host[g] = self.sides.slots(mine[held]), self.sides.slots(pages)
                taken += pages.size
            side[g] = out
        return side, (dev, host), taken

    # -- host -> storage ------------------------------------------------------------------------
    def store_sides(self, holders) -> dict[str, tuple[list[int], torch.Tensor]]:
        """Per sliding group, ``(page numbers in the write, host slots)`` of what the
        holders' host copies hold."""
        out = {}
        for g in self.sides.names:
            pages = np.concatenate([n.host.side[g] for n in holders])
            idx = np.flatnonzero(pages >= 0)
            out[g] = (idx.tolist(), self.sides.slots(pages[idx]))
        return out

    # -- integrity ------------------------------------------------------------------------------
    def check_side_integrity(self, nodes) -> None:
        """Side arrays one int64 entry per page, each copy's count of them exact, each
        page held once per tier and group and allocated, the ownership map exact, no side
        slot leaked."""
        ps = self.page_size
        for node in nodes:
            for copy in (node.device, node.host):
                if copy is not None and copy.side is not None and held_count(copy.side) != copy.held:
                    raise IntegrityError(f"{node}: counts {copy.held} sliding pages, holds {held_count(copy.side)}")
        for g in self.sides.names:
            dev, host = [], []
            for node in nodes:
                for copy, out in ((node.device, dev), (node.host, host)):
                    if copy is None:
                        continue
                    pages = copy.side.get(g) if copy.side is not None else None
                    if pages is None or pages.dtype != np.int64 or pages.shape != (len(node.key) // ps,):
                        raise IntegrityError(f"{node}: sliding group {g!r} has no page array of its pages")
                    out += pages[pages >= 0].tolist()
            if len(dev) != len(set(dev)) or len(host) != len(set(host)):
                raise IntegrityError(f"a page of sliding group {g!r} is held twice")
            if sorted(np.flatnonzero(self.sides.owned[g]).tolist()) != sorted(dev):
                raise IntegrityError(f"sliding group {g!r}: ownership map is stale")
            if dev and not self.sides.device[g].allocated_pages(np.array(dev, dtype=np.int64)).all():
                raise IntegrityError(f"sliding group {g!r}: a node holds a device page its pool counts as free")
            pool = self.sides.host[g]
            if pool.available_size() + len(host) * ps + self.sides.fetching[g] != pool.size:
                raise IntegrityError(f"sliding group {g!r}: host slots leaked")
