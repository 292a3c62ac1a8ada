"""One L3 store for a hybrid model: objects per (layer group, page).

A hybrid model's page key (``page_keys``: the chained hash of its tokens) stands for
a page of every group, but groups are stored apart: a sliding-window group keeps
only the pages some window needs, and groups of one geometry (gpt-oss's full and
sliding layers) must never read each other's bytes. So each group writes under its
own key, the page key with the group's name and a digest of its fingerprint
(attention, layer ids, geometry) appended; a plain ``KVSpec`` is one group whose
keys are the page keys themselves, so uniform models keep the objects they have.

A lookup (:meth:`GroupedStorage.reusable`) answers with the hybrid reuse rule (docs/hybrid.md): a prefix
counts only when every full group holds all its pages and every sliding group the
pages of its window; one group's missing page is never a hit for the others.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import torch

from .._checks import is_int, positive_int
from ..errors import UsageError
from ..hybrid import HybridSpec
from ..pools.hybrid import HybridHostPool, as_hybrid
from ..pools.indices import page_starts
from ..spec import KVSpec
from .base import _check_keys


def group_tag(spec: HybridSpec, name: str) -> str:
    """``"~<group name>.<16 hex digits of its fingerprint>"``; empty for a uniform spec."""
    if spec.is_uniform:
        return ""
    group = spec.group(name)
    return f"~{group.name}.{hashlib.sha256(group.fingerprint().encode()).hexdigest()[:16]}"


class GroupedStorage:
    """A store (any :class:`~kvtier.storage.base.Storage`) seen as per-group objects.

    Every call takes the page keys of one sequence (``keys[i]`` for page ``i``) and,
    per group, which of those pages it concerns (``pages[name]``, indices into
    ``keys``; default: all of them) and the host slots of those pages
    (``host_indices[name]``, ``len(pages[name]) * page_size`` slots). Answers come per
    group as lists of ``bool`` in ``pages[name]`` order; a storage fault is ``False``.
    """

    def __init__(self, storage, spec: KVSpec | HybridSpec, page_size: int) -> None:
        positive_int("page_size", page_size)
        self.storage, self.page_size = storage, page_size
        self.spec = as_hybrid(spec).full
        self._tags = {name: group_tag(self.spec, name) for name in self.spec.names}
        self._full = [g for g in self.spec.groups if g.attention.is_full]
        self._sliding = [g for g in self.spec.groups if not g.attention.is_full]

    def keys(self, name: str, keys: Sequence[str]) -> list[str]:
        """Group ``name``'s object keys for the page keys ``keys``."""
        tag = self._tags.get(name)
        if tag is None:
            raise UsageError(f"unknown group {name!r}; this spec has {list(self.spec.names)}")
        return list(keys) if not tag else [k + tag for k in keys]

    def _pages(self, keys: list[str], pages: Mapping[str, Sequence[int]] | None) -> dict[str, Sequence[int]]:
        """Per group, its page numbers in ``pages`` (a list, or a ``range`` of them as is), checked."""
        if pages is None:
            return {name: list(range(len(keys))) for name in self.spec.names}
        if not isinstance(pages, dict) and not isinstance(pages, Mapping):  # (a dict is asked first: cheaper)
            raise UsageError(f"pages must map group names to page numbers, got {type(pages).__name__}")
        out, n = {}, len(keys)
        for name, picked in pages.items():
            if name not in self._tags:
                self.keys(name, [])  # raises: the name is no group's
            if type(picked) is range and picked.step == 1 and 0 <= picked.start and picked.stop <= n:
                out[name] = picked  # a run of pages (every page of a full group): nothing to look at
                continue
            picked = list(picked)
            # NOTE: plain ints in range (what the cache passes) are told by C-level passes over
            # the list; anything else is looked at one by one, to name it
            if picked and not (set(map(type, picked)) == {int} and min(picked) >= 0 and max(picked) < n):
                bad = [i for i in picked if not is_int(i) or not 0 <= i < n]
                if bad:
                    raise UsageError(f"pages[{name!r}] holds {bad[:4]}, not page numbers in [0, {n})")
            out[name] = picked
        return out

    def _group_keys(self, keys: list[str], pages) -> dict[str, list[str]]:
        """Per group, the object keys of its pages of ``keys`` (checked already): :meth:`keys`
        of them, tagged as they are picked."""
        out = {}
        for name, picked in self._pages(keys, pages).items():
            tag = self._tags[name]
            if type(picked) is range:
                part = keys[picked.start:picked.stop]
                out[name] = [k + tag for k in part] if tag else part
            else:
                out[name] = [keys[i] + tag for i in picked] if tag else [keys[i] for i in picked]
        return out

    def present(self, keys: Sequence[str], pages: Mapping[str, Sequence[int]] | None = None) -> dict[str, list[bool]]:
        """Per group, whether storage holds each of its pages; a fault, or an answer
        of the wrong shape, is all ``False`` for that group (never an exception)."""
        return self._present(_check_keys(keys), pages)

    def _present(self, keys: list[str], pages) -> dict[str, list[bool]]:
        return {name: self._each(group_keys) for name, group_keys in self._group_keys(keys, pages).items()}

    def _each(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        each = getattr(self.storage, "exists_each", None)
        try:
            if each is None:  # a backend without per-key answers: one leading-run question per key
                return [self.storage.batch_exists([k]) == 1 for k in keys]
            got = each(keys)
        except Exception:  # the backend counts and logs its own faults
            return [False] * len(keys)
        if not isinstance(got, (list, tuple)) or len(got) != len(keys):
            return [False] * len(keys)
        return [x is True for x in got]

    def reusable(self, keys: Sequence[str], held: Mapping[str, Sequence[bool]] | None = None) -> int:
        """How many leading pages of ``keys`` a request can resume after, with what
        storage holds and, per group, what the caller holds elsewhere
        (``held[name][i]``: page ``i`` is on the device or the host)."""
        keys = _check_keys(keys)
        held = held or {}
        if not held.keys() <= self._tags.keys():
            unknown = sorted(set(held) - set(self._tags))
            raise UsageError(f"held names groups {unknown}; this spec has {list(self.spec.names)}")
        have = {}
        for name in self._tags:
            mine = [x is True for x in held.get(name, ())][:len(keys)]
            have[name] = mine + [False] * (len(keys) - len(mine))
        # NOTE: a full group is a leading run, so a batch_exists from its first gap answers
        # it (one, when what the caller holds is a leading run: the cache's case; pages it
        # holds after a stored run carry it on); sliding groups are then asked only about
        # pages below that run.
        limit = len(keys)
        for g in self._full:
            mine, at = have[g.name], 0
            while True:
                try:
                    at = mine.index(False, at, limit)
                except ValueError:  # none missing from ``at`` on
                    break
                at += self._leading(self.keys(g.name, keys[at:limit]))
                if at == limit or not mine[at]:
                    limit = at
                    break
        # NOTE: first only the windows before ``limit``: when storage holds them (a request
        # resuming where an earlier one ended) that is the answer, and the other pages of
        # the sliding groups (mostly never stored: outside every window) go unasked
        sliding = self._sliding
        first = {g.name: [i for i in g.attention.needed_pages(limit * self.page_size, self.page_size)
                          if not have[g.name][i]] for g in sliding}
        asked = self._present(keys, first) if any(first.values()) else {}
        if all(all(got) for got in asked.values()):
            return limit  # every full group holds [0, limit) and every window before it is held
        for name, got in asked.items():
            for i, ok in zip(first[name], got):
                have[name][i] = ok
        ask = {}
        for g in sliding:
            done = set(first[g.name])
            ask[g.name] = [i for i in range(limit) if not have[g.name][i] and i not in done]
        for name, got in self._present(keys, ask).items():
            for i, ok in zip(ask[name], got):
                have[name][i] = ok
        for g in self._full:
            have[g.name][:limit] = [True] * limit
        return self.spec.reusable_pages(self.page_size, {name: v[:limit] for name, v in have.items()})

    def _leading(self, keys: list[str]) -> int:
        """``batch_exists``, with an answer of the wrong kind read as none."""
        try:
            n = self.storage.batch_exists(keys)
        except Exception:  # the backend counts and logs its own faults
            return 0
        return n if is_int(n) and 0 <= n <= len(keys) else 0

    def batch_set(self, keys: Sequence[str], host_pool: HybridHostPool, host_indices: Mapping[str, torch.Tensor],
                  pages: Mapping[str, Sequence[int]] | None = None) -> dict[str, list[bool]]:
        """Store each group's pages from its host pool."""
        return self._move("batch_set", keys, host_pool, host_indices, pages)

    def batch_get(self, keys: Sequence[str], host_pool: HybridHostPool, host_indices: Mapping[str, torch.Tensor],
                  pages: Mapping[str, Sequence[int]] | None = None) -> dict[str, list[bool]]:
        """Fill each group's host pages; ``False`` = miss."""
        return self._move("batch_get", keys, host_pool, host_indices, pages)

    def _move(self, op, keys, host_pool, host_indices, pages) -> dict[str, list[bool]]:
        if not isinstance(host_pool, HybridHostPool) or host_pool.page_size != self.page_size \
                or (host_pool.spec is not self.spec and host_pool.spec.full != self.spec):
            raise UsageError(f"host_pool must be a HybridHostPool of spec {self.spec.fingerprint()} with page_size "
                             f"{self.page_size}")
        group_keys = self._group_keys(_check_keys(keys), pages)
        if not isinstance(host_indices, (dict, Mapping)) or set(host_indices) != set(group_keys):
            got = sorted(host_indices) if isinstance(host_indices, Mapping) else type(host_indices).__name__
            raise UsageError(f"host_indices must name the groups {sorted(group_keys)}, got {got}")
        for i, (name, gk) in enumerate(group_keys.items()):  # every group's numbers before any group's bytes move
            idx = host_indices[name]
            if not isinstance(idx, torch.Tensor) or idx.numel() != len(gk) * host_pool.page_size:
                n = idx.numel() if isinstance(idx, torch.Tensor) else idx
                raise UsageError(f"host_indices[{name!r}] must hold {len(gk)} pages of {host_pool.page_size} slots, "
                                 f"got {n}")
            # the slots' values, as each backend's own call checks them (the first group's call: first);
            # not for meta pools (the simulator's), where no byte moves
            if i and host_pool.device.type != "meta":
                pool = host_pool[name]
                page_starts(idx, page_size=pool.page_size, size=pool.size, what=f"group {name!r}: host_indices",
                            unique=op == "batch_get")
        return {name: list(getattr(self.storage, op)(gk, host_pool[name], host_indices[name]))
                for name, gk in group_keys.items()}
