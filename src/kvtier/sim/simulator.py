"""Replay a trace through the real ``HierarchicalCache`` decision logic, with no bytes moved.

The pools live on torch's ``meta`` device (shapes, no memory) and storage is a set of
keys (:class:`SimStorage`), so the radix tree, the LRU eviction and the write and
prefetch policies are kvtier's own code, not a model of it. One trace block is one
cache page (page_size 1 over block ids); capacities are converted from tokens.
"""

from __future__ import annotations

import heapq
from array import array
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch

from ..cache import HierarchicalCache
from ..errors import UsageError
from ..hybrid import Attention, HybridSpec, KVGroup
from ..pools import DeviceKVPool, HostKVPool, HybridDevicePool, HybridHostPool
from ..spec import KVSpec
from .store import SimStorage
from .traces import Request

_META_SPEC = KVSpec.k_only(1, 1, 1, dtype=torch.float16)  # what the meta pools hold: shapes only
# NOTE: the simulated storage only compares page keys for equality, so the faster
# 128-bit hash gives the same replay as the default sha256 (storage keys of a real
# deployment stay sha256).
_SIM_HASH = "xxh3"


@dataclass(frozen=True)
class CostModel:
    """Prefill is compute; reuse is a copy. Defaults: a ~8B model on one H100-class GPU."""

    prefill_tokens_per_s: float = 10_000.0
    host_gbps: float = 25.0      # host -> device (PCIe Gen5 x16, measured-class)
    storage_gbps: float = 5.0    # storage -> host (one NVMe / RDMA link)


@dataclass(frozen=True)
class SimConfig:
    """Capacities in tokens. A hybrid ``spec`` (sliding-window groups) replays the
    hybrid cache: each tier holds ``*_tokens`` tokens of the full groups and
    ``sliding_ratio`` times as many of each sliding group (its windows); with
    ``window_blind`` it replays a cache that stores every group for every token."""

    device_tokens: int
    host_tokens: int
    storage_tokens: float = 0          # 0: no storage; float("inf"): unlimited
    block_tokens: int = 512
    write_policy: str = "write_through"
    spec: KVSpec | HybridSpec = field(default_factory=lambda: KVSpec.mha(32, 8, 128))
    cost: CostModel = CostModel()
    sliding_ratio: float = 0.25
    window_blind: bool = False
    retention_interval: int | None = None  # tokens (whole blocks): a resume point every so many

    @property
    def hybrid(self) -> bool:
        """Whether the replay runs the hybrid cache (sliding groups kept per window)."""
        return isinstance(self.spec, HybridSpec) and not self.spec.is_uniform and not self.window_blind

    @property
    def bytes_per_token(self) -> int:
        """Bytes a copied token costs: the full groups' for the hybrid cache (its windows
        are priced per hit), every group's when window-blind."""
        if isinstance(self.spec, KVSpec):
            return self.spec.bytes_per_token
        return self.spec.full_bytes_per_token if self.hybrid else self.spec.uniform_bytes_per_token


@dataclass
class SimResult:
    requests: int = 0
    prompt_tokens: int = 0
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    bound: int = 0          # tokens an infinite cache would hit
    oracle: dict = field(default_factory=dict)  # capacity name -> Belady hit tokens
    prefill_s_without: float = 0.0
    prefill_s_with: float = 0.0

    @property
    def hit(self) -> int:
        return self.device_hit + self.host_hit + self.storage_hit

    def as_dict(self) -> dict:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens, "device_hit": self.device_hit,
                "host_hit": self.host_hit, "storage_hit": self.storage_hit, "hit": self.hit, "bound": self.bound,
                "fraction_of_bound": self.hit / self.bound if self.bound else 1.0, "oracle": self.oracle,
                "prefill_s_without": self.prefill_s_without, "prefill_s_with": self.prefill_s_with,
                "prefill_s_saved": self.prefill_s_without - self.prefill_s_with}


def _blocks(capacity_tokens: float, block_tokens: int) -> int:
    return int(capacity_tokens // block_tokens)


def simulate(requests: list[Request], config: SimConfig, progress=None) -> SimResult:
    bt = config.block_tokens
    device_blocks, host_blocks = _blocks(config.device_tokens, bt), _blocks(config.host_tokens, bt)
    if device_blocks <= 0 or host_blocks <= 0:
        raise UsageError(f"device and host need at least one {bt}-token block each, got "
                         f"{config.device_tokens} and {config.host_tokens} tokens")
    storage = None
    if config.storage_tokens:
        cap = None if config.storage_tokens == float("inf") else _blocks(config.storage_tokens, bt)
        if cap is not None and config.hybrid:  # an object per group and page: the full groups', then windows
            full, sliding = _group_counts(config.spec)
            cap = cap * full + int(cap * config.sliding_ratio) * sliding
        storage = SimStorage(cap)
    if config.hybrid:
        spec = _meta_hybrid(config.spec, bt)
        sizes = {"device": device_blocks, "host": host_blocks}
        device_pool, host_pool = (pool(spec, _group_sizes(spec, sizes[tier], config.sliding_ratio), 1, device="meta")
                                  for tier, pool in (("device", HybridDevicePool), ("host", HybridHostPool)))
    else:
        device_pool = DeviceKVPool(_META_SPEC, device_blocks, 1, device="meta")
        host_pool = HostKVPool(_META_SPEC, host_blocks, 1, device="meta")
    extra = {}
    if config.hybrid and config.retention_interval:
        extra["retention_interval"] = max(1, config.retention_interval // bt)
    cache = HierarchicalCache(device_pool, host_pool, storage, write_policy=config.write_policy,
                              prefetch_policy="wait_complete", namespace="sim", hash=_SIM_HASH, synchronous=True,
                              **extra)
    result, price = SimResult(), _Price.of(config)
    seen: set[int] = set()
    for req in requests:
        full = req.blocks[:req.input_length // bt]
        dev, host, st = _serve(cache, array("q", full))  # the cache's own token form: converted once, not per call
        result.requests += 1
        result.prompt_tokens += req.input_length
        result.device_hit += dev * bt
        result.host_hit += host * bt
        result.storage_hit += st * bt
        result.bound += next((i for i, b in enumerate(full) if b not in seen), len(full)) * bt
        seen.update(full)
        _cost(result, price, req.input_length, dev * bt, host * bt, st * bt)
        if progress is not None:
            progress()
    cache.close()
    return result


def _group_counts(spec: HybridSpec) -> tuple[int, int]:
    full = sum(1 for g in spec.groups if g.attention.is_full)
    return full, len(spec.groups) - full


def _meta_hybrid(spec: HybridSpec, block_tokens: int) -> HybridSpec:
    """``spec``'s groups in the replay's units: one layer of one meta slot each, a page
    per block, each window the blocks that cover its tokens before a block boundary."""
    groups = []
    for i, g in enumerate(spec.groups):
        attention = g.attention if g.attention.is_full else Attention.sliding(-(-g.attention.window // block_tokens))
        groups.append(KVGroup(g.name, (i,), KVSpec.k_only(1, 1, 1, dtype=torch.float16), attention))
    return HybridSpec(tuple(groups))


def _group_sizes(spec: HybridSpec, blocks: int, ratio: float) -> dict[str, int]:
    return {g.name: blocks if g.attention.is_full else max(1, int(blocks * ratio)) for g in spec.groups}


def _serve(cache: HierarchicalCache, blocks: array) -> tuple[int, int, int]:
    """One request as an engine runs it; returns blocks reused from device, host, storage.
    Hybrid: the engine hands over every sliding page it computed (the cache keeps the
    windows); a sliding group with no room left gets none (``-1``)."""
    got = held = cache.acquire(blocks)
    try:
        reused = got.device_indices.numel()
        new = cache.alloc_device(len(blocks) - reused) if len(blocks) > reused else None
        if new is not None and got.groups is not None:
            groups = {}
            for g in got.groups:
                side = cache.alloc_device(new.numel(), group=g)
                groups[g] = side if side is not None else torch.full_like(new, -1)
            held = cache.commit(got, blocks, new, groups=groups).acquired
        elif new is not None:
            held = cache.commit(got, blocks, new).acquired
    finally:
        # NOTE: Ctrl-C can land inside commit after it consumed ``got``: releasing it again
        # would raise ValueError in place of the KeyboardInterrupt the CLI reports
        if not held.lease.released:
            cache.release(held)
    return got.device_hit, got.host_hit, got.storage_hit


@dataclass(frozen=True)
class _Price:
    """What :func:`_cost` prices a request with, read from the config once per replay.
    NOTE: a hybrid spec's byte counts are sums over its groups, computed on each read:
    read per request they were 7 of the hybrid replay's ~230 us a request."""

    cost: CostModel
    bytes_per_token: int
    window_bytes: int  # the hybrid cache's windows, moved with every host or storage hit (0 otherwise)

    @classmethod
    def of(cls, config: SimConfig) -> "_Price":
        return cls(config.cost, config.bytes_per_token, config.spec.window_bytes if config.hybrid else 0)


def _cost(result: SimResult, price: _Price, prompt: int, dev: int, host: int, storage: int) -> None:
    c, bpt = price.cost, price.bytes_per_token
    result.prefill_s_without += prompt / c.prefill_tokens_per_s
    computed = prompt - dev - host - storage
    moved, stored = (host + storage) * bpt, storage * bpt
    if price.window_bytes and host + storage:  # the window the hit resumes with
        moved += price.window_bytes
        stored += price.window_bytes if storage else 0
    result.prefill_s_with += (computed / c.prefill_tokens_per_s + moved / (c.host_gbps * 1e9)
                              + stored / (c.storage_gbps * 1e9))


def belady_hits(requests: list[Request], capacity_tokens: float, block_tokens: int) -> int:
    """Prefix-hit tokens of a clairvoyant cache of ``capacity_tokens`` that evicts the block
    used furthest in the future (deeper blocks first on ties): an upper bound for
    online eviction at that capacity."""
    capacity = float("inf") if capacity_tokens == float("inf") else _blocks(capacity_tokens, block_tokens)
    prompts = [list(r.blocks[:r.input_length // block_tokens]) for r in requests]
    uses: dict[int, deque] = defaultdict(deque)
    for i, p in enumerate(prompts):
        for b in set(p):
            uses[b].append(i)
    cached: dict[int, int] = {}   # block -> position in the prompt it was last used in (tie-break)
    heap: list[tuple[float, int, int]] = []  # (-next use, -position, block), lazily invalidated
    hits = 0
    for i, p in enumerate(prompts):
        hits += next((j for j, b in enumerate(p) if b not in cached), len(p))
        for pos, b in enumerate(p):
            if uses[b] and uses[b][0] == i:
                uses[b].popleft()
            nxt = uses[b][0] if uses[b] else float("inf")
            cached[b] = pos
            heapq.heappush(heap, (-nxt, -pos, b))
        while len(cached) > capacity:
            neg_next, neg_pos, b = heapq.heappop(heap)
            nxt = uses[b][0] if uses[b] else float("inf")
            if b in cached and -neg_next == nxt and -neg_pos == cached[b]:
                del cached[b]
    return hits * block_tokens
