"""MiMo-V2-Flash's KV cache on vLLM, without the model (it needs FlashAttention or Triton:
K and V heads of 192 and 128): vLLM's own grouping of its 48 layers (9 full attention
with 4 KV heads, 39 sliding window of 128 with 8) into 6 KV cache groups, vLLM's own
OffloadingConnector building kvtier's spec on both sides, and every group's blocks
stored and loaded back byte for byte, in one job over all groups and in a sliding
window's partial load."""

import hashlib

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import torch  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,  # noqa: E402
                         VllmConfig, set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key  # noqa: E402

from kvtier.integrations.vllm.groups import GroupedTier  # noqa: E402
from kvtier.testing.checkpoints import save_llama  # noqa: E402

FULL_LAYERS = (0, 5, 11, 17, 23, 29, 35, 41, 47)
BLOCKS = 24  # vLLM blocks of each KV cache tensor


def _layer_specs() -> dict:
    specs = {}
    for i in range(48):
        name = f"model.layers.{i}.self_attn.attn"
        if i in FULL_LAYERS:
            specs[name] = FullAttentionSpec(block_size=64, num_kv_heads=4, head_size=192, head_size_v=128,
                                            dtype=torch.bfloat16)
        else:
            specs[name] = SlidingWindowSpec(block_size=64, num_kv_heads=8, head_size=192, head_size_v=128,
                                            dtype=torch.bfloat16, sliding_window=128)
    return specs


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """vLLM's config, KV cache config and both connector roles, with random KV bytes."""
    model = save_llama(tmp_path_factory.mktemp("stand-in"), layers=2, heads=4, kv_heads=2)  # ModelConfig needs one
    host_dir = tmp_path_factory.mktemp("shm")
    extra = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
             "host_bytes": 256 << 20, "host_dir": str(host_dir)}
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", seed=0, max_model_len=4096),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=4096,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=64, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"))
    config.cache_config.kv_cache_layout = "LBNHC"  # FlashAttention's, where MiMo runs
    groups = get_kv_cache_groups(config, _layer_specs())
    page = groups[0].kv_cache_spec.page_size_bytes
    kv_config = get_kv_cache_config_from_groups(config, groups, BLOCKS * page * len(groups[0].layer_names))
    config.cache_config.num_gpu_blocks = kv_config.num_blocks
    gen = torch.Generator().manual_seed(0)
    kv = {}
    for t in kv_config.kv_cache_tensors:
        buf = torch.randint(-128, 127, (t.size,), dtype=torch.int8, generator=gen)
        for i, name in enumerate(t.layers):
            kv[name] = buf[i * t.layer_stride:(i + 1) * t.layer_stride].view(kv_config.num_blocks, t.block_stride)
    worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_config)
    with set_current_vllm_config(config):
        worker.register_kv_caches(kv)
    scheduler = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    yield config, kv_config, kv, worker, scheduler
    worker.shutdown()
    scheduler.shutdown()


def test_vllm_groups_mimo_into_one_full_and_five_sliding_groups(mimo):
    _, kv_config, _, worker, scheduler = mimo
    groups = kv_config.kv_cache_groups
    assert [(type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, len(g.layer_names)) for g in groups] == \
        [("FullAttentionSpec", 128, 9)] + [("SlidingWindowSpec", 64, n) for n in (8, 8, 8, 8, 7)]
    assert len({g.kv_cache_spec.page_size_bytes for g in groups}) == 1  # vLLM evens the pages out
    spec = worker.connector_worker.spec
    formats = spec.formats
    assert [f.page_size * f.spec.layer_num for f in formats] == [9, 8, 8, 8, 8, 7]  # opaque: one slot a block
    tier = scheduler.connector_scheduler.manager.tier
    assert isinstance(tier, GroupedTier) and len(tier.tiers) == 6
    assert len({t.key_prefix for t in tier.tiers}) == 6  # each group's keys name its own layers


def _keys(group_id: int, n: int, salt: str = "") -> list:
    return [make_offload_key(hashlib.sha256(f"{salt}{i}".encode()).digest(), group_id) for i in range(n)]


def _rows(kv, kv_config, g: int, blocks: list[int]) -> list[torch.Tensor]:
    return [kv[name][blocks].clone() for name in kv_config.kv_cache_groups[g].layer_names]


def test_every_groups_blocks_round_trip_in_one_job(mimo):
    """One store job over all 6 groups (group-major block ids, as vLLM sends them), the
    blocks wiped, one load job into other blocks: each group's layers hold exactly what
    its blocks held, and nothing of another group's."""
    _, kv_config, kv, worker, scheduler = mimo
    manager, copier = scheduler.connector_scheduler.manager, worker.connector_worker.worker
    ctx = ReqContext(req_id="r")
    sizes = [3, 2, 2, 2, 2, 2]  # a full prefix, then each sliding group's window
    src = [[g * 4 + j for j in range(n)] for g, n in enumerate(sizes)]
    dst = [[24 - 1 - (g * 4 + j) for j in range(n)] for g, n in enumerate(sizes)]
    keys = [k for g, n in enumerate(sizes) for k in _keys(g, n, "one-job")]
    before = [_rows(kv, kv_config, g, src[g]) for g in range(6)]
    out = manager.prepare_store(keys, ctx)
    assert out.keys_to_store == keys and out.store_spec.groups.tolist() == [g for g, n in enumerate(sizes)
                                                                             for _ in range(n)]
    assert copier.submit_store(1, GPULoadStoreSpec(sum(src, []), sizes, [0] * 6), out.store_spec)
    manager.complete_store(keys, ctx)
    load = manager.prepare_load(keys, ctx)
    assert copier.submit_load(2, load, GPULoadStoreSpec(sum(dst, []), sizes, [0] * 6))
    manager.complete_load(keys, ctx)
    results = copier.get_finished()
    assert [r.job_id for r in results if r.success] == [1, 2]
    page = kv_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    layers = [len(g.layer_names) for g in kv_config.kv_cache_groups]
    assert results[1].transfer_size == sum(n * m for n, m in zip(sizes, layers)) * page
    for g in range(6):
        for now, then in zip(_rows(kv, kv_config, g, dst[g]), before[g]):
            assert torch.equal(now, then), g


def test_a_sliding_groups_window_loads_alone_from_inside_its_keys(mimo):
    """blocks_per_chunk 1, a job naming only sliding group 3's window at request blocks
    5-6 (block_indices 5): the other groups' blocks are untouched."""
    _, kv_config, kv, worker, scheduler = mimo
    manager, copier = scheduler.connector_scheduler.manager, worker.connector_worker.worker
    ctx = ReqContext(req_id="w")
    keys = _keys(3, 2, "window")
    src, dst = [20, 21], [9, 10]
    before = _rows(kv, kv_config, 3, src)
    others = {g: _rows(kv, kv_config, g, dst) for g in range(6) if g != 3}
    out = manager.prepare_store(keys, ctx)
    sizes = [0, 0, 0, 2, 0, 0]
    assert copier.submit_store(3, GPULoadStoreSpec(src, sizes, [0, 0, 0, 5, 0, 0]), out.store_spec)
    manager.complete_store(keys, ctx)
    load = manager.prepare_load(keys, ctx)
    assert copier.submit_load(4, load, GPULoadStoreSpec(dst, sizes, [0, 0, 0, 5, 0, 0]))
    manager.complete_load(keys, ctx)
    copier.get_finished()
    for now, then in zip(_rows(kv, kv_config, 3, dst), before):
        assert torch.equal(now, then)
    for g, rows in others.items():  # groups of other tensors: their blocks 9-10 kept their bytes
        for now, then in zip(_rows(kv, kv_config, g, dst), rows):
            assert torch.equal(now, then), g
