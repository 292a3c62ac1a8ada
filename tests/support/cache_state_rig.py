"""A :class:`~kvtier.cache.state.CacheState` built as ``HierarchicalCache`` builds it,
with no ``Mover``: the test runs each scheduled transfer itself, the way
``kvtier.cache.mover`` does (copy outside the lock, settle under it).

Tiny real pools of ``engine.SPEC`` in ``engine.PAGE``-token pages, no storage. The
default write policy is ``write_through_selective``: ``insert`` then starts no
backups, and a device page without a host copy is simply dropped when evicted, so
each test chooses which backups exist.
"""

from __future__ import annotations

import torch

from kvtier import DeviceKVPool, HostKVPool
from kvtier.cache.inflight import InFlight
from kvtier.cache.radix import Node
from kvtier.cache.state import CacheState
from kvtier.cache.stats import CacheStats
from kvtier.cache.tokens import token_array
from kvtier.pools.indices import page_numbers
from tests.support.cache_engine import PAGE, SPEC


def run(first: int, pages: int) -> list[int]:
    """``pages`` pages of distinct token ids starting at ``first``."""
    return list(range(first, first + pages * PAGE))


class StateRig:
    def __init__(self, device_tokens: int = 24, host_tokens: int = 24,
                 write_policy: str = "write_through_selective") -> None:
        self.device = DeviceKVPool(SPEC, device_tokens, PAGE)
        self.host = HostKVPool(SPEC, host_tokens, PAGE)
        self.stats = CacheStats(SPEC.bytes_per_token)
        self.state = CacheState(self.device, self.host, self.device, write_policy=write_policy, stats=self.stats,
                                namespace=None, hash="sha256", has_storage=False)
        self.scheduled: list[InFlight] = []
        self.state.schedule = self.scheduled.append  # the Mover's hook: we run the jobs ourselves

    # -- the engine's side -------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        with self.state.lock:
            return self.state.alloc("device", n)

    def insert(self, tokens: list[int], slots: torch.Tensor, salt: bytes = b"") -> tuple[int, int]:
        """``(tokens already on the device, new tokens)``, as ``HierarchicalCache.insert``
        checks and inserts (``check_insert`` then ``insert`` under one lock)."""
        ids = token_array(tokens)
        pages = page_numbers(slots, page_size=PAGE, size=self.device.size, what="slots", unique=True)
        with self.state.lock:
            walked = self.state.check_insert(ids, pages, salt)
            return self.state.insert(ids, pages, salt, walked)

    def cache(self, tokens: list[int], salt: bytes = b"") -> torch.Tensor:
        """Allocate slots for ``tokens`` (whole pages, none cached yet) and insert them."""
        slots = self.alloc(len(tokens))
        assert slots is not None, f"no room for {len(tokens)} tokens"
        got = self.insert(tokens, slots, salt)
        assert got == (0, len(tokens)), got
        return slots

    def match(self, tokens: list[int], salt: bytes = b"") -> tuple[list[Node], int, int]:
        with self.state.lock:
            return self.state.match(token_array(tokens), salt)

    def node(self, tokens: list[int], salt: bytes = b"") -> Node:
        """The node whose key ends the prefix ``tokens`` exactly (no LRU stamp, no split)."""
        path, matched, inner = self.state.tree.walk(token_array(tokens), salt)
        assert matched == len(tokens) and inner == len(path[-1].key), f"no node ends at {len(tokens)} tokens"
        return path[-1]

    def keys(self) -> list[list[int]]:
        """Every node's key, sorted: the tree's shape as data."""
        return sorted(n.key.tolist() for n in self.state.tree.nodes())

    def device_slots(self, node: Node) -> list[int]:
        return self.state.slots_of(node.device.pages).tolist()

    # -- the mover's side ------------------------------------------------------------------------------
    def run_backup(self, mark: InFlight, ok: bool = True) -> None:
        """What ``Mover._backup`` does: copy device -> host, then settle under the lock."""
        if ok and not mark.cancelled:
            self.host.backup_from_device_all_layer(self.device, mark.host, mark.device)
        with self.state.lock:
            self.state.finish_backup(mark, ok)

    def run_load(self, mark: InFlight) -> None:
        """What ``Mover._load`` does: copy host -> device layer by layer, then settle."""
        for layer in range(SPEC.layer_num):
            self.host.load_to_device_per_layer(self.device, mark.host, mark.device, layer)
            mark.handle._layer_done(layer)
        with self.state.lock:
            self.state.finish_load(mark)
        mark.handle._finish(None)

    def take(self, kind: str) -> list[InFlight]:
        """The scheduled marks of ``kind``, removed from :attr:`scheduled`."""
        got = [m for m in self.scheduled if m.kind == kind]
        self.scheduled[:] = [m for m in self.scheduled if m.kind != kind]  # in place: the state appends to it
        return got

    # -- checks ----------------------------------------------------------------------------------------
    def check(self, engine_device_slots: int = 0) -> None:
        with self.state.lock:
            self.state.check_integrity(engine_device_slots)

    def free_pages(self) -> int:
        return self.device.available_size() // PAGE


def fill(pool: DeviceKVPool, slots: torch.Tensor, seed: int) -> dict:
    """Write distinct values into ``slots`` of every component and layer; returns them,
    keyed ``(name, layer)``, for a bit-exact comparison later."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in SPEC.names:
        for layer in range(SPEC.layer_num):
            buf = pool.buffer(name, layer)
            vals = torch.rand((slots.numel(), *buf.shape[1:]), generator=gen, dtype=buf.dtype)
            buf[slots] = vals
            out[name, layer] = vals
    return out


def read(pool: DeviceKVPool, slots: torch.Tensor) -> dict:
    return {(name, layer): pool.buffer(name, layer)[slots].clone()
            for name in SPEC.names for layer in range(SPEC.layer_num)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

