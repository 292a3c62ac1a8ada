"""The scheduler side: vLLM's ``OffloadingManager`` over a :class:`~.tier.HostTier`."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Callable

import numpy as np
from vllm.v1.kv_offload.base import (LoadStoreSpec, LookupResult, Medium, OffloadingEvent, OffloadingManager,
                                     OffloadKey, PrepareStoreOutput, ReqContext, RequestOffloadingContext,
                                     ScheduleEndContext)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .metrics import TierMetrics
from .pages import Source
from .tier import HostTier, Lookup

#: Seconds a scheduler step may wait for storage look-ups in flight (see HostTier.yield_to_io).
IO_YIELD_S = 0.002

_RESULTS = {Lookup.HIT: LookupResult.HIT, Lookup.PENDING: LookupResult.HIT_PENDING,
            Lookup.RETRY: LookupResult.RETRY, Lookup.MISS: LookupResult.MISS}
_SOURCES = {Source.HOST: CacheHitSource.HOST, Source.STORAGE: CacheHitSource.DISK}


class KVTierLoadStoreSpec(LoadStoreSpec):
    """Host pages of kvtier's tier: ``blocks_per_key`` per offloaded block, in the order
    of its keys, and each key's group (its position among the KV cache groups: the
    pages are that group's). vLLM sends it to the workers with the job (it holds only
    page numbers)."""

    def __init__(self, pages, groups=None) -> None:
        self.pages = np.asarray(pages, dtype=np.int64)
        self.groups = np.asarray(groups, dtype=np.int64) if groups is not None else None

    def __repr__(self) -> str:
        groups = "" if self.groups is None else f", groups={self.groups.tolist()}"
        return f"KVTierLoadStoreSpec({self.pages.tolist()}{groups})"


class _RequestProbe:
    """The tier's probe of one request, kept in vLLM's per-request context."""

    def __init__(self, probe) -> None:
        self.probe = probe


class KVTierOffloadingManager(OffloadingManager):
    """Keyed by vLLM's ``OffloadKey`` (chained block hash + group): vLLM's hashes already
    match prefixes, so each key is looked up on its own, in its group (vLLM's scheduler
    asks full groups for a prefix and sliding groups for the window before the hit).

    ``tier`` is a callable returning the engine's :class:`HostTier` (one group) or
    :class:`~.groups.GroupedTier` (several), or None (then everything misses and
    nothing is stored)."""

    def __init__(self, tier: Callable[[], HostTier | None]) -> None:
        self._tier_fn = tier
        self._metrics = TierMetrics()
        self._probes: list = []  # probes with keys queued this scheduler step

    @property
    def tier(self) -> HostTier | None:
        return self._tier_fn()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        tier = self.tier
        if tier is None:
            return LookupResult.MISS
        if tier.storage is None:
            return _RESULTS[tier.lookup(bytes(key))]
        held = req_context.get_state(_RequestProbe)
        if held is None:
            held = _RequestProbe(tier.new_probe())
            req_context.set_state(held)
        probe = held.probe
        idle = not probe.queued
        result = tier.lookup(bytes(key), probe)
        if idle and probe.queued:  # its first key this step: send the batch at the step's end
            self._probes.append(probe)
        return _RESULTS[result]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        tier = self.tier
        return _SOURCES[tier.source(bytes(key))] if tier is not None else CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        tier = self.tier
        raw = [bytes(k) for k in keys]
        return KVTierLoadStoreSpec(tier.pin(raw), tier.positions(raw))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        tier = self.tier
        if tier is not None:
            tier.touch(bytes(k) for k in keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.tier.unpin(bytes(k) for k in keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        tier = self.tier
        if tier is None:
            return None
        by_bytes = {bytes(k): k for k in keys}
        got = tier.reserve(by_bytes)
        if got is None:
            return None
        return PrepareStoreOutput(keys_to_store=[by_bytes[k] for k in got.keys],
                                  store_spec=KVTierLoadStoreSpec(got.pages, tier.positions(got.keys)),
                                  evicted_keys=[OffloadKey(k) for k in got.evicted])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.tier.commit((bytes(k) for k in keys), success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send this step's storage look-ups (one batch per request) to the tier's
        threads, and give them up to ``IO_YIELD_S`` of this step to run."""
        probes, self._probes = self._probes, []
        tier = self.tier
        if tier is None:
            return
        for probe in probes:
            tier.send(probe)
        tier.tick()
        tier.yield_to_io(IO_YIELD_S)

    def has_pending_work(self) -> bool:
        tier = self.tier
        return bool(self._probes) or (tier is not None and tier.busy())

    def reset_cache(self) -> None:
        tier = self.tier
        if tier is not None:
            tier.reset()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Blocks stored into and removed from the host tier since the last call, in
        order (removals before the store that reuses their pages); none unless the
        tier was built with events on (vLLM's KV events)."""
        tier = self.tier
        if tier is None:
            return ()
        return [OffloadingEvent(keys=[OffloadKey(k) for k in keys], medium=Medium.CPU, removed=removed)
                for keys, removed in tier.take_events()]

    def get_stats(self):
        tier = self.tier
        return self._metrics.collect(tier) if tier is not None else None

    def shutdown(self) -> None:
        tier = self.tier
        if tier is not None:
            tier.close()
