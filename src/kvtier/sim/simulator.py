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
from ..pools import DeviceKVPool, HostKVPool
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
    device_tokens: int
    host_tokens: int
    storage_tokens: float = 0          # 0: no storage; float("inf"): unlimited
    block_tokens: int = 512
    write_policy: str = "write_through"
    spec: KVSpec = field(default_factory=lambda: KVSpec.mha(32, 8, 128))
    cost: CostModel = CostModel()


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
        raise ValueError(f"device and host need at least one {bt}-token block each, got "
                         f"{config.device_tokens} and {config.host_tokens} tokens")
    storage = None
    if config.storage_tokens:
        cap = None if config.storage_tokens == float("inf") else _blocks(config.storage_tokens, bt)
        storage = SimStorage(cap)
    cache = HierarchicalCache(DeviceKVPool(_META_SPEC, device_blocks, 1, device="meta"),
                              HostKVPool(_META_SPEC, host_blocks, 1, device="meta"), storage,
                              write_policy=config.write_policy, prefetch_policy="wait_complete", namespace="sim",
                              hash=_SIM_HASH, synchronous=True)
    result = SimResult()
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
        _cost(result, config, req.input_length, dev * bt, host * bt, st * bt)
        if progress is not None:
            progress()
    cache.close()
    return result


def _serve(cache: HierarchicalCache, blocks: array) -> tuple[int, int, int]:
    """One request as an engine runs it; returns blocks reused from device, host, storage."""
    got = held = cache.acquire(blocks)
    try:
        reused = got.device_indices.numel()
        new = cache.alloc_device(len(blocks) - reused) if len(blocks) > reused else None
        if new is not None:
            held = cache.commit(got, blocks, new).acquired
    finally:
        # NOTE: Ctrl-C can land inside commit after it consumed ``got``: releasing it again
        # would raise ValueError in place of the KeyboardInterrupt the CLI reports
        if not held.lease.released:
            cache.release(held)
    return got.device_hit, got.host_hit, got.storage_hit


def _cost(result: SimResult, config: SimConfig, prompt: int, dev: int, host: int, storage: int) -> None:
    c, bpt = config.cost, config.spec.bytes_per_token
    result.prefill_s_without += prompt / c.prefill_tokens_per_s
    computed = prompt - dev - host - storage
    result.prefill_s_with += (computed / c.prefill_tokens_per_s + (host + storage) * bpt / (c.host_gbps * 1e9)
                              + storage * bpt / (c.storage_gbps * 1e9))


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
