"""kvtier storage as sglang HiCache's L3 backend (``--hicache-storage-backend dynamic``).

sglang's controller builds the backend with ``cls(storage_config, kwargs)``, then hands
it the host pool with ``register_mem_pool_host``. With ``"interface_v1": 1`` it moves
pages with ``batch_set_v1`` (backup), ``batch_exists`` (hit query) and ``batch_get_v1``
(prefetch), in batches of up to 128 pages of host token slots. kvtier reads and writes
the pool's own tensors in place (:mod:`.pools`) and stores each page as canonical,
checksummed objects under ``<namespace>/<sglang page hash>``: the same object for every
host layout, and per head group, so any tensor-parallel size reads what another wrote.
A storage fault is a miss and a counted error, never an exception on sglang's threads.

Hybrid models (sliding window layers: MiMo-V2-Flash, gpt-oss) have more host pools,
named (``KV`` for the full layers, ``SWA`` for the sliding ones, ``DRAFT_SWA`` for an
MTP draft's), which sglang registers with ``register_mem_host_pool_v2`` and moves with
the v2 calls (:meth:`KVTierStorage.batch_exists_v2`, ``batch_get_v2``,
``batch_set_v2``). Each pool has its own geometry and objects: a page of pool ``P``
is stored under ``<namespace>/<page hash>~<P>`` (``KV`` under the plain page hash, so
v1 and v2 share its objects), so pools of one geometry never read each other's pages.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo,
                                                  PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult)
from sglang.srt.observability.metrics_collector import StorageMetrics

from ... import storage as kvstorage
from ...errors import UnsupportedLayoutError, UsageError
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


@dataclass
class PoolBinding:
    """One registered host pool: sglang's, kvtier's view of it, the store bound to its
    geometry, and how its pages' keys are named (:meth:`keys`)."""

    name: str
    sglang_pool: Any
    pool: HostKVPool
    topology: Topology
    store: kvstorage.Storage
    prefix: str  # namespace
    tag: str     # after each page hash: "" for KV, "~<pool name>" for the others

    def keys(self, keys: List[str]) -> list[str]:
        """The store's keys of sglang's page hashes ``keys`` in this pool."""
        return [f"{self.prefix}{k}{self.tag}" for k in keys]


def _pool_name(name) -> str:
    """sglang names pools with ``PoolName`` members or their string values."""
    return name.value if isinstance(name, PoolName) else str(name)


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
            raise UsageError("kvtier: sglang gave no model_name to name the model's pages by; set \"namespace\" in "
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
        self._pools: dict[str, PoolBinding] = {}  # bound host pools by sglang name (v1's is "kv")
        self._pool_counts: dict[str, dict[str, int]] = {}  # pages moved through v2, by pool
        self.mem_pool_host = None

    # -- set-up --------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Wrap sglang's host pool in place and bind the store to its geometry."""
        binding = self._bind(mem_pool_host, PoolName.KV.value)
        spec = binding.pool.spec
        # NOTE: kvtier's own host pool (install_host_pool) has flat pages for every geometry.
        flat_pages = getattr(mem_pool_host, "kvtier_pool", None) is not None
        if not self.settings.interface_v1 and not flat_pages and \
                any(c.head_dim != spec.components[0].head_dim for c in spec.components):
            binding.store.close()
            raise UnsupportedPoolError(
                "kvtier: this pool's K and V differ in head_dim, and without \"interface_v1\": 1 sglang moves pages "
                "through the pool's flat-page methods, which raise for sglang's own pool; add \"interface_v1\": 1 to "
                "--hicache-storage-backend-extra-config, or let kvtier build the host pool "
                "(kvtier.integrations.sglang.install_host_pool)")
        with self._lock:
            old, self._store, self._bound = self._store, binding.store, True
            self._pool, self._sglang_pool, self._topology = binding.pool, mem_pool_host, binding.topology
            self._prefix = binding.prefix
            self.mem_pool_host = mem_pool_host
            replaced = self._pools.get(binding.name)
            self._pools[binding.name] = binding
        old.close()
        if replaced is not None and replaced.store is not old:
            replaced.store.close()

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Bind one named host pool of a hybrid model (``KV``, ``SWA``, ``DRAFT_SWA``, ...)
        to its own geometry and objects. The ``KV`` pool is usually the one
        :meth:`register_mem_pool_host` bound already (the group's anchor): then its
        binding is kept. ``UnsupportedPoolError`` for a pool kvtier cannot read in place
        (a Mamba state pool, for example), naming it: sglang then fails at start."""
        name = _pool_name(host_pool_name)
        with self._lock:
            current = self._pools.get(name)
        if current is not None and current.sglang_pool is host_pool:
            return
        try:
            binding = self._bind(host_pool, name)
        except UnsupportedPoolError as e:
            raise UnsupportedPoolError(f"kvtier: cannot serve sglang's host pool {name!r} "
                                       f"({type(host_pool).__name__}): {e}") from e
        with self._lock:
            replaced = self._pools.get(name)
            self._pools[name] = binding
        if replaced is not None and replaced.store is not self._store:
            replaced.store.close()

    def on_host_pools_registered(self) -> None:
        """The pool set is complete: it must hold the KV pool; logs what is served."""
        with self._lock:
            pools = dict(self._pools)
        if PoolName.KV.value not in pools:
            raise UnsupportedPoolError(f"kvtier: sglang registered host pools {sorted(pools)} without a KV pool")
        log.info("kvtier storage serves sglang host pools: %s",
                 ", ".join(f"{n} ({b.pool.spec.fingerprint()}, {type(b.sglang_pool).__name__})"
                           for n, b in sorted(pools.items())))

    def _bind(self, mem_pool_host, name: str) -> PoolBinding:
        """kvtier's view of one sglang host pool and a store bound to its geometry."""
        family = family_of(mem_pool_host)
        cfg = self.config
        topology = Topology(cfg.tp_rank, cfg.tp_size, replicated=bool(cfg.is_mla_model) or family.name == "mla")
        pool = wrap_pool(mem_pool_host, topology)
        spec = pool.spec
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
        prefix = namespace_tag(self._namespace(mem_pool_host, spec)) + "/"
        tag = "" if name == PoolName.KV.value else f"~{name}"
        log.info("kvtier storage %s bound to sglang pool %s: spec %s, shard %s/%s, page_size %d, layout %s "
                 "(sglang %s), keys %s*%s", type(store).scheme, name, spec.fingerprint(), topology.tp_rank,
                 topology.tp_size, pool.page_size, pool.layout, mem_pool_host.layout, prefix, tag)
        return PoolBinding(name, mem_pool_host, pool, topology, store, prefix, tag)

    def _namespace(self, mem_pool_host, spec) -> str:
        """The model part of every key: the configured namespace, else the checkpoint
        sglang serves (its path or hub id, revision, the KV dtype and a digest of its
        files: :func:`~kvtier.integrations.identity.checkpoint_digest`); a pipeline
        stage's layer range is added, since a stage's pages hold only its layers, and an
        attention context-parallel rank, since under NSA context parallel each holds its
        own slice of every page (sglang's own file backend keys each apart too). (The
        geometry is in every object's name: kvtier.storage.)"""
        name = self.settings.namespace or engine_namespace("sglang", *_checkpoint(self.config.model_name), spec.dtype)
        if self.config.pp_size > 1:
            start, end = getattr(mem_pool_host, "start_layer", None), getattr(mem_pool_host, "end_layer", None)
            stage = f"layers{start}-{end}" if start is not None else f"pp{self.config.pp_rank}of{self.config.pp_size}"
            name = f"{name}:{stage}"
        cp_size = getattr(self.config, "attn_cp_size", 1) or 1
        if cp_size > 1:
            name = f"{name}:cp{self.config.attn_cp_rank}of{cp_size}"
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
        """Store host page ``i`` of ``host_indices`` under ``keys[i]``; a page stored
        already is kept (``True``): sglang's page hashes name their content."""
        pool = self._bound_pool()
        t0 = time.perf_counter()
        stored = self._set_new(self._pools[PoolName.KV.value], keys, host_indices) if keys else []
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
            raise UsageError("kvtier: get() fills a flat page given as target_location "
                             "(the pool's get_dummy_flat_data_page())")
        page = self._page_pool(target_location)
        hit = self._store.batch_get(self._keys([key]), page, torch.arange(page.page_size))[0]
        return target_location if hit else None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        if target_locations is None or len(target_locations) != len(keys):
            raise UsageError("kvtier: batch_get() fills one flat page per key, given as target_locations")
        return [self.get(k, t) for k, t in zip(keys, target_locations)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store ``value``, a flat page of the pool (its ``get_data_page(i)``), under ``key``."""
        page = self._page_pool(value)
        if self._store.exists_each(self._keys([key]))[0]:
            return True  # kept: the page hash names its content
        return self._store.batch_set(self._keys([key]), page, torch.arange(page.page_size))[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None or len(values) != len(keys):
            raise UsageError("kvtier: batch_set() stores one flat page per key, given as values")
        return all([self.set(k, v) for k, v in zip(keys, values)])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- v2: the named pools of hybrid models ----------------------------------------------------------
    def binding(self, name) -> PoolBinding | None:
        """What serves sglang's host pool ``name`` (a ``PoolName`` or its value): kvtier's
        view of the pool, the store bound to its geometry and the keys its pages get;
        ``None`` before sglang registers the pool and after :meth:`close`."""
        with self._lock:
            return None if self._closed else self._pools.get(_pool_name(name))

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """The page counts a request may restore from storage.

        ``KV``: the longest run of leading pages stored. Each extra pool then keeps the
        prefix lengths it can serve: ``ALL_PAGES`` every page before it, ``TRAILING_PAGES``
        the last ``len(transfer.keys)`` pages before it (a sliding window; the transfer's
        keys only count). ``restorable_prefix_pages`` is the ascending list of lengths
        every pool can serve, ``kv_hit_pages`` the longest: a missing sliding page is
        never a hit. A pool that was never registered serves none. A storage fault is a
        miss. ``UnsupportedPoolError`` for a hit policy kvtier cannot serve, naming it."""
        kv = self.binding(PoolName.KV)
        if kv is None or not keys:
            return PoolTransferResult(0, {}, [])
        for transfer in pool_transfers or ():
            if transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                policy = getattr(transfer.hit_policy, "value", transfer.hit_policy)
                raise UnsupportedPoolError(f"kvtier: hit policy {policy!r} of sglang pool "
                                           f"{_pool_name(transfer.name)!r} is not served; kvtier serves all_pages and "
                                           "trailing_pages")
        kv_pages = kv.store.batch_exists(kv.keys(keys))
        hits: dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or ():
            if not restorable:
                break
            name, binding = _pool_name(transfer.name), self.binding(transfer.name)
            present = binding.store.exists_each(binding.keys(keys[:kv_pages])) if binding is not None \
                else [False] * kv_pages
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                run = present.index(False) if False in present else kv_pages
                served = set(range(1, run + 1))
            else:
                window = max(1, len(transfer.keys or ()))
                served = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window):n])}
            if served:
                hits[name] = max(served)
            restorable &= served
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        """Fill each transfer's host pages of its pool from its keys; per pool, per key,
        whether the page was filled (never raises: a fault is ``False``)."""
        return {_pool_name(t.name): self._move_v2(t, "prefetch") for t in transfers}

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        """Store each transfer's host pages of its pool under its keys; per pool, per key,
        whether the page is stored (a page stored already is kept: ``True``). Never
        raises: sglang writes the SWA pages first, and a raise would drop the KV write."""
        return {_pool_name(t.name): self._move_v2(t, "backup") for t in transfers}

    def _move_v2(self, transfer: PoolTransfer, op: str) -> list[bool]:
        keys = list(transfer.keys or ())
        name, binding = _pool_name(transfer.name), self.binding(transfer.name)
        if not keys:
            return []
        done = [False] * len(keys)
        indices = transfer.host_indices
        if binding is None:
            log.warning("kvtier: %s of %d pages of sglang pool %r, which was never registered", op, len(keys), name)
        elif indices is None or indices.numel() != binding.pool.page_size * len(keys):
            log.warning("kvtier: %s of sglang pool %r: %d keys need %d host slots, got %s", op, name, len(keys),
                        binding.pool.page_size * len(keys), None if indices is None else indices.numel())
        else:
            try:
                t0 = time.perf_counter()
                if op == "prefetch":
                    done = list(binding.store.batch_get(binding.keys(keys), binding.pool, indices))
                else:
                    done = self._set_new(binding, keys, indices)
                self._throughput.record(op, sum(done), sum(done) * binding.pool.page_bytes, time.perf_counter() - t0)
            except Exception:  # a bug, not a storage fault (the store takes those): misses, never a raise
                log.exception("kvtier: %s of sglang pool %r failed", op, name)
                done = [False] * len(keys)
        self._count(name, op, done)
        return done

    def _set_new(self, binding: PoolBinding, keys: List[str], indices: torch.Tensor) -> list[bool]:
        """Store the pages of ``keys`` not stored yet (page hashes name their content:
        a stored page is kept, as sglang's contract has it); per key, whether stored."""
        full = binding.keys(keys)
        held = binding.store.exists_each(full)
        todo = [i for i, h in enumerate(held) if not h]
        if not todo:
            return [True] * len(keys)
        size = binding.pool.page_size
        pick = torch.cat([indices[i * size:(i + 1) * size] for i in todo])
        stored = binding.store.batch_set([full[i] for i in todo], binding.pool, pick)
        out = list(held)
        for i, ok in zip(todo, stored):
            out[i] = bool(ok)
        return out

    def _count(self, name: str, op: str, done: List[bool]) -> None:
        with self._lock:
            counts = self._pool_counts.setdefault(name, {"prefetch_pages": 0, "prefetch_misses": 0,
                                                         "backup_pages": 0, "backup_failures": 0})
            ok = sum(done)
            counts[f"{op}_pages"] += ok
            counts["prefetch_misses" if op == "prefetch" else "backup_failures"] += len(done) - ok

    # -- the rest of sglang's interface --------------------------------------------------------------
    def clear(self) -> None:
        """Remove everything this store holds (every namespace under its URL)."""
        self._store.clear()

    def stats(self) -> dict:
        """kvtier's counters: hits, misses, bytes, errors, corrupt objects, latency (of
        the KV pool's store), and under ``"pools"`` each registered pool's store
        counters with the pages v2 moved for it."""
        out = self._store.stats()
        with self._lock:
            pools, counts = dict(self._pools), {n: dict(c) for n, c in self._pool_counts.items()}
        if pools:
            out["pools"] = {n: {**b.store.stats(), **counts.get(n, {})} for n, b in sorted(pools.items())}
        return out

    def get_stats(self) -> StorageMetrics:
        """sglang's per-interval metrics (pages and GB/s per batch, then reset), with
        kvtier's cumulative counters as ``.kvtier``."""
        metrics = StorageMetrics(**self._throughput.drain())
        metrics.kvtier = self.stats()
        return metrics

    def close(self) -> None:
        """Release the stores' connections; later transfers raise. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed, self._pool = True, None
            stores = {id(b.store): b.store for b in self._pools.values()}
            stores[id(self._store)] = self._store
        for store in stores.values():
            store.close()

    def __repr__(self) -> str:
        return f"KVTierStorage({self.settings.url!r}, keys {self._prefix!r}, bound={self._bound})"
