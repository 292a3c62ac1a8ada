"""Every geometry in every host layout: KV reused from the device, the host and
storage is bit-identical to what the engine wrote."""

import pytest
import torch

import kvtier.storage
from kvtier import DeviceKVPool, HierarchicalCache, HostKVPool
from tests.support.pools import LAYOUT_ORDERS, SPECS, bits, fill_random

PAGE = 4
PROMPT = list(range(500, 520))  # 5 pages


def kv(cache, slots):
    dev = cache.device_pool
    return {(n, l): bits(dev.buffer(n, l)[slots]).clone() for n in dev.spec.names for l in range(dev.spec.layer_num)}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def make(spec, layout, store):
    return HierarchicalCache(DeviceKVPool(spec, 64, PAGE), HostKVPool(spec, 64, PAGE, layout=layout), store,
                             namespace="geometry", prefetch_policy="wait_complete")


@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("name", list(SPECS))
def test_reuse_from_every_tier_is_exact(tmp_path, name, layout):
    spec, store = SPECS[name], kvtier.storage.open(f"file://{tmp_path}")
    cache = make(spec, layout, store)
    got = cache.acquire(PROMPT)
    slots = cache.alloc_device(20)
    gen = torch.Generator().manual_seed(3)
    for n in spec.names:
        for l in range(spec.layer_num):
            fill_random(cache.device_pool.buffer(n, l), gen)   # the "forward pass"
    want = kv(cache, slots)
    cache.release(cache.commit(got, PROMPT, slots).acquired)
    cache.flush()
    tiers = []
    for evict in (None, "device"):                            # device hit, then host hit
        if evict:
            cache.evict_device(64)
        again = cache.acquire(PROMPT)
        tiers.append((again.device_hit, again.host_hit))
        assert same(kv(cache, again.device_indices), want)
        cache.release(again)
    fresh = make(spec, layout, store)                         # storage hit, in a new process's cache
    hit = fresh.acquire(PROMPT)
    tiers.append(hit.storage_hit)
    assert same(kv(fresh, hit.device_indices), want)
    fresh.release(hit)
    assert tiers == [(20, 0), (0, 20), 20]
    for c in (cache, fresh):
        c.check_integrity(engine_device_slots=0)
        c.close()
