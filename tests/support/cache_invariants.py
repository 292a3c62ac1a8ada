"""What every cache test may ask of a cache at rest."""

from __future__ import annotations


def drained(cache) -> bool:
    """Everything unlocked can go: after evicting all, every slot is free again.

    Flushes between the tiers: a device page without a host copy is backed up
    before it goes, and the storage write that follows pins its host copy while it
    runs."""
    cache.flush()
    cache.evict_device(cache.device_pool.size)
    cache.flush()
    cache.evict_host(cache.host_pool.size)
    return (cache.device_pool.available_size(), cache.host_pool.available_size()) == \
        (cache.device_pool.size, cache.host_pool.size)
