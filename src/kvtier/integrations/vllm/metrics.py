"""kvtier's host tier and storage in vLLM's own metrics (``/metrics``, the stats logger).

The manager reports what changed since its last report as vLLM offloading stats; vLLM
turns them into Prometheus series. The names are the ones vLLM's own CPU and tiering
specs use, so dashboards made for those read kvtier too:

- host tier: ``vllm:kv_offload_cpu_cache_usage_perc`` (and its ``_write`` / ``_read``
  parts: pages held by stores and by loads in flight);
- storage, labelled ``tier`` (``file``, ``redis``, ``mooncake``):
  ``vllm:kv_offload_tiering_read_bytes`` / ``_read_time`` / ``_write_bytes`` /
  ``_write_time``, ``_chunk_queries`` (blocks asked of storage), ``_chunk_hits``
  (blocks read from it), ``_promotion_job_failures`` (reads that failed),
  ``_cascade_job_failures`` (writes that failed), ``_backpressure_blocks_dropped``
  (writes dropped while the staging buffer was full);
- ``vllm:kv_offload_tiering_lookup_async_delay_seconds{tier}``: how long each storage
  look-up took, from the step that asked to storage's answer;
- ``vllm:kv_offload_kvtier_storage_errors`` by ``kind`` (storage calls that faulted,
  timed out or answered malformed) and ``vllm:kv_offload_kvtier_probe_timeouts``.

Device transfers (``vllm:kv_offload_load_bytes``, ``..._store_bytes`` and the older
``vllm:kv_offload_total_bytes{transfer_type}``) come from the worker's transfer
results, and hit tokens by source (host, disk) from the manager's ``get_load_source``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingHistogramMetadata,
                                     OffloadingMetricMetadata)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics as T

if TYPE_CHECKING:
    from .tier import HostTier

STORAGE_ERRORS = "vllm:kv_offload_kvtier_storage_errors"
DELAY_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10)  # vLLM's tiering spec's
PROBE_TIMEOUTS = "vllm:kv_offload_kvtier_probe_timeouts"

#: metric -> the tier stats field it reports, as its increase since the last report.
_STORAGE_COUNTERS = {
    T.READ_BYTES: "bytes_read", T.READ_TIME: "read_time", T.WRITE_BYTES: "bytes_written",
    T.WRITE_TIME: "write_time", T.CHUNK_QUERIES: "probed", T.CHUNK_HITS: "fetched",
    T.PROMOTION_JOB_FAILURES: "fetch_failed", T.CASCADE_JOB_FAILURES: "write_failed",
    T.BACKPRESSURE_BLOCKS_DROPPED: "write_dropped",
}
_GAUGES = {CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC: "used", CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC: "write",
           CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC: "read"}


def metric_definitions(storage: bool) -> dict[str, OffloadingMetricMetadata]:
    """What :class:`TierMetrics` reports (vLLM registers these at start)."""
    defs: dict[str, OffloadingMetricMetadata] = {
        CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
            "Fraction of kvtier's host-tier pages holding blocks (resident, being stored or loaded)."),
        CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
            "Fraction of kvtier's host-tier pages reserved by stores from the GPU still in flight."),
        CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC: OffloadingGaugeMetadata(
            "Fraction of kvtier's host-tier pages pinned by loads to the GPU in flight."),
    }
    if not storage:
        return defs
    tier = ("tier",)
    docs = {
        T.READ_BYTES: "Bytes kvtier read from storage into its host tier, by storage backend.",
        T.READ_TIME: "Seconds kvtier spent reading from storage, by storage backend.",
        T.WRITE_BYTES: "Bytes kvtier wrote from its host tier to storage, by storage backend.",
        T.WRITE_TIME: "Seconds kvtier spent writing to storage, by storage backend.",
        T.CHUNK_QUERIES: "Offloaded blocks kvtier looked up in storage, by storage backend.",
        T.CHUNK_HITS: "Offloaded blocks kvtier read from storage into its host tier, by storage backend.",
        T.PROMOTION_JOB_FAILURES: "Offloaded blocks found in storage whose read failed (a miss).",
        T.CASCADE_JOB_FAILURES: "Offloaded blocks whose write to storage failed (kept in the host tier only).",
        T.BACKPRESSURE_BLOCKS_DROPPED: "Offloaded blocks not written to storage because kvtier's staging buffer "
                                       "was full (storage slower than the stores arriving).",
    }
    defs.update({name: OffloadingCounterMetadata(doc, tier) for name, doc in docs.items()})
    defs[STORAGE_ERRORS] = OffloadingCounterMetadata(
        "kvtier storage calls that raised, timed out or answered malformed (each a miss), by kind.", ("tier", "kind"))
    defs[PROBE_TIMEOUTS] = OffloadingCounterMetadata(
        "Blocks whose storage look-up outlasted storage_timeout_s (a miss).", tier)
    defs[T.LOOKUP_ASYNC_DELAY] = OffloadingHistogramMetadata(
        "Seconds a request's storage look-up took, from the scheduler step that sent it to storage's answer.", tier,
        DELAY_BUCKETS)
    return defs


class TierMetrics:
    """Turns a tier's cumulative counters into vLLM stats of what changed since the last
    :meth:`collect`."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def _delta(self, stats: dict, name: str) -> float:
        now = stats.get(name, 0)
        change = now - self._last.get(name, 0)
        self._last[name] = now
        return change

    def collect(self, tier: "HostTier") -> OffloadingConnectorStats:
        stats = tier.snapshot()
        out = OffloadingConnectorStats()
        usage = tier.usage()
        for metric, part in _GAUGES.items():
            out.set_gauge(metric, usage[part])
        if tier.storage is None:
            return out
        label = (getattr(tier.storage, "scheme", "") or "storage",)
        for metric, name in _STORAGE_COUNTERS.items():
            change = self._delta(stats, name)
            if change:
                out.increase_counter(metric, change, label)
        for name in sorted(k for k in stats if k.endswith("_errors")):
            change = self._delta(stats, name)
            if change:
                out.increase_counter(STORAGE_ERRORS, change, (*label, name.removesuffix("_errors")))
        change = self._delta(stats, "probe_timeouts")
        if change:
            out.increase_counter(PROBE_TIMEOUTS, change, label)
        for delay in tier.take_delays():
            out.observe_histogram(T.LOOKUP_ASYNC_DELAY, delay, label)
        return out
