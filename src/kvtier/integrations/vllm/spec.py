"""The ``OffloadingSpec`` vLLM loads: the worker's host pool, the scheduler's tier and manager.

vLLM builds one spec object in each process that takes part: in every worker (rank
``r`` of the tensor-parallel group, ``get_worker``) and in the engine core
(``get_manager``); by default those are different processes, and with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` one. Either way the two sides share only what
vLLM passes between them (the jobs' load/store specs, which hold host page numbers,
and the jobs' completions) plus the pool files each worker creates and the scheduler
maps (:mod:`.region`). vLLM initialises the workers' KV caches before it builds its
scheduler, so the files are there when the manager looks for them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any

from vllm.v1.kv_offload.base import (CanonicalKVCaches, OffloadingManager, OffloadingMetricMetadata, OffloadingSpec,
                                     OffloadingWorker)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from ... import storage as kvstorage
from ...errors import UnsupportedLayoutError, UnsupportedVLLMSetupError, UsageError
from ...storage.keys import namespace_tag
from ..identity import engine_namespace
from .blocks import BlockFormat, Geometry, block_format, cache_dtype
from .config import KVTierConfig
from .groups import GroupedTier
from .manager import KVTierOffloadingManager
from .metrics import metric_definitions
from .region import Region, RegionError, RegionInfo
from .tier import HostTier
from .worker import KVTierOffloadingWorker, WorkerGroup

log = logging.getLogger("vllm.kvtier")  # vLLM's logging configuration shows it beside vLLM's own lines

#: Scheduler-side tiers of this process by engine id: for tests and scripts that run vLLM
#: in-process (``engine_tier``); nothing in the serving path reads it.
_TIERS: dict[str, HostTier] = {}
_TIERS_LOCK = threading.Lock()


# NOTE: a CPUOffloadingSpec subclass only so that vLLM keeps its older transfer metrics
# (vllm:kv_offload_total_bytes{transfer_type}) for kvtier as it does for its own CPU
# spec; none of the CPU spec's code runs (every method it has is overridden here).
class KVTierOffloadingSpec(CPUOffloadingSpec):
    """vLLM ``OffloadingSpec`` with kvtier's host tier and optional storage."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions(storage=bool(extra_config.get("storage")))

    def __init__(self, config: OffloadingConfig) -> None:
        OffloadingSpec.__init__(self, config)
        try:
            self.kvtier = KVTierConfig.parse(config.extra_config)
            _check_setup(config)
            if self.kvtier.storage is not None:
                kvstorage.open(self.kvtier.storage).close()  # a bad URL or option fails here, not later
            need = config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk * config.parallel.world_size
            if need and self.kvtier.host_bytes < need:
                raise UsageError(f"kvtier: host_bytes {self.kvtier.host_bytes} holds no offloaded block of this model "
                                 f"({need} bytes over all layers and workers); give at least {need}")
        except (ValueError, NotImplementedError) as e:
            log.error("%s", e)  # one line in vLLM's log before vLLM's own tracebacks
            raise
        self.engine_id = config.engine_id
        self.blocks_per_key = config.cache.blocks_per_chunk
        self._manager: KVTierOffloadingManager | None = None
        self._worker: KVTierOffloadingWorker | None = None
        self._regions: list[Region] = []   # this worker's pool files, one per KV cache group
        self._pinned: list[int] = []       # their base addresses registered with the accelerator (0: not)
        self._formats: list[BlockFormat] = []
        self._tier: HostTier | GroupedTier | None = None

    # -- worker side ----------------------------------------------------------------------------------
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            par = self.config.parallel
            groups = []
            for g, pages in enumerate(self._group_pages(kv_caches)):
                rows = _layer_rows(kv_caches, g)
                fmt = self._formats[g]
                info = RegionInfo(self.engine_id, par.rank, par.world_size, os.getpid(), fmt, "page_head", pages, g)
                region = Region.create(self.kvtier.host_dir, info)
                self._regions.append(region)
                self._pinned.append(_pin(region))
                log.info("kvtier: worker %d of %d, KV cache group %d of %d: %d blocks of %s in %s (%.1f MiB)",
                         par.rank, par.world_size, g, len(self.config.groups), pages, fmt.name, region.path,
                         info.file_bytes / 2**20)
                groups.append(WorkerGroup(region.pool, fmt, rows))
            self._worker = KVTierOffloadingWorker(groups, blocks_per_key=self.blocks_per_key,
                                                  on_shutdown=self._release_regions)
        return self._worker

    def _group_pages(self, kv_caches: CanonicalKVCaches) -> list[int]:
        """Host pages of each group on this rank: ``host_bytes`` shared by the groups in
        proportion to their weights (1 for full attention, ``sliding_host_share`` for a
        sliding window group: vLLM stores only the window before each point a request
        may resume from), whole offloaded blocks each. ``ValueError`` naming the group
        that gets none."""
        par = self.config.parallel
        self._formats = [block_format(self.geometry(g), len(_layer_rows(kv_caches, g)),
                                      kv_caches.group_data_refs[g][0].page_size_bytes)
                         for g in range(len(self.config.groups))]
        weights = [self.kvtier.sliding_host_share if self._sliding(g) else 1.0 for g in range(len(self._formats))]
        out = []
        for g, (fmt, w) in enumerate(zip(self._formats, weights)):
            per_rank = fmt.page_size * fmt.spec.bytes_per_token * par.world_size
            share = int(self.kvtier.host_bytes * w / sum(weights))
            pages = share // per_rank // self.blocks_per_key * self.blocks_per_key
            if pages < 1:
                need = -(-per_rank * self.blocks_per_key * sum(weights) // w)
                raise UsageError(f"kvtier: host_bytes {self.kvtier.host_bytes} holds no offloaded block of KV cache "
                                 f"group {g} ({per_rank * self.blocks_per_key} bytes over {par.world_size} workers, "
                                 f"{share} bytes its share); give at least {int(need)}")
            out.append(pages)
        return out

    def _release_regions(self) -> None:
        if self._pinned and any(self._pinned):
            from vllm.v1.kv_offload.cpu.host_register import host_unregister

            for ptr in self._pinned:
                if ptr:
                    host_unregister(ptr)
        self._pinned = []
        for region in self._regions:
            region.close()
        self._regions = []

    def _layers(self, group: int) -> dict:
        """The attention layers of ``group`` by name ({} when vLLM registered none: its
        classes used without a model)."""
        from vllm.config import get_current_vllm_config_or_none, get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None:
            return {}
        return get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(self.config.groups[group].layer_names))

    def _sliding(self, group: int) -> bool:
        return any(getattr(layer, "sliding_window", None) is not None for layer in self._layers(group).values())

    def geometry(self, group: int = 0) -> Geometry:
        """The KV geometry of ``group`` from vLLM's current config (set while vLLM builds
        workers): its layers' heads and head size, else the model's."""
        from vllm.config import get_current_vllm_config_or_none
        from vllm.platforms import current_platform

        spec = self.config.groups[group]
        par = self.config.parallel
        vllm_config = get_current_vllm_config_or_none()
        backend, heads, total, head, mla = "unknown", 1, None, 1, False
        if vllm_config is not None:
            model = vllm_config.model_config
            heads, head, mla = model.get_num_kv_heads(vllm_config.parallel_config), model.get_head_size(), \
                model.use_mla
            total = model.get_total_num_kv_heads()
            layers = self._layers(group)
            backend = _backend_name(layers)
            shapes = {(getattr(x, "num_kv_heads", None), getattr(x, "head_size", None),
                       getattr(x, "head_size_v", None)) for x in layers.values()}
            if len(shapes) == 1 and None not in next(iter(shapes)):
                layer_heads, head, head_v = shapes.pop()
                if layer_heads != heads:  # this group's own head count (MiMo: 4 full, 8 sliding)
                    heads, total = layer_heads, layer_heads * par.tp_size
                if head_v != head and not mla:  # K and V of different widths: pages of the block's bytes
                    backend = f"{backend}.k{head}v{head_v}"
        elif current_platform.is_cpu():
            backend = "CPU_ATTN"
        return Geometry(backend, self.config.kv_cache_layout or "unknown", mla, heads, head, spec.tokens_per_block,
                        cache_dtype(self.config.model.dtype), total, par.rank, par.tp_size)

    # -- scheduler side -------------------------------------------------------------------------
    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._tier = self._attach()
            self._manager = KVTierOffloadingManager(lambda: self._tier)
        return self._manager

    def _attach(self):
        """The tier over the workers' pool files (a :class:`~.groups.GroupedTier` for
        several KV cache groups). vLLM initialises its workers' KV caches before it
        builds its scheduler, so a file missing now means a worker this process cannot
        reach (another node): refused, saying so."""
        par = self.config.parallel
        per_group = []
        for g in range(len(self.config.groups)):
            regions = [Region.attach(self.kvtier.host_dir, self.engine_id, rank, g) for rank in range(par.world_size)]
            missing = [rank for rank, r in enumerate(regions) if r is None]
            if missing:
                raise UnsupportedVLLMSetupError(
                    f"kvtier: no host pool file of worker(s) {missing} of {par.world_size} in {self.kvtier.host_dir} "
                    f"(KV cache group {g}) on this machine; kvtier's vLLM spec needs every worker on the engine "
                    "core's node, sharing host_dir with it (one node per engine: scale out with data parallelism)")
            shapes = {(r.info.format.name, r.info.format.page_size, r.info.num_pages) for r in regions}
            if len(shapes) != 1:
                raise RegionError(f"kvtier: the workers' host pools of group {g} disagree (format, tokens, pages): "
                                  f"{sorted(shapes)}")
            per_group.append(regions)
        for regions in per_group:
            for r in regions:
                r.unlink()  # every process that needs the memory has it mapped now
        if len(per_group) == 1:
            tier = self.build_tier([r.pool for r in per_group[0]], per_group[0][0].info.format)
        else:
            store = kvstorage.open(self.kvtier.storage) if self.kvtier.storage else None
            tiers = [self.build_tier([r.pool for r in regions], regions[0].info.format, group=g, storage=store)
                     for g, regions in enumerate(per_group)]
            tier = GroupedTier(tiers, [grp.group_id for grp in self.config.groups], storage=store)
        with _TIERS_LOCK:
            old = _TIERS.pop(self.engine_id, None)
            _TIERS[self.engine_id] = tier
        if old is not None:
            old.close()
        total = sum(r.info.file_bytes for regions in per_group for r in regions)
        for g, regions in enumerate(per_group):
            info = regions[0].info
            log.info("kvtier: host tier of %d offloaded blocks (%d vLLM blocks of %d tokens each) on %d worker(s), "
                     "KV cache group %d of %d, format %s", info.num_pages // self.blocks_per_key, self.blocks_per_key,
                     info.format.page_size, par.world_size, g, len(per_group), info.format.name)
        log.info("kvtier: host tier of %d group(s), %.1f MiB; storage %s; keys %s/*", len(per_group),
                 total / 2**20, self.kvtier.storage or "none", self.namespace())
        return tier

    def namespace(self) -> str:
        """The model part of storage keys: the configured ``namespace``, else the model's
        path or hub id, revision, KV dtype and a digest of its checkpoint files
        (:func:`~kvtier.integrations.identity.checkpoint_digest`)."""
        if self.kvtier.namespace is not None:
            return self.kvtier.namespace
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        revision = None
        if vllm_config is not None:  # the hub commit when vLLM resolved one, else what was asked for
            model = vllm_config.model_config
            revision = getattr(model.hf_config, "_commit_hash", None) or model.revision
        return engine_namespace("vllm", self.config.model.name, revision, self.config.model.dtype)

    def build_tier(self, pools, fmt: BlockFormat, *, group: int | None = None, storage=None) -> HostTier:
        """The host tier of one group's pools. ``group`` (its position) is given for
        models of several groups: they share ``storage`` and the staging budget, and
        their keys name the group's layers too (the key's last bytes name its index)."""
        shared = group is not None
        store = storage if shared else (kvstorage.open(self.kvtier.storage) if self.kvtier.storage else None)
        buffer_pages = None
        if self.kvtier.storage_buffer_bytes is not None:
            share = self.kvtier.storage_buffer_bytes // (len(self.config.groups) if shared else 1)
            buffer_pages = max(1, share // (pools[0].page_bytes * len(pools)))
        prefix = f"{namespace_tag(self.namespace())}/{fmt.name}"
        if self.blocks_per_key > 1:
            prefix += f".x{self.blocks_per_key}"
        if shared:
            names = "\n".join(self.config.groups[group].layer_names).encode()
            prefix += f".L{hashlib.sha256(names).hexdigest()[:12]}"
        return HostTier(pools, fmt, blocks_per_key=self.blocks_per_key, storage=store, key_prefix=prefix,
                        timeout_s=float(self.kvtier.storage_timeout_s), io_threads=self.kvtier.io_threads,
                        buffer_pages=buffer_pages, events=self.config.enable_kv_cache_events,
                        owns_storage=not shared)

    @property
    def tier(self) -> HostTier | GroupedTier | None:
        return self._tier

    @property
    def formats(self) -> tuple[BlockFormat, ...]:
        """This worker's block format of each KV cache group (empty before :meth:`get_worker`)."""
        return tuple(self._formats)


def engine_tier(engine_id: str) -> HostTier | GroupedTier | None:
    """The scheduler-side host tier of engine ``engine_id`` (its
    ``kv_transfer_config.engine_id``) when that engine's scheduler runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): for stats and :meth:`HostTier.flush`."""
    return _TIERS.get(engine_id)


def _check_setup(config: OffloadingConfig) -> None:
    par = config.parallel
    if not config.groups:
        raise UnsupportedVLLMSetupError("kvtier: the model has no offloadable KV cache group")
    if par.pp_size != 1:
        raise UnsupportedVLLMSetupError(
            f"kvtier: pipeline parallel size {par.pp_size}; kvtier's vLLM spec serves tensor parallelism only: "
            "use --pipeline-parallel-size 1")
    if par.pcp_size != 1 or par.dcp_size != 1:
        raise UnsupportedVLLMSetupError(
            f"kvtier: context parallel sizes {par.pcp_size} (prefill) and {par.dcp_size} (decode); kvtier keeps "
            "whole blocks per worker: use context parallel size 1")
    if par.world_size != par.tp_size:
        raise UnsupportedVLLMSetupError(
            f"kvtier: {par.world_size} workers for tensor parallel size {par.tp_size}; kvtier's vLLM spec needs one "
            "worker per tensor-parallel rank")


def _pin(region: Region) -> int:
    """Register the worker's pool memory with the accelerator (pinned, for DMA), as vLLM's
    own CPU offloading does with its shared region; its address, or 0 when there is no
    accelerator or the registration failed (copies then run from pageable memory).

    NOTE: shared memory cannot come from the accelerator's pinned allocator, so it is
    registered after the fact (vLLM's host_register: cudaHostRegister on CUDA)."""
    from vllm.platforms import current_platform

    if not (current_platform.is_cuda_alike() or current_platform.is_xpu()):
        return 0
    from vllm.v1.kv_offload.cpu.host_register import host_register

    ptr, nbytes = region.span()
    return ptr if host_register(ptr, nbytes) else 0


def _layer_rows(kv_caches: CanonicalKVCaches, group: int) -> list:
    refs = kv_caches.group_data_refs[group]
    sizes = {r.page_size_bytes for r in refs}
    if len(sizes) != 1:
        raise UnsupportedLayoutError(
            f"kvtier: the layers of KV cache group {group} have blocks of {sorted(sizes)} bytes (state caches such as "
            "Mamba's keep several tensors per layer); kvtier's vLLM spec serves attention KV cache groups, one block "
            "size each: serve this model without kvtier's kv_transfer_config")
    return [kv_caches.tensors[r.tensor_idx].tensor for r in refs]


def _backend_name(layers: dict) -> str:
    names = {layer.get_attn_backend().get_name() for layer in layers.values()}
    if len(names) == 1:
        return names.pop()
    return "mixed" if names else "unknown"  # unknown: no attention layers registered (vLLM's classes used alone)


__all__ = ["KVTierOffloadingSpec", "UnsupportedVLLMSetupError", "engine_tier"]
