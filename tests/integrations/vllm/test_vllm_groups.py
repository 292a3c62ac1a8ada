"""The host tier of a hybrid model without vLLM's scheduler: one HostTier per KV cache
group behind GroupedTier, and the worker splitting jobs by group. Groups have other
geometries (here 2 and 4 KV heads, 32- and 64-token blocks), their own pages, LRU and
pins; a job's block ids come group by group; bytes land in their own group's pool."""

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import torch  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402

from kvtier import HostKVPool  # noqa: E402
from kvtier.integrations.vllm import KVTierOffloadingManager, KVTierOffloadingWorker  # noqa: E402
from kvtier.integrations.vllm.blocks import Geometry, block_format  # noqa: E402
from kvtier.integrations.vllm.groups import GroupedTier  # noqa: E402
from kvtier.integrations.vllm.tier import HostTier  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerGroup, block_pages  # noqa: E402
from tests.support.vllm_rig import LAYERS, context, keys  # noqa: E402

GEOMETRIES = (Geometry("CPU_ATTN", "LBHNC", False, 2, 32, 32, torch.bfloat16),
              Geometry("CPU_ATTN", "LBHNC", False, 4, 32, 64, torch.bfloat16))
GROUP_IDS = (0, 3)  # vLLM's group indices need not be positions


class HybridRig:
    """Two groups: KV rows of 16 blocks per layer each, host pools of ``pages[g]``."""

    def __init__(self, pages=(4, 4), seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.rows, groups, tiers = [], [], []
        for g, geo in enumerate(GEOMETRIES):
            page_bytes = 2 * geo.block_tokens * geo.num_kv_heads * geo.head_size * 2
            fmt = block_format(geo, LAYERS, page_bytes)
            assert fmt.canonical
            rows = [torch.randint(-128, 127, (16, page_bytes), dtype=torch.int8, generator=gen) for _ in range(LAYERS)]
            pool = HostKVPool(fmt.spec, pages[g] * fmt.page_size, fmt.page_size, layout="page_head")
            self.rows.append(rows)
            groups.append(WorkerGroup(pool, fmt, rows))
            tiers.append(HostTier([pool], fmt, key_prefix=f"test/g{g}"))
        self.tier = GroupedTier(tiers, GROUP_IDS)
        self.manager = KVTierOffloadingManager(lambda: self.tier)
        self.worker = KVTierOffloadingWorker(groups)

    def blocks(self, g, ids):
        return [r[ids].clone() for r in self.rows[g]]


def _keys(names, g):
    return keys(*names, group=GROUP_IDS[g])


def test_one_job_over_both_groups_round_trips_each_groups_bytes():
    rig = HybridRig()
    ks = _keys("a", 0) + _keys("a", 1) + _keys("b", 1)  # the same hash in two groups: two blocks
    src, dst = [[1], [2, 3]], [[9], [10, 11]]
    before = [rig.blocks(g, src[g]) for g in (0, 1)]
    out = rig.manager.prepare_store(ks, context())
    assert out.keys_to_store == ks and out.store_spec.groups.tolist() == [0, 1, 1]
    assert rig.worker.submit_store(1, GPULoadStoreSpec(src[0] + src[1], [1, 2], [0, 0]), out.store_spec)
    rig.manager.complete_store(ks, context())
    assert [t.stats["stored"] for t in rig.tier.tiers] == [1, 2] and rig.tier.stats["stored"] == 3
    spec = rig.manager.prepare_load(ks, context())
    assert rig.worker.submit_load(2, spec, GPULoadStoreSpec(dst[0] + dst[1], [1, 2], [0, 0]))
    rig.manager.complete_load(ks, context())
    for g in (0, 1):
        for now, then in zip(rig.blocks(g, dst[g]), before[g]):
            assert torch.equal(now, then)
    sizes = [r.transfer_size for r in rig.worker.get_finished()]
    assert sizes == [sum(n * rig.rows[g][0].shape[1] * LAYERS for g, n in enumerate((1, 2)))] * 2


def test_pinned_pages_of_one_group_never_stop_the_other_groups_stores():
    rig = HybridRig(pages=(2, 2))
    full = _keys("a", 0) + _keys("b", 0)
    rig.manager.prepare_store(full, context())  # group 0's pages are all being stored (pinned)
    ks = _keys("c", 0) + _keys("c", 1)
    out = rig.manager.prepare_store(ks, context())
    assert out.keys_to_store == _keys("c", 1) and out.store_spec.groups.tolist() == [1]
    assert rig.manager.prepare_store(_keys("d", 0), context()) is None  # no group could take any
    rig.manager.complete_store(full, context())
    rig.manager.complete_store(ks, context())
    assert rig.tier.lookup(_keys("c", 0)[0]).name == "MISS" and rig.tier.lookup(_keys("c", 1)[0]).name == "HIT"


def test_each_group_evicts_its_own_least_recent_blocks():
    rig = HybridRig(pages=(2, 2))
    for names, g in ((("a", "b"), 0), (("x", "y"), 1)):
        ks = _keys(names, g)
        rig.manager.prepare_store(ks, context())
        rig.manager.complete_store(ks, context())
    out = rig.manager.prepare_store(_keys("c", 0), context())
    assert out.evicted_keys == _keys("a", 0)  # group 0's oldest, not group 1's
    assert [rig.tier.lookup(k).name for k in _keys(("x", "y"), 1)] == ["HIT", "HIT"]
    assert rig.tier.usage()["used"] == pytest.approx(1.0)


def test_pins_follow_the_key_order_across_groups():
    rig = HybridRig()
    ks = _keys(("a", "b"), 0) + _keys(("a", "b"), 1)
    out = rig.manager.prepare_store(ks, context())
    page = {k: int(p) for k, p in zip(out.keys_to_store, out.store_spec.pages)}
    rig.manager.complete_store(ks, context())
    order = [ks[3], ks[0], ks[2], ks[1]]
    spec = rig.manager.prepare_load(order, context())
    assert spec.pages.tolist() == [page[k] for k in order] and spec.groups.tolist() == [1, 0, 1, 0]



def test_a_load_one_group_refuses_pins_nothing_in_the_others():
    """A load whose blocks one group cannot pin (not READY there) raises and leaves no
    pin in the groups before it: their blocks stay evictable (before, they stayed pinned
    for good, no ``complete_load`` to come)."""
    rig = HybridRig()
    ready, missing = _keys(("a",), 0), _keys(("b",), 1)
    rig.manager.prepare_store(ready, context())
    rig.manager.complete_store(ready, context())
    with pytest.raises(ValueError, match="not ready"):
        rig.manager.prepare_load(ready + missing, context())
    assert [t.pins() for t in rig.tier.tiers] == [0, 0]

def test_a_key_of_a_group_vllm_never_gave_is_refused():
    rig = HybridRig()
    with pytest.raises(ValueError, match="KV cache group 7; this engine's groups are \\[0, 3\\]"):
        rig.tier.lookup(keys("a", group=7)[0])


def test_block_pages_splits_jobs_by_group_and_checks_them():
    pages = np.arange(10)  # 5 keys of 2 vLLM blocks each: groups 0, 0, 1, 1, 1
    groups = np.array([0, 0, 1, 1, 1])
    spec = GPULoadStoreSpec([7, 8, 9, 1, 2, 3, 4], group_sizes=[3, 4], block_indices=[1, 3])
    (g0, b0, h0), (g1, b1, h1) = block_pages(spec, pages, 2, groups)
    assert (g0, b0.tolist(), h0.tolist()) == (0, [7, 8, 9], [1, 2, 3])  # starts inside its first key
    assert (g1, b1.tolist(), h1.tolist()) == (1, [1, 2, 3, 4], [5, 6, 7, 8])  # and ends inside its last
    with pytest.raises(ValueError, match="group 1: 7 vLLM blocks .skipping 0. for 6 host pages"):
        block_pages(GPULoadStoreSpec([0] * 10, [3, 7], [1, 0]), pages, 2, groups)
    with pytest.raises(ValueError, match="offloaded blocks of groups \\[1\\] in a job over 1 groups"):
        block_pages(GPULoadStoreSpec([0] * 4, [4], [0]), pages, 2, groups)
    only_one = block_pages(GPULoadStoreSpec([5, 6, 7], [0, 3], [0, 0]), pages[4:8], 2, np.array([1, 1]))
    assert [(g, b.tolist(), h.tolist()) for g, b, h in only_one] == [(1, [5, 6, 7], [4, 5, 6])]  # group 0 moves none
