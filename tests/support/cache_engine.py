"""A toy engine over HierarchicalCache: KV values derived from token ids and positions,
so that any cached prefix can be checked bit for bit."""

from __future__ import annotations

import torch

from kvtier import DeviceKVPool, HierarchicalCache, HostKVPool, KVSpec

SPEC = KVSpec.mha(2, 2, 6, v_head_dim=4, dtype=torch.float64)  # asymmetric K/V dims, exact values
PAGE = 4
NAMESPACE = "test-model"


def kv_value(spec: KVSpec, name: str, layer: int, tokens: list[int], start: int) -> torch.Tensor:
    """``(n, head, dim)`` KV of ``tokens`` at positions ``start..``: unique per
    (component, layer, token, position, head, dim)."""
    c = spec.component(name)
    pos = torch.arange(start, start + len(tokens), dtype=torch.float64)
    tok = torch.tensor(tokens, dtype=torch.float64)
    base = (((spec.names.index(name) * 8 + layer) * 1000 + tok) * 1000 + pos)[:, None, None]
    return base * 1000 + torch.arange(c.head_num * c.head_dim, dtype=torch.float64).view(1, c.head_num, c.head_dim)


def make_cache(device_tokens=64, host_tokens=64, storage=None, **kw) -> HierarchicalCache:
    if storage is not None:
        kw.setdefault("namespace", NAMESPACE)
    return HierarchicalCache(DeviceKVPool(SPEC, device_tokens, PAGE), HostKVPool(SPEC, host_tokens, PAGE),
                             storage, **kw)


def compute(cache: HierarchicalCache, tokens: list[int], slots: torch.Tensor, start: int) -> None:
    """The 'forward pass': write KV of ``tokens[start:]`` into ``slots[start:]``."""
    dev = cache.device_pool
    for name in dev.spec.names:
        for layer in range(dev.spec.layer_num):
            dev.buffer(name, layer)[slots[start:]] = kv_value(dev.spec, name, layer, tokens[start:], start)


def check_prefix(cache: HierarchicalCache, tokens: list[int], slots: torch.Tensor) -> None:
    dev = cache.device_pool
    n = slots.numel()
    for name in dev.spec.names:
        for layer in range(dev.spec.layer_num):
            got = dev.buffer(name, layer)[slots]
            want = kv_value(dev.spec, name, layer, tokens[:n], 0)
            assert torch.equal(got, want), f"{name} layer {layer}: cached KV differs from what was inserted"


def serve(cache: HierarchicalCache, tokens: list[int], salt=None, check=True) -> dict:
    """One request: match, lock, load back, check the reused KV, compute the rest, insert."""
    match = cache.match_prefix(tokens, salt)
    lease = cache.lock(match)
    try:
        handle = cache.load_back(match)
        handle.wait()
        if handle.error is not None:  # the load failed: its pages are host-only again
            return {"match": match, "reused": 0, "inserted": False}
        prefix = handle.device_indices
        full = len(tokens) - len(tokens) % PAGE
        if check:
            check_prefix(cache, tokens, prefix)
        new = cache.alloc_device(full - prefix.numel()) if full > prefix.numel() else prefix[:0]
        if new is None:
            return {"match": match, "reused": prefix.numel(), "inserted": False}
        slots = torch.cat([prefix, new])
        compute(cache, tokens[:full], slots, prefix.numel())
        already = cache.insert(tokens, slots, salt)
        if already > prefix.numel():  # another request cached these pages meanwhile: ours are duplicates
            cache.free_device(slots[prefix.numel():already])
        return {"match": match, "reused": prefix.numel(), "inserted": True}
    finally:
        cache.unlock(lease)


def serve_acquire(cache: HierarchicalCache, tokens: list[int], salt=None) -> dict:
    """One request through acquire/commit: check the reused KV, compute the rest."""
    got = held = cache.acquire(tokens, salt)
    try:
        m = got.match  # one match's fields, however the tree changed meanwhile
        assert m.device_indices.numel() == m.device_len and m.device_len + m.host_len <= len(tokens), m
        prefix = got.device_indices
        check_prefix(cache, tokens, prefix)
        full = len(tokens) - len(tokens) % PAGE
        new = cache.alloc_device(full - prefix.numel()) if full > prefix.numel() else None
        if new is None:
            return {"acquired": got, "reused": prefix.numel(), "inserted": full == prefix.numel()}
        compute(cache, tokens[:full], torch.cat([prefix, new]), prefix.numel())
        held = cache.commit(got, tokens, new).acquired
        held.load.wait()
        if held.load.error is None:  # else: pages another request cached first failed to load
            check_prefix(cache, tokens, held.device_indices)
        return {"acquired": got, "reused": prefix.numel(), "inserted": True}
    finally:
        cache.release(held)
