"""A toy engine over a hybrid HierarchicalCache: every group's KV is derived from the
prefix it follows, so that any reused prefix can be checked bit for bit, per group.

The KV of token ``i`` in group ``g``, layer ``l``, component ``c`` is a pattern seeded
by a hash of ``tokens[:i + 1]`` and ``(g, l, c)``: a page reused after another
prefix, or one group's page read as another's (gpt-oss's groups share a geometry),
shows up as wrong bytes.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from kvtier import HierarchicalCache, HybridDevicePool, HybridHostPool
from tests.support.pools import bits

NAMESPACE = "hybrid-test-model"
_MOD = 32749  # a prime below 2**15: every value fits the narrowest (2-byte) element


def prefix_hashes(tokens: list[int]) -> np.ndarray:
    """``out[i]``: a 31-bit hash of ``tokens[:i + 1]``."""
    out, h = np.empty(len(tokens), dtype=np.int64), hashlib.sha256()
    for i, t in enumerate(tokens):
        h.update(int(t).to_bytes(8, "little", signed=True))
        out[i] = int.from_bytes(h.copy().digest()[:4], "little") >> 1
    return out


def _values(hashes: np.ndarray, group: str, layer: int, comp: int, width: int) -> torch.Tensor:
    salt = (sum(map(ord, group)) * 131 + layer * 17 + comp * 7) % _MOD
    v = (hashes[:, None] % _MOD) * (salt + 3) + np.arange(width)[None, :] * (salt + 1)
    return torch.from_numpy(v % _MOD)


class HybridEngine:
    """Writes and checks KV through a hybrid cache's device pools."""

    def __init__(self, cache: HierarchicalCache) -> None:
        self.cache = cache
        self.pool: HybridDevicePool = cache.device_pool
        self.spec = self.pool.spec
        self.ps = cache.page_size
        self.full = [g.name for g in self.spec.groups if g.attention.is_full]
        self.sliding = {g.name: g.attention.window for g in self.spec.groups if not g.attention.is_full}

    def _rows(self, group: str, slots: torch.Tensor, hashes: np.ndarray):
        pool = self.pool[group]
        for ci, name in enumerate(pool.spec.names):
            for layer in range(pool.spec.layer_num):
                buf = bits(pool.buffer(name, layer))
                width = buf[0].numel()
                yield buf, _values(hashes, group, layer, ci, width).to(buf.dtype).view(-1, *buf.shape[1:])

    def write(self, group: str, slots: torch.Tensor, hashes: np.ndarray) -> None:
        keep = slots >= 0
        for buf, rows in self._rows(group, slots, hashes):
            buf[slots[keep]] = rows[torch.from_numpy(keep.numpy())]

    def check(self, group: str, slots: torch.Tensor, hashes: np.ndarray, what: str) -> None:
        assert (slots >= 0).all(), f"{what}: group {group} has holes where KV is needed"
        for buf, rows in self._rows(group, slots, hashes):
            assert torch.equal(buf[slots], rows), f"{what}: group {group} holds wrong KV"

    def window(self, group: str, prefix: int) -> range:
        """Token positions of the whole pages group ``group`` needs to resume after ``prefix``."""
        start = max(0, prefix - self.sliding[group]) // self.ps * self.ps
        return range(start, prefix)

    def check_prefix(self, tokens: list[int], device: torch.Tensor, groups: dict, what: str) -> None:
        """Every group holds the right KV of ``tokens[:len(device)]``: the full groups
        all of it, each sliding group its window."""
        n = device.numel()
        hashes = prefix_hashes(tokens[:n])
        for g in self.full:
            self.check(g, device, hashes, what)
        for g in self.sliding:
            assert groups is not None and groups[g].numel() == n, f"{what}: groups[{g}] does not cover the prefix"
            w = self.window(g, n)
            self.check(g, groups[g][w.start:w.stop], hashes[w.start:w.stop], what)

    def commit_whole(self, tokens: list[int], lose: range = range(0), resume_at=()) -> None:
        """Cache ``tokens`` (whole pages, nothing reused) as an engine that computed them
        all and lost the sliding pages of the token positions ``lose`` (whole pages)."""
        got = self.cache.acquire(tokens)
        assert got.device_indices.numel() == 0, "commit_whole caches a prompt the cache does not hold"
        n = len(tokens) // self.ps * self.ps
        new = self.cache.alloc_device(n)
        side = {g: self.cache.alloc_device(n, group=g) for g in self.sliding}
        hashes = prefix_hashes(tokens[:n])
        for g in self.full:
            self.write(g, new, hashes)
        for g, slots in side.items():
            self.write(g, slots, hashes)
            if lose:
                self.cache.free_device(slots[lose.start:lose.stop], group=g)
                slots[lose.start:lose.stop] = -1
        done = self.cache.commit(got, tokens, new, groups=side, resume_at=resume_at)
        self.cache.release(done.acquired)

    def serve(self, tokens: list[int], keep: str = "all", salt=None, resume_at=()) -> int:
        """One request: reuse, compute the rest, commit, check, release. ``keep``: which
        sliding pages the engine still has at commit (``all``, or ``tail``: only the
        window before the end, as an engine that frees out-of-window KV would);
        ``resume_at``: more resume points for the commit (those past the sequence's
        whole pages are left out). Returns the tokens reused."""
        got = self.cache.acquire(tokens, salt)
        reused = got.device_indices.numel()
        self.check_prefix(tokens, got.device_indices, got.groups, "acquire")
        full = len(tokens) // self.ps * self.ps
        new = self.cache.alloc_device(full - reused)
        side = {g: self.cache.alloc_device(full - reused, group=g) for g in self.sliding}
        if new is None or any(s is None for s in side.values()):
            for g, s in side.items():
                if s is not None:
                    self.cache.free_device(s, group=g)
            if new is not None:
                self.cache.free_device(new)
            self.cache.release(got)
            return reused
        hashes = prefix_hashes(tokens[:full])
        for g in self.full:
            self.write(g, new, hashes[reused:])
        for g, s in side.items():
            if keep == "tail":
                w = self.window(g, full)
                drop = torch.arange(reused, full) < w.start
                pages = s.view(-1, self.ps)[drop.view(-1, self.ps)[:, 0]].reshape(-1)
                if pages.numel():
                    self.cache.free_device(pages, group=g)
                s = s.clone()
                s[drop] = -1
                side[g] = s
            self.write(g, s, hashes[reused:])
        done = self.cache.commit(got, tokens, new, groups=side, resume_at=[p for p in resume_at if 0 < p <= full])
        self.check_prefix(tokens, done.acquired.device_indices, done.acquired.groups, "commit")
        self.cache.release(done.acquired)
        return reused


def make_cache(spec, page_size: int, device: int | dict, host: int | dict, storage=None, layout="layer_first",
               **kw) -> HierarchicalCache:
    if storage is not None:
        kw.setdefault("namespace", NAMESPACE)
    kw.setdefault("check", True)
    return HierarchicalCache(HybridDevicePool(spec, device, page_size),
                             HybridHostPool(spec, host, page_size, layout=layout), storage, **kw)
