"""Shared set-ups for the vLLM tests: hand-built vLLM offloading configs and KV tensors
shaped as vLLM's attention backends shape them (no model, no engine)."""

from __future__ import annotations

import hashlib

import torch
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,
                                     GPULoadStoreSpec, ReqContext, make_offload_key)
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)

from kvtier import HostKVPool
from kvtier.integrations.vllm import KVTierOffloadingManager, KVTierOffloadingWorker
from kvtier.integrations.vllm.blocks import Geometry, block_format
from kvtier.integrations.vllm.tier import HostTier

LAYERS, BLOCK = 3, 32
CPU_GQA = Geometry("CPU_ATTN", "LBHNC", False, 2, 32, BLOCK, torch.bfloat16)
FA_GQA = Geometry("FLASH_ATTN", "LBNHC", False, 2, 32, BLOCK, torch.bfloat16)
MLA = Geometry("FLASH_ATTN_MLA", "LBNHC", True, 1, 96, BLOCK, torch.bfloat16)
UNKNOWN = Geometry("SOME_BACKEND", "LBNHC", False, 2, 32, BLOCK, torch.bfloat16)


def offloading_config(extra: dict, *, layers: int = LAYERS, block_bytes: int = 0, blocks_per_chunk: int = 1,
                      world_size: int = 1, groups: int = 1, rank: int = 0, pp_size: int = 1, dcp_size: int = 1,
                      engine_id: str | None = None, model: str = "/models/tiny-llama",
                      events: bool = False) -> OffloadingConfig:
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(BLOCK, names, g) for g in range(groups)),
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=events,
        extra_config={"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm", **extra},
        engine_id=engine_id or f"test-{hashlib.sha1(repr(sorted(extra.items())).encode()).hexdigest()[:8]}",
        model=OffloadingModelConfig(model, "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank, world_size * pp_size, world_size, pp_size, 1, dcp_size, 0, 1, 0,
                                          True),
        kv_cache_layout="LBHNC")


def layer_page_bytes(geometry: Geometry) -> int:
    if geometry.use_mla:
        return BLOCK * geometry.head_size * 2
    return 2 * BLOCK * geometry.num_kv_heads * geometry.head_size * 2


class Engine:
    """vLLM's side of one worker: per-layer KV tensors of ``num_blocks`` blocks (random
    bytes) and the int8 rows vLLM gives the offloading worker."""

    def __init__(self, geometry: Geometry, num_blocks: int = 16, seed: int = 0) -> None:
        self.page_bytes = layer_page_bytes(geometry)
        gen = torch.Generator().manual_seed(seed)
        self.kv = [torch.randint(-128, 127, (num_blocks, self.page_bytes), dtype=torch.int8, generator=gen)
                   for _ in range(LAYERS)]
        self.caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, self.page_bytes) for t in self.kv],
            [[CanonicalKVCacheRef(i, self.page_bytes) for i in range(LAYERS)]])

    def blocks(self, ids: list[int]) -> list[torch.Tensor]:
        return [t[ids].clone() for t in self.kv]

    def wipe(self, ids: list[int]) -> None:
        for t in self.kv:
            t[ids] = 0


def keys(*names: str, group: int = 0) -> list:
    return [make_offload_key(hashlib.sha256(n.encode()).digest(), group) for n in names]


def gpu_spec(block_ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[0])


def context(req: str = "r0") -> ReqContext:
    return ReqContext(req_id=req)


class Rig:
    """A tier, vLLM-facing manager and worker over one :class:`Engine`: the worker's
    host pool is the pool the tier holds, as the pool file makes it across processes.
    ``host_blocks`` counts offloaded blocks of ``per_key`` vLLM blocks each."""

    def __init__(self, geometry: Geometry, host_blocks: int = 8, storage=None, key_prefix: str = "test",
                 timeout_s: float = 2.0, seed: int = 0, per_key: int = 1, events: bool = False, **tier) -> None:
        self.engine = Engine(geometry, seed=seed)
        self.per_key = per_key
        fmt = block_format(geometry, LAYERS, self.engine.page_bytes)
        pool = HostKVPool(fmt.spec, host_blocks * per_key * fmt.page_size, fmt.page_size, layout="page_head")
        tier.setdefault("buffer_pages", host_blocks * per_key)  # room to stage every block at once
        self.tier = HostTier([pool], fmt, blocks_per_key=per_key, storage=storage, key_prefix=key_prefix,
                             timeout_s=timeout_s, events=events, **tier)
        self.manager = KVTierOffloadingManager(lambda: self.tier)
        self.worker = KVTierOffloadingWorker.single(pool, fmt, self.engine.kv, blocks_per_key=per_key)
        self._job = 0

    def store(self, offload_keys, block_ids: list[int], req=None):
        """vLLM's store protocol: prepare, copy, complete. Returns prepare_store's output."""
        req = req or context()
        out = self.manager.prepare_store(offload_keys, req)
        if out is None:
            return None
        per = self.per_key
        index = {k: block_ids[i * per:(i + 1) * per] for i, k in enumerate(offload_keys)}
        self._job += 1
        blocks = [b for k in out.keys_to_store for b in index[k]]
        assert self.worker.submit_store(self._job, gpu_spec(blocks), out.store_spec)
        assert [r.job_id for r in self.worker.get_finished() if r.success] == [self._job]
        self.manager.complete_store(out.keys_to_store, req)
        return out

    def load(self, offload_keys, block_ids: list[int], req=None) -> None:
        req = req or context()
        spec = self.manager.prepare_load(offload_keys, req)
        self._job += 1
        assert self.worker.submit_load(self._job, spec, gpu_spec(block_ids))
        self.worker.wait({self._job})
        assert [r.job_id for r in self.worker.get_finished() if r.success] == [self._job]
        self.manager.complete_load(offload_keys, req)


def generate(llm, prompts: list[str], sampling) -> tuple[list[list[int]], list[int], list[int]]:
    """``(tokens, cached prompt tokens, prompt tokens)`` of each prompt, ``llm.generate``'s order."""
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs], \
        [len(o.prompt_token_ids) for o in outs]


def close_llm(llm) -> None:
    """Shut an in-process ``LLM``'s engine core down and drop it (its KV memory with it)."""
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
