"""kvtier storage as sglang HiCache's L3 backend (``--hicache-storage-backend dynamic``).

sglang's controller builds the backend with ``cls(storage_config, kwargs)``, then hands
it the host pool with ``register_mem_pool_host``. With ``"interface_v1": 1`` it moves
pages with ``batch_set_v1`` (backup), ``batch_exists`` (hit query) and ``batch_get_v1``
(prefetch), in batches of up to 128 pages of host token slots. kvtier reads and writes
the pool's own tensors in place (:mod:`.pools`) and stores each page as canonical,
checksummed objects under ``<namespace>/<sglang page hash>``: the same object for every
host layout, and per head group, so any tensor-parallel size reads what another wrote.
A storage fault is a miss and a counted error, never an exception on sglang's threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.observability.metrics_collector import StorageMetrics

from ... import storage as kvstorage
from ...errors import UnsupportedLayoutError
from ...pools import HostKVPool
from ...storage.keys import namespace_tag
from ..identity import engine_namespace
from .pools import Topology, UnsupportedPoolError, family_of, wrap_flat_page, wrap_pool
from .settings import Settings

log = logging.getLogger("kvtier.integrations.sglang")


class _Throughput:
    """Pages and GB/s per batch since the last ``drain``: sglang's storage metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series = {"prefetch_pgs": [], "prefetch_bandwidth": [], "backup_pgs": [], "backup_bandwidth": []}

    def record(self, op: str, pages: int, nbytes: int, seconds: float) -> None:
        if pages:
            with self._lock:
                self._series[f"{op}_pgs"].append(pages)
                self._series[f"{op}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def drain(self) -> dict[str, list]:
        with self._lock:
            out = {k: list(v) for k, v in self._series.items()}
            for v in self._series.values():
                v.clear()
        return out


def _checkpoint(model_name: str) -> tuple[str, str | None]:
    """``(path or hub id, revision)`` of the weights sglang serves. sglang names the model
    to a storage backend by its served name: the model path, unless
    ``--served-model-name`` was given; then the path comes from the model config sglang
    publishes to its processes, when there is one."""
    if os.path.isdir(os.path.expanduser(model_name)):
        return model_name, None
    try:
        from sglang.srt.runtime_context import get_model

        model = get_model()
        return model.model_path or model_name, model.revision
    except (ImportError, ValueError, AttributeError):  # no config published: sglang's classes used alone
        return model_name, None


class KVTierStorage(HiCacheStorage):
    """sglang ``HiCacheStorage`` over a kvtier store (see the module docstring).

    ``storage_config.extra_config`` carries ``url`` and optionally ``namespace``
    (:class:`~.settings.Settings`); a bad URL or an unknown key raises ``ValueError``
    here, before sglang starts serving. The store binds to the pool's geometry at
    :meth:`register_mem_pool_host`, which raises for a pool kvtier cannot read in place.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        self.settings = Settings.parse(storage_config.extra_config)
        if self.settings.namespace is None and not storage_config.model_name:
            raise ValueError("kvtier: sglang gave no model_name to name the model's pages by; set \"namespace\" in "
                             "--hicache-storage-backend-extra-config")
        self.config = storage_config
        # Opening checks the URL and its options now (scheme, host, query values).
        self._store: kvstorage.Storage = kvstorage.open(self.settings.url)
        self._bound = self._closed = False
        self._lock = threading.Lock()
        self._pool: HostKVPool | None = None
        self._sglang_pool = None
        self._topology = Topology()
        self._prefix = ""
        self._throughput = _Throughput()
        self.mem_pool_host = None

    # -- set-up --------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Wrap sglang's host pool in place and bind the store to its geometry."""
        family = family_of(mem_pool_host)
        cfg = self.config
        topology = Topology(cfg.tp_rank, cfg.tp_size, replicated=bool(cfg.is_mla_model) or family.name == "mla")
        pool = wrap_pool(mem_pool_host, topology)
        spec = pool.spec
        # NOTE: kvtier's own host pool (install_host_pool) has flat pages for every geometry.
        flat_pages = getattr(mem_pool_host, "kvtier_pool", None) is not None
        if not self.settings.interface_v1 and not flat_pages and \
                any(c.head_dim != spec.components[0].head_dim for c in spec.components):
            raise UnsupportedPoolError(
                "kvtier: this pool's K and V differ in head_dim, and without \"interface_v1\": 1 sglang moves pages "
                "through the pool's flat-page methods, which raise for sglang's own pool; add \"interface_v1\": 1 to "
                "--hicache-storage-backend-extra-config, or let kvtier build the host pool "
                "(kvtier.integrations.sglang.install_host_pool)")
        options: dict[str, Any] = {"spec": spec, "page_size": pool.page_size}
        if cfg.tp_lcm_size and not topology.replicated:
            # NOTE: sglang's tp_lcm_size names the TP sizes that share pages; head groups of
            # that count are the coarsest cut each of them reads. Without it kvtier cuts per head.
            options["head_groups"] = cfg.tp_lcm_size
        if "layout" in type(self._store).OPTIONS:
            options["layout"] = pool.layout
        try:
            store = kvstorage.open(self.settings.url, **options)
        except UnsupportedLayoutError as e:
            raise UnsupportedPoolError(f"kvtier: {e} (sglang: --hicache-mem-layout page_head)") from e
        with self._lock:
            old, self._store, self._bound = self._store, store, True
            self._pool, self._sglang_pool, self._topology = pool, mem_pool_host, topology
            self._prefix = namespace_tag(self._namespace(mem_pool_host, spec)) + "/"
            self.mem_pool_host = mem_pool_host
        old.close()
        log.info("kvtier storage %s bound: spec %s, shard %s/%s, page_size %d, layout %s (sglang %s), keys %s*",
                 type(store).scheme, spec.fingerprint(), topology.tp_rank, topology.tp_size, pool.page_size,
                 pool.layout, mem_pool_host.layout, self._prefix)

    def _namespace(self, mem_pool_host, spec) -> str:
        """The model part of every key: the configured namespace, else the checkpoint
        sglang serves (its path or hub id, revision, the KV dtype and a digest of its
        files: :func:`~kvtier.integrations.identity.checkpoint_digest`); a pipeline
        stage's layer range is added, since a stage's pages hold only its layers. (The
        geometry is in every object's name: kvtier.storage.)"""
        name = self.settings.namespace or engine_namespace("sglang", *_checkpoint(self.config.model_name), spec.dtype)
        if self.config.pp_size > 1:
            start, end = getattr(mem_pool_host, "start_layer", None), getattr(mem_pool_host, "end_layer", None)
            stage = f"layers{start}-{end}" if start is not None else f"pp{self.config.pp_rank}of{self.config.pp_size}"
            name = f"{name}:{stage}"
        return name

    def _keys(self, keys: List[str]) -> list[str]:
        return [self._prefix + k for k in keys]

    def _bound_pool(self) -> HostKVPool:
        if self._pool is None:
            raise RuntimeError("kvtier: this backend is closed" if self._closed else
                               "kvtier: register_mem_pool_host(pool) must come before page transfers")
        return self._pool

    # -- interface_v1: zero-copy ----------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading pages of ``keys`` are stored whole for this rank's heads.
        ``extra_info.prefix_keys`` is not needed: sglang's page hashes are chained."""
        self._bound_pool()
        return self._store.batch_exists(self._keys(keys)) if keys else 0

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Fill host page ``i`` of ``host_indices`` from ``keys[i]``; ``False`` is a miss."""
        pool = self._bound_pool()
        t0 = time.perf_counter()
        loaded = self._store.batch_get(self._keys(keys), pool, host_indices)
        self._throughput.record("prefetch", sum(loaded), sum(loaded) * pool.page_bytes, time.perf_counter() - t0)
        return loaded

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store host page ``i`` of ``host_indices`` under ``keys[i]``."""
        pool = self._bound_pool()
        t0 = time.perf_counter()
        stored = self._store.batch_set(self._keys(keys), pool, host_indices)
        self._throughput.record("backup", sum(stored), sum(stored) * pool.page_bytes, time.perf_counter() - t0)
        return stored

    # -- the generic (flat page) path -------------------------------------------------------------
    # Used by sglang without interface_v1: pages travel as the pool's get_data_page()
    # tensors. kvtier wraps each one as a one-page pool, so it is stored in the same
    # canonical objects as the zero-copy path writes.
    def _page_pool(self, page: torch.Tensor) -> HostKVPool:
        self._bound_pool()
        return wrap_flat_page(self._sglang_pool, self._topology, page)

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        """Fill ``target_location`` (a flat page of the pool) from ``key``; it, or ``None``."""
        if not isinstance(target_location, torch.Tensor):
            raise ValueError("kvtier: get() fills a flat page given as target_location "
                             "(the pool's get_dummy_flat_data_page())")
        page = self._page_pool(target_location)
        hit = self._store.batch_get(self._keys([key]), page, torch.arange(page.page_size))[0]
        return target_location if hit else None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("kvtier: batch_get() fills one flat page per key, given as target_locations")
        return [self.get(k, t) for k, t in zip(keys, target_locations)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store ``value``, a flat page of the pool (its ``get_data_page(i)``), under ``key``."""
        page = self._page_pool(value)
        return self._store.batch_set(self._keys([key]), page, torch.arange(page.page_size))[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("kvtier: batch_set() stores one flat page per key, given as values")
        return all([self.set(k, v) for k, v in zip(keys, values)])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the rest of sglang's interface --------------------------------------------------------------
    def clear(self) -> None:
        """Remove everything this store holds (every namespace under its URL)."""
        self._store.clear()

    def stats(self) -> dict:
        """kvtier's counters: hits, misses, bytes, errors, corrupt objects, latency."""
        return self._store.stats()

    def get_stats(self) -> StorageMetrics:
        """sglang's per-interval metrics (pages and GB/s per batch, then reset), with
        kvtier's cumulative counters as ``.kvtier``."""
        metrics = StorageMetrics(**self._throughput.drain())
        metrics.kvtier = self.stats()
        return metrics

    def close(self) -> None:
        """Release the store's connections; later transfers raise. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed, self._pool = True, None
        self._store.close()

    def __repr__(self) -> str:
        return f"KVTierStorage({self.settings.url!r}, keys {self._prefix!r}, bound={self._bound})"
