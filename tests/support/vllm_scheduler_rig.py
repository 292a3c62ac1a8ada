"""vLLM's own scheduler and ``OffloadingConnector`` (both roles) with kvtier's spec, no
model: the scheduler decides what to store and load, the worker connector runs
kvtier's worker over real KV tensors, and a stand-in model runner samples one token
per step (it computes no KV: bytes a request finds in its blocks after a load can
only have come from kvtier)."""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

HEADS, HEAD = 2, 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def full_group(block_size: int = 32) -> list[KVCacheGroupSpec]:
    """One full attention group of the two layers (a plain model)."""
    return [KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS,
                                                            head_size=HEAD, dtype=torch.bfloat16))]


class SchedulerRig:
    """``groups``: vLLM's KV cache groups (default :func:`full_group`); each group's
    layers get FlashAttention-shaped KV of the group's own block size and heads, in one
    tensor per group. ``prepare_load`` and ``prepare_store`` calls are recorded
    (``loads``, ``stores``: the keys of each call)."""

    def __init__(self, model: str, host_dir: str, *, block_size: int = 32, num_blocks: int = 64,
                 blocks_per_chunk: int = 1, host_bytes: int = 8 << 20, storage: str | None = None,
                 groups: list[KVCacheGroupSpec] | None = None, max_tokens: int = 2,
                 engine_id: str | None = None) -> None:
        self.block_size, self.num_blocks, self.max_tokens = block_size, num_blocks, max_tokens
        groups = groups or full_group(block_size)
        self.layers = [n for g in groups for n in g.layer_names]
        extra = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
                 "host_bytes": host_bytes, "host_dir": host_dir, "offload_prompt_only": False}
        if storage:
            extra["storage"] = storage
        if blocks_per_chunk > 1:
            extra["block_size"] = block_size * blocks_per_chunk
        config = VllmConfig(
            model_config=ModelConfig(model=model, dtype="bfloat16", seed=0, max_model_len=4096),
            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=4096,
                                             is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                kv_connector_extra_config=extra, engine_id=engine_id),
            device_config=DeviceConfig("cpu"))
        tensors = []
        for g in groups:
            page = g.kv_cache_spec.page_size_bytes
            tensors.append(KVCacheTensor(size=page * num_blocks * len(g.layer_names), layers=list(g.layer_names),
                                         layer_stride=page * num_blocks, block_stride=page))  # layer-outermost
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
        config.cache_config.num_gpu_blocks = num_blocks
        sched_block, hash_block = resolve_kv_cache_block_sizes(kv_config, config)
        self.config = config
        self.worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_config)
        # FlashAttention-shaped per-layer KV: (num_blocks, 2, block, heads, head)
        self.kv = {n: torch.zeros(num_blocks, 2, g.kv_cache_spec.block_size, g.kv_cache_spec.num_kv_heads,
                                  g.kv_cache_spec.head_size, dtype=g.kv_cache_spec.dtype)
                   for g in groups for n in g.layer_names}
        with set_current_vllm_config(config):
            self.worker.register_kv_caches(self.kv)
        # NOTE: as in vLLM's engine, the workers' KV caches (and kvtier's pool files) exist
        # before the scheduler and its connector are built.
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=sched_block, hash_block_size=hash_block)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(hash_block, sha256)
        self._ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._next_id = 0
        self.loads: list[list] = []
        self.stores: list[list] = []
        #: request id -> per group, the last block id each of its blocks had (0: none yet)
        self.block_ids: dict[str, list[list[int]]] = {}
        manager = self.manager
        prepare_load, prepare_store = manager.prepare_load, manager.prepare_store
        manager.prepare_load = lambda keys, ctx: (self.loads.append(list(keys)), prepare_load(keys, ctx))[1]
        manager.prepare_store = lambda keys, ctx: (self.stores.append(list(keys)), prepare_store(keys, ctx))[1]

    @property
    def manager(self):
        return self.scheduler.connector.connector_scheduler.manager

    def scramble(self, seed: int) -> None:
        """New random bytes in every vLLM block (what an unrelated batch would leave)."""
        gen = torch.Generator().manual_seed(seed)
        for t in self.kv.values():
            t.view(torch.int16).copy_(torch.randint(-2**15, 2**15 - 1, t.shape, dtype=torch.int16, generator=gen))

    def blocks_of(self, req_id: str, group: int = 0) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    def block_bytes(self, block_ids: list[int], layers=LAYERS) -> list[torch.Tensor]:
        return [self.kv[n][block_ids].clone() for n in layers]

    def run(self, tokens: list[int], on_prefill=None) -> Request:
        """One request of ``tokens`` (2 generated tokens), stepped until it and its
        transfers are done. ``on_prefill(req_id)`` runs right after its prefill step."""
        req = Request(request_id=str(self._next_id), prompt_token_ids=tokens,
                      sampling_params=SamplingParams(max_tokens=self.max_tokens, temperature=0),
                      pooling_params=None, block_hasher=self._hasher)
        req.sampling_params.update_from_generation_config({}, 2)
        self._next_id += 1
        self.scheduler.add_request(req)
        connector = self.scheduler.connector.connector_scheduler
        prefilled = False
        for _ in range(self.max_tokens + 200):
            if not self.scheduler.requests and not connector._jobs and not self.scheduler.finished_req_ids:
                break
            out = self.scheduler.schedule()
            if req.request_id in self.scheduler.requests:
                self._record_blocks(req.request_id)
            meta = out.kv_connector_metadata
            self.worker.handle_preemptions(meta)
            self.worker.bind_connector_metadata(meta)
            self.worker.start_load_kv(self._ctx)
            self.worker.wait_for_save()
            sending, receiving = self.worker.get_finished(out.finished_req_ids)
            worker_meta = self.worker.build_connector_worker_meta() or OffloadingWorkerMetadata()
            self.worker.clear_connector_metadata()
            running = [r.request_id for r in self.scheduler.running if r.request_id in out.num_scheduled_tokens]
            result = ModelRunnerOutput(req_ids=running, req_id_to_index={r: i for i, r in enumerate(running)},
                                       sampled_token_ids=[[7] for _ in running],
                                       kv_connector_output=KVConnectorOutput(finished_sending=sending,
                                                                             finished_recving=receiving,
                                                                             kv_connector_worker_meta=worker_meta))
            if on_prefill is not None and not prefilled and req.request_id in running:
                prefilled = True
                on_prefill(req.request_id)
            self.scheduler.update_from_output(out, result)
        else:
            raise RuntimeError(f"the request did not finish in {self.max_tokens + 200} steps")
        return req

    def _record_blocks(self, req_id: str) -> None:
        seen = self.block_ids.setdefault(req_id, [])
        for g, ids in enumerate(self.scheduler.kv_cache_manager.get_block_ids(req_id)):
            if len(seen) <= g:
                seen.append([])
            row = seen[g]
            row.extend([0] * (len(ids) - len(row)))
            for i, b in enumerate(ids):
                if b:  # a sliding group's blocks behind the window are null (0) once freed
                    row[i] = b

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()
