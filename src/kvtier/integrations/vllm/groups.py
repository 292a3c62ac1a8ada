"""Every KV cache group of a hybrid model: one :class:`~.tier.HostTier` per group, behind one face.

vLLM splits a hybrid model's layers into KV cache groups (Gemma 3: 5 sliding groups
and 1 full one; gpt-oss: 1 of each; MiMo-V2-Flash on GPU: 1 full group with twice
the block size and 5 sliding ones). Each group has its own block geometry (heads,
tokens per block), so each gets its own host pools, page table, storage prefix and
LRU. Its keys are vLLM's ``OffloadKey``: the block hash with the group's index in
the last 4 bytes. vLLM's scheduler already decides which blocks of a sliding group
to look up, load and store (only the window before each point a request may resume
from); the tiers answer per key, so a block that one group lacks is a miss there,
and the scheduler's hit stops before it.

:class:`GroupedTier` offers the :class:`~.tier.HostTier` calls the manager and the
metrics make, each key going to its group's tier, and sums the counters.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ...errors import UsageError
from .pages import Reservation, Source
from .tier import HostTier, Lookup, Probe


def group_id(key: bytes) -> int:
    """The KV cache group index vLLM packs into the last 4 bytes of an ``OffloadKey``."""
    return int.from_bytes(key[-4:], "big")


@dataclass
class GroupedProbe:
    """One request's storage look-ups: a :class:`~.tier.Probe` per group."""

    probes: dict[int, Probe] = field(default_factory=dict)

    @property
    def queued(self) -> bool:
        return any(p.queued for p in self.probes.values())


class GroupedTier:
    """The host tiers of every group, keyed as vLLM keys them.

    ``tiers[i]`` serves the group whose vLLM index is ``group_ids[i]`` (vLLM's
    ``OffloadingGroupConfig.group_id``); position ``i`` is what the worker's jobs
    name (``group_sizes`` follow the same order). ``storage`` is the one client the
    tiers share, closed once by :meth:`close`."""

    def __init__(self, tiers: Sequence[HostTier], group_ids: Sequence[int], storage=None) -> None:
        if len(tiers) != len(group_ids) or len(set(group_ids)) != len(group_ids) or not tiers:
            raise UsageError(f"kvtier: {len(tiers)} tiers for group ids {list(group_ids)}")
        self.tiers = list(tiers)
        self.group_ids = list(group_ids)
        self._at = {g: i for i, g in enumerate(group_ids)}
        self.storage = storage
        self.blocks_per_key = self.tiers[0].blocks_per_key

    def position(self, key: bytes) -> int:
        """Which of :attr:`tiers` serves ``key``; ``ValueError`` for a group vLLM never gave."""
        g = group_id(key)
        at = self._at.get(g)
        if at is None:
            raise UsageError(f"kvtier: a key of KV cache group {g}; this engine's groups are {self.group_ids}")
        return at

    def _tier(self, key: bytes) -> HostTier:
        return self.tiers[self.position(key)]

    def _split(self, keys: Iterable[bytes]) -> dict[int, list[bytes]]:
        out: dict[int, list[bytes]] = {}
        for k in keys:
            out.setdefault(self.position(k), []).append(k)
        return out

    # -- what is where ----------------------------------------------------------------------------
    def new_probe(self) -> GroupedProbe:
        return GroupedProbe()

    def lookup(self, key: bytes, probe: GroupedProbe | None = None) -> Lookup:
        at = self.position(key)
        if probe is None:
            return self.tiers[at].lookup(key)
        return self.tiers[at].lookup(key, probe.probes.setdefault(at, Probe()))

    def source(self, key: bytes) -> Source:
        return self._tier(key).source(key)

    def positions(self, keys: Sequence[bytes]) -> np.ndarray:
        return np.fromiter((self.position(k) for k in keys), dtype=np.int64, count=len(keys))

    # -- the manager's calls -----------------------------------------------------------------------
    def reserve(self, keys: Iterable[bytes]) -> Reservation | None:
        """Each group reserves its own keys; a group whose pages are all pinned stores
        nothing this time (its blocks are then misses, never wrong), the others do.
        ``None`` only when no group could take any."""
        keys = list(dict.fromkeys(keys))
        got = {at: self.tiers[at].reserve(ks) for at, ks in self._split(keys).items()}
        if all(r is None for r in got.values()):
            return None
        pages = {k: r.pages[i * self.blocks_per_key:(i + 1) * self.blocks_per_key]
                 for r in got.values() if r is not None for i, k in enumerate(r.keys)}
        new = [k for k in keys if k in pages]
        evicted = [k for r in got.values() if r is not None for k in r.evicted]
        flat = np.concatenate([pages[k] for k in new]) if new else np.empty(0, dtype=np.int64)
        return Reservation(new, flat, evicted)

    def commit(self, keys: Iterable[bytes], success: bool = True) -> None:
        for at, ks in self._split(keys).items():
            self.tiers[at].commit(ks, success)

    def pin(self, keys: Sequence[bytes]) -> np.ndarray:
        """Host pages of READY ``keys`` in key order, each in its group's pools."""
        split = self._split(keys)
        pinned = {}
        try:
            for at, ks in split.items():
                pinned[at] = self.tiers[at].pin(ks).reshape(len(ks), self.blocks_per_key)
        except BaseException:  # a group refused: the groups pinned before it are unpinned, as if none were
            for at in pinned:
                self.tiers[at].unpin(split[at])
            raise
        rows, seen = [], Counter()
        for k in keys:
            at = self.position(k)
            rows.append(pinned[at][seen[at]])
            seen[at] += 1
        return np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)

    def unpin(self, keys: Iterable[bytes]) -> None:
        for at, ks in self._split(keys).items():
            self.tiers[at].unpin(ks)

    def touch(self, keys: Iterable[bytes]) -> None:
        for at, ks in self._split(keys).items():
            self.tiers[at].touch(ks)

    def reset(self) -> list[bytes]:
        return [k for t in self.tiers for k in t.reset()]

    def tick(self) -> None:
        for t in self.tiers:
            t.tick()

    def take_events(self) -> list[tuple[list[bytes], bool]]:
        return [e for t in self.tiers for e in t.take_events()]

    # -- storage -------------------------------------------------------------------------------------
    def send(self, probe: GroupedProbe) -> None:
        for at, p in probe.probes.items():
            self.tiers[at].send(p)

    def yield_to_io(self, budget_s: float) -> None:
        for t in self.tiers:  # the first busy tier takes the wait; the rest are then done or still busy
            if t.busy():
                t.yield_to_io(budget_s)
                return

    def busy(self) -> bool:
        return any(t.busy() for t in self.tiers)

    def flush(self, timeout: float | None = None) -> bool:
        return all([t.flush(timeout) for t in self.tiers])

    # -- counters --------------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """The groups' counters summed (a copy)."""
        return self.snapshot()

    def snapshot(self) -> dict:
        total: dict = {}
        for t in self.tiers:
            for name, v in t.snapshot().items():
                total[name] = total.get(name, 0) + v
        return total

    def usage(self) -> dict[str, float]:
        """Fractions of all groups' host pages in use (weighted by each group's pages)."""
        pages = [t.num_pages * t.pool.page_bytes * len(t.pools) for t in self.tiers]
        parts = [t.usage() for t in self.tiers]
        return {name: sum(p[name] * w for p, w in zip(parts, pages)) / sum(pages) for name in parts[0]}

    def take_delays(self) -> list[float]:
        return [d for t in self.tiers for d in t.take_delays()]

    def free_keys(self) -> int:
        return min(t.free_keys() for t in self.tiers)

    def close(self) -> None:
        for t in self.tiers:
            t.close()
        if self.storage is not None:
            self.storage.close()


__all__ = ["GroupedProbe", "GroupedTier", "group_id"]
