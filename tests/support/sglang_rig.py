"""sglang's own classes on the CPU: device and host KV pools, and a HiCacheController
whose storage backend is attached by its own ``attach_storage_backend``.

The host pools get the constructor arguments sglang's ``build_kv_host_pool`` gives
them (its published server configuration is not needed for that). The controller's
storage threads are stopped after the attach so that each test drives the storage
methods (``_page_backup``, ``_storage_hit_query``, ``_page_transfer``) itself, on its
own thread, in the controller's batches of ``STORAGE_BATCH_SIZE`` pages.
"""

from __future__ import annotations

import threading

import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import (AsymmetricMHATokenToKVPoolHost, MHATokenToKVPoolHost,
                                                get_mha_host_pool_cls)
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import _CONTEXT, get_parallel

PAGE_SIZE = 4
LAYERS = 3
DTYPE = torch.bfloat16

# (token, layer, head, dim) views of one component buffer, restated from sglang's
# init_kv_buffer dims independently of kvtier's mapping.
TOKEN_MAJOR = {
    "layer_first": lambda b: b.permute(1, 0, 2, 3),                                   # (layer, size, head, dim)
    "page_first": lambda b: b,                                                         # (size, layer, head, dim)
    "page_first_direct": lambda b: b.permute(0, 2, 1, 3, 4).flatten(0, 1),             # (page, layer, slot, head, dim)
    "page_head": lambda b: b.permute(0, 2, 3, 1, 4).flatten(0, 1),                     # (page, head, slot, layer, dim)
    "page_unified": lambda b: b.permute(0, 2, 1, 3).flatten(0, 1).unsqueeze(2),        # MLA: (page, layer, slot, dim)
}


class _Allocator:
    """The one method the controller asks of the device allocator."""

    def __init__(self, device_pool) -> None:
        self.device_pool = device_pool

    def get_kvcache(self):
        return self.device_pool


def mha_pools(layout: str, head_num: int = 2, head_dim: int = 16, v_head_dim: int = 8, tokens: int = 1024,
              start_layer: int = 0):
    """sglang's MHA device pool (layers ``start_layer`` on: a pipeline stage) and the host
    pool class sglang picks for it (``AsymmetricMHATokenToKVPoolHost`` when
    ``head_dim != v_head_dim``)."""
    device = MHATokenToKVPool(size=tokens, page_size=PAGE_SIZE, dtype=DTYPE, head_num=head_num, head_dim=head_dim,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False, v_head_dim=v_head_dim,
                              start_layer=start_layer, end_layer=start_layer + LAYERS)
    info = device.get_device_pool_infos()[0].buffer_info
    host = get_mha_host_pool_cls(info)(
        info, 2.0, 0, PAGE_SIZE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer)
    return device, host


def mla_pools(layout: str, kv_lora_rank: int = 32, qk_rope_head_dim: int = 8, tokens: int = 1024):
    device = MLATokenToKVPool(size=tokens, page_size=PAGE_SIZE, dtype=DTYPE, kv_lora_rank=kv_lora_rank,
                              qk_rope_head_dim=qk_rope_head_dim, layer_num=LAYERS, device="cpu",
                              enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    host = MLATokenToKVPoolHost(
        info, 2.0, 0, PAGE_SIZE, layout, pin_memory=False, device="cpu", override_kv_cache_dim=device.kv_cache_dim,
        device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer,
        target_layer_num=device.layer_num)
    return device, host


def make_pools(kind: str, layout: str, tp_size: int = 1, heads: int = 2):
    """``kind``: ``mha`` (K and V 16 wide), ``asym`` (K 16, V 8: MiMo-V2-Flash's 192/128
    in small) or ``mla``; MHA pools hold ``heads // tp_size`` heads, as one rank of
    ``tp_size`` does."""
    if kind == "mla":
        return mla_pools(layout)
    return mha_pools(layout, head_num=heads // tp_size, v_head_dim=16 if kind == "mha" else 8)


#: Every host pool sglang 0.5.23 builds for these models (the asymmetric pool class
#: refuses layer_first and page_head; MLA refuses page_head).
POOLS = [("mha", lay) for lay in ("layer_first", "page_first", "page_first_direct", "page_head")] + \
        [("asym", lay) for lay in ("page_first", "page_first_direct")] + \
        [("mla", lay) for lay in ("layer_first", "page_first", "page_first_direct", "page_unified")]


def components(host) -> dict:
    """The host pool's buffer of each component, as sglang allocated it."""
    if hasattr(host, "kv_lora_rank"):
        return {"kv": host.kv_buffer}
    return {"k": host.k_buffer, "v": host.v_buffer}


def token_major(host, name: str) -> torch.Tensor:
    """``(token, layer, head, dim)`` view of one component of an sglang host pool."""
    return TOKEN_MAJOR[host.layout](components(host)[name])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def fill_random(host, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in components(host).values():
        bits(buf).copy_(torch.randint(-2 ** 15, 2 ** 15, buf.shape, generator=gen, dtype=torch.int32).to(torch.int16))


def same_tokens(host_a, slots_a, host_b, slots_b, heads_a: slice = slice(None)) -> bool:
    """Whether heads ``heads_a`` of ``host_a``'s tokens ``slots_a`` hold bit for bit what
    ``host_b``'s tokens ``slots_b`` hold, every layer and component."""
    return all(torch.equal(bits(token_major(host_a, n)[slots_a][:, :, heads_a]), bits(token_major(host_b, n)[slots_b]))
               for n in components(host_a))


def kvtier_config(url: str, **extra) -> dict:
    return {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KVTierStorage",
            "interface_v1": 1, "url": url, **extra}


def attach(device, host, backend: str = "dynamic", extra_config: dict | None = None, tp_rank: int = 0,
           tp_size: int = 1, model_name: str | None = "tiny-model", pp_rank: int = 0,
           pp_size: int = 1) -> HiCacheController:
    """A controller over ``device``/``host`` whose storage backend sglang's own
    ``attach_storage_backend`` created (``StorageBackendFactory``, then
    ``register_mem_pool_host``), with this rank's tensor-parallel place."""
    controller = HiCacheController(_Allocator(device), host, PAGE_SIZE, tp_group=None,
                                   load_cache_event=threading.Event(), io_backend="direct")
    with get_parallel().override(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_dcp_size=1,
                                 attn_dcp_rank=0):
        controller.attach_storage_backend(backend, model_name=model_name,
                                          storage_backend_extra_config=dict(extra_config or {}))
    controller._stop_storage_threads()
    return controller


def page_keys(tokens: list[int]) -> list[str]:
    """sglang's own page hashes of ``tokens``, as its hit query computes them."""
    return get_storage_hash_str(tokens, None, page_size=PAGE_SIZE)


def backup(controller, host_slots: torch.Tensor, tokens: list[int]) -> int:
    """The controller's ``_page_backup`` of these host tokens; tokens it stored."""
    operation = StorageOperation(host_slots, tokens, hash_value=page_keys(tokens), prefix_keys=[])
    controller._page_backup(operation)
    return operation.completed_tokens


def prefetch(controller, host, tokens: list[int]) -> tuple[int, int, torch.Tensor]:
    """The controller's hit query, then ``_page_transfer`` of the hit into freshly
    allocated host slots: ``(hit tokens, transferred pages, those host slots)``."""
    operation = PrefetchOperation("request", tokens, prefix_keys=[])
    hashes, hit_tokens = controller._storage_hit_query(operation)
    slots = host.alloc(hit_tokens) if hit_tokens else torch.empty(0, dtype=torch.int64)
    operation.host_indices, operation.hash_value = slots, hashes
    pages = controller._page_transfer(operation) if hashes else 0
    return hit_tokens, pages, slots


def device_pool(head_num=4, head_dim=16, v_head_dim=8, tokens=256, device="cpu"):
    """sglang's MHA device pool, ``LAYERS`` layers of ``DTYPE`` (asymmetric K/V by default)."""
    return MHATokenToKVPool(size=tokens, page_size=PAGE_SIZE, dtype=DTYPE, head_num=head_num, head_dim=head_dim,
                            layer_num=LAYERS, device=device, enable_memory_saver=False, v_head_dim=v_head_dim,
                            start_layer=0, end_layer=LAYERS)


def build_host_pool(layout, kv_pool):
    """The host pool sglang's ``build_kv_host_pool`` makes for ``kv_pool``."""
    with _CONTEXT.override_server_args(hicache_ratio=2.0, hicache_size=0, hicache_mem_layout=layout), \
            get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):
        return hybrid_pool_assembler.build_kv_host_pool(kv_pool=kv_pool, page_size=PAGE_SIZE)


def pools(layout, **geometry):
    """sglang's device pool (``device_pool(**geometry)``) and the host pool sglang builds for it."""
    device = device_pool(**geometry)
    return device, build_host_pool(layout, device)


def sglang_pool(layout, device):
    """sglang's own host pool for ``device`` (unpinned: this machine has no CUDA)."""
    info = device.get_device_pool_infos()[0].buffer_info
    cls = AsymmetricMHATokenToKVPoolHost if info.head_dim != info.v_head_dim else MHATokenToKVPoolHost
    return cls(info, 2.0, 0, PAGE_SIZE, layout, pin_memory=False, device="cpu", device_capacity_tokens=device.size,
               start_layer=device.start_layer, end_layer=device.end_layer)


__all__ = ["PAGE_SIZE", "POOLS", "STORAGE_BATCH_SIZE", "attach", "backup", "build_host_pool", "device_pool",
           "fill_random", "kvtier_config", "make_pools", "mha_pools", "mla_pools", "page_keys", "pools", "prefetch",
           "same_tokens", "sglang_pool", "token_major"]
