"""The ``OffloadingSpec`` vLLM loads: builds the host tier, the manager and the worker."""

from __future__ import annotations

import logging
import threading

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from ... import storage as kvstorage
from ...errors import UnsupportedLayoutError
from ...storage.keys import namespace_tag
from ..identity import model_namespace
from .blocks import BlockFormat, Geometry, block_format, cache_dtype
from .config import KVTierConfig
from .manager import KVTierOffloadingManager
from .tier import HostTier
from .worker import KVTierOffloadingWorker

log = logging.getLogger("kvtier.vllm")

# NOTE: vLLM builds one spec object for the worker and another for the scheduler (both
# in the engine process when there is one worker); the host tier they share is found
# here by engine id. The worker creates it (only it sees the KV tensors) and closes it.
_TIERS: dict[str, HostTier] = {}
_TIERS_LOCK = threading.Lock()


class UnsupportedVLLMSetupError(NotImplementedError):
    """A vLLM configuration this spec cannot serve; the message says what to change."""


class KVTierOffloadingSpec(OffloadingSpec):
    """vLLM ``OffloadingSpec`` with kvtier's host tier and optional storage."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.kvtier = KVTierConfig.parse(config.extra_config)
        _check_setup(config)
        if self.kvtier.storage is not None:
            kvstorage.open(self.kvtier.storage).close()  # a bad URL or option fails here, not later
        need = config.worker_kv_bytes_per_block
        if need and self.kvtier.host_bytes < need:
            raise ValueError(f"kvtier: host_bytes {self.kvtier.host_bytes} holds no block of this model "
                             f"({need} bytes over all layers); give at least {need}")
        self.engine_id = config.engine_id
        self._manager: KVTierOffloadingManager | None = None
        self._worker: KVTierOffloadingWorker | None = None

    # -- scheduler side -------------------------------------------------------------------------
    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KVTierOffloadingManager(lambda: _TIERS.get(self.engine_id))
        return self._manager

    # -- worker side ----------------------------------------------------------------------------------
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rows = _layer_rows(kv_caches)
            fmt = block_format(self.geometry(), len(rows), kv_caches.group_data_refs[0][0].page_size_bytes)
            tier = self.build_tier(fmt)
            with _TIERS_LOCK:
                old = _TIERS.pop(self.engine_id, None)
                _TIERS[self.engine_id] = tier
            if old is not None:
                old.close()
            log.info("kvtier: %s pages of %s in host memory%s", tier.num_pages, fmt.name,
                     f", storage {self.kvtier.storage}" if self.kvtier.storage else "")
            self._worker = KVTierOffloadingWorker(tier, rows, on_shutdown=self.release)
        return self._worker

    def geometry(self) -> Geometry:
        """The KV geometry from vLLM's current config (set while vLLM builds workers)."""
        from vllm.config import get_current_vllm_config_or_none
        from vllm.platforms import current_platform

        group = self.config.groups[0]
        vllm_config = get_current_vllm_config_or_none()
        backend, heads, head, mla = "unknown", 1, 1, False
        if vllm_config is not None:
            model = vllm_config.model_config
            heads, head, mla = model.get_num_kv_heads(vllm_config.parallel_config), model.get_head_size(), \
                model.use_mla
            backend = _backend_name(vllm_config, group.layer_names)
        elif current_platform.is_cpu():
            backend = "CPU_ATTN"
        return Geometry(backend, self.config.kv_cache_layout or "unknown", mla, heads, head, group.tokens_per_block,
                        cache_dtype(self.config.model.dtype))

    def namespace(self) -> str:
        if self.kvtier.namespace is not None:
            return self.kvtier.namespace
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        revision = None
        if vllm_config is not None:  # the hub commit when vLLM resolved one, else what was asked for
            model = vllm_config.model_config
            revision = getattr(model.hf_config, "_commit_hash", None) or model.revision
        return "vllm:" + model_namespace(self.config.model.name, revision, self.config.model.dtype, None)

    def build_tier(self, fmt: BlockFormat) -> HostTier:
        store = kvstorage.open(self.kvtier.storage) if self.kvtier.storage else None
        return HostTier(fmt, self.kvtier.host_bytes, storage=store,
                        key_prefix=f"{namespace_tag(self.namespace())}/{fmt.name}",
                        timeout_s=float(self.kvtier.storage_timeout_s), io_threads=self.kvtier.io_threads)

    @property
    def tier(self) -> HostTier | None:
        return _TIERS.get(self.engine_id)

    def release(self) -> None:
        """Close this engine's tier (waits for storage writes in flight)."""
        with _TIERS_LOCK:
            tier = _TIERS.pop(self.engine_id, None)
        if tier is not None:
            tier.close()


def engine_tier(engine_id: str) -> HostTier | None:
    """The host tier of the engine ``engine_id`` in this process (its
    ``kv_transfer_config.engine_id``), for stats and :meth:`HostTier.flush`."""
    return _TIERS.get(engine_id)


def _check_setup(config: OffloadingConfig) -> None:
    if len(config.groups) != 1:
        raise UnsupportedVLLMSetupError(
            f"kvtier: the model has {len(config.groups)} offloadable KV cache groups (hybrid attention); "
            "kvtier serves models with one full-attention group")
    if config.cache.blocks_per_chunk != 1:
        raise UnsupportedVLLMSetupError(
            f"kvtier: blocks_per_chunk {config.cache.blocks_per_chunk}; kvtier keeps one page per vLLM block: "
            "drop block_size / blocks_per_chunk from kv_connector_extra_config")
    if config.parallel.world_size != 1:
        raise UnsupportedVLLMSetupError(
            f"kvtier: {config.parallel.world_size} workers; kvtier's vLLM spec shares its host tier between "
            "the scheduler and one worker in one process: use tensor and pipeline parallel size 1")


def _layer_rows(kv_caches: CanonicalKVCaches) -> list:
    refs = kv_caches.group_data_refs[0]
    sizes = {r.page_size_bytes for r in refs}
    if len(sizes) != 1:
        raise UnsupportedLayoutError(f"kvtier: layers of one group have different page sizes {sorted(sizes)}")
    return [kv_caches.tensors[r.tensor_idx].tensor for r in refs]


def _backend_name(vllm_config, layer_names) -> str:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))
    names = {layer.get_attn_backend().get_name() for layer in layers.values()}
    return names.pop() if len(names) == 1 else "mixed"


__all__ = ["KVTierOffloadingSpec", "UnsupportedVLLMSetupError", "engine_tier"]
