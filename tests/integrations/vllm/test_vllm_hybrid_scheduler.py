"""vLLM's own scheduler and OffloadingConnector driving kvtier's spec on models of two KV
cache groups, no model weights: vLLM's two-group connector tests
(``test_two_groups_full_and_sliding_window``, ``test_two_groups_different_block_sizes``)
in kvtier's terms, with real bytes. vLLM decides which blocks of each group to store
and load (a sliding group only the window before the hit); kvtier must answer each
group's keys on their own, hand back the bytes each group stored, and never report a
group's missing block.

The stand-in model runner writes no KV, so a block holds the random bytes it was
given until the next ``scramble``: what a request finds in a loaded block can only have
come from kvtier, and must be what the block it was stored from held."""

import random

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx, make_offload_key  # noqa: E402

from kvtier import storage as kvstorage  # noqa: E402
from kvtier.integrations.vllm.groups import GroupedTier  # noqa: E402
from kvtier.testing.checkpoints import save_llama  # noqa: E402
from tests.support.vllm_scheduler_rig import HEAD, HEADS, SchedulerRig  # noqa: E402

LAYER = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")  # group 0, group 1
B = 32  # tokens per block of the first group; hash blocks


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(save_llama(tmp_path_factory.mktemp("tiny-llama"), layers=2, heads=4, kv_heads=2))


def _spec(kind=FullAttentionSpec, block=B, **kw):
    return kind(block_size=block, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16, **kw)


def _groups(*specs) -> list[KVCacheGroupSpec]:
    return [KVCacheGroupSpec([LAYER[g]], s) for g, s in enumerate(specs)]


def _blocks(req, calls, tokens_per_block=(B, B), hash_tokens=B) -> list[tuple[int, int]]:
    """(group, block) of every key in ``calls``, sorted. A key's hash is that of the
    block's last hash block."""
    out = []
    for call in calls:
        for key in call:
            g = get_offload_group_idx(key)
            h = req.block_hashes.index(get_offload_block_hash(key))
            out.append((g, (h + 1) * hash_tokens // tokens_per_block[g] - 1))
    return sorted(out)


def _same_bytes(rig, before: dict, then_ids, now_ids, blocks) -> None:
    for g, i in blocks:
        now = rig.kv[LAYER[g]][now_ids[g][i]].view(torch.int16)
        assert torch.equal(now, before[LAYER[g]][then_ids[g][i]].view(torch.int16)), (g, i)


def test_two_groups_full_and_sliding_window(tiny_model, tmp_path):
    """A full group and a sliding group of a 2-block window; a prompt of 3 blocks and a
    token, decoded to 7 blocks. vLLM stores the full group's blocks and, of the sliding
    group, the window before the prompt's resume point. After the GPU prefix cache is
    reset, the same prompt loads blocks 0-2 of the full group and only the window 1-2
    of the sliding one. A prompt one block longer (its first 3 blocks on the GPU) loads
    block 3 of each group only if the sliding group stored it: a missing block of one
    group is never a hit. Loaded bytes are what the first request's blocks held."""
    groups = _groups(_spec(), _spec(SlidingWindowSpec, sliding_window=2 * B))
    rig = SchedulerRig(tiny_model, str(tmp_path), groups=groups, max_tokens=4 * B - 1)
    tier = rig.manager.tier
    assert isinstance(tier, GroupedTier) and len(tier.tiers) == 2
    prompt = [random.Random(1).randrange(3, 400) for _ in range(3 * B + 1)]
    rig.scramble(1)
    before = {n: t.clone() for n, t in rig.kv.items()}
    first = rig.run(prompt)
    stored = _blocks(first, rig.stores)
    full = [i for g, i in stored if g == 0]
    sliding = [i for g, i in stored if g == 1]
    assert full == list(range(6))  # 7 blocks; the last one's final slot is never computed
    assert {1, 2} <= set(sliding) and set(sliding) <= set(full)
    assert tier.tiers[0].stats["stored"] == 6 and tier.tiers[1].stats["stored"] == len(sliding)

    assert rig.scheduler.reset_prefix_cache()
    rig.scramble(2)
    rig.loads.clear()
    second = rig.run(prompt)
    assert _blocks(second, rig.loads) == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2)]
    _same_bytes(rig, before, rig.block_ids[first.request_id], rig.block_ids[second.request_id],
                _blocks(second, rig.loads))

    rig.loads.clear()
    third = rig.run(prompt + [7] * (B - 1) + [5])  # the stand-in runner samples 7
    expect = [(0, 3), (1, 3)] if 3 in sliding else []
    assert _blocks(third, rig.loads) == expect
    _same_bytes(rig, before, rig.block_ids[first.request_id], rig.block_ids[third.request_id], expect)
    rig.shutdown()


def test_two_groups_different_block_sizes(tiny_model, tmp_path):
    """Two full groups of 48- and 64-token blocks over 16-token hashes (vLLM's test at 4x
    its sizes). Every complete block of each group is stored; after a reset, a 192-token prompt
    loads 4 blocks of the first group and 3 of the second, and a 340-token one whose
    first 192 tokens are on the GPU loads blocks 4-6 and 3-4: each group's own blocks,
    holding the bytes stored from them."""
    sizes = (48, 64)
    rig = SchedulerRig(tiny_model, str(tmp_path), block_size=16, groups=_groups(*(_spec(block=b) for b in sizes)),
                       max_tokens=384 - 100)
    prompt = [random.Random(2).randrange(3, 400) for _ in range(100)]
    rig.scramble(1)
    before = {n: t.clone() for n, t in rig.kv.items()}
    first = rig.run(prompt)
    stored = _blocks(first, rig.stores, sizes, hash_tokens=16)
    for g, size in enumerate(sizes):
        blocks = [i for h, i in stored if h == g]
        assert blocks == list(range((384 - 1) // size)), (g, blocks)  # the last token's slot is never computed
        assert rig.manager.tier.tiers[g].stats["stored"] == len(blocks)
    sequence = prompt + [7] * (384 - 100)

    assert rig.scheduler.reset_prefix_cache()
    rig.scramble(2)
    rig.loads.clear()
    second = rig.run(sequence[:192])
    loaded = _blocks(second, rig.loads, sizes, hash_tokens=16)
    assert loaded == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]
    _same_bytes(rig, before, rig.block_ids[first.request_id], rig.block_ids[second.request_id], loaded)

    rig.loads.clear()
    third = rig.run(sequence[:340])
    loaded = _blocks(third, rig.loads, sizes, hash_tokens=16)
    assert loaded == [(0, 4), (0, 5), (0, 6), (1, 3), (1, 4)]
    _same_bytes(rig, before, rig.block_ids[first.request_id], rig.block_ids[third.request_id], loaded)
    rig.shutdown()


def test_a_sliding_blocks_missing_object_stops_the_storage_hit_before_it(tiny_model, tmp_path):
    """Storage holds two prompts' blocks: the full group's whole prefix, the sliding
    group's windows before each prompt's resume point (blocks 2-3 and 4-5). A new
    engine finds all 6 blocks. Once the sliding group's object of block 5 is gone,
    another engine's hit stops before it, at the last whole window (blocks 3-4), though
    the full group still has all 6 there. Every loaded block holds what was stored."""
    url = f"file://{tmp_path / 'store'}"
    groups = lambda: _groups(_spec(), _spec(SlidingWindowSpec, sliding_window=2 * B))  # noqa: E731
    prompt = [random.Random(3).randrange(3, 400) for _ in range(6 * B + 1)]
    writer = SchedulerRig(tiny_model, str(tmp_path), groups=groups(), storage=url, engine_id="writer")
    writer.scramble(1)
    before = {n: t.clone() for n, t in writer.kv.items()}
    short = writer.run(prompt[:4 * B] + [1])
    long = writer.run(prompt)
    stored = sorted(set(_blocks(long, writer.stores)))  # the long prompt offers the shared blocks again
    assert [i for g, i in stored if g == 1] == [2, 3, 4, 5]
    assert writer.manager.tier.flush(10)
    assert writer.manager.tier.stats["written"] == len(stored)
    written_ids = {0: writer.block_ids[long.request_id][0], 1: writer.block_ids[long.request_id][1]}
    for i in (2, 3):  # the short prompt's sliding window blocks sit in its own request's blocks
        written_ids[1][i] = writer.block_ids[short.request_id][1][i]
    sliding_tier = writer.manager.tier.tiers[1]
    key5 = make_offload_key(long.block_hashes[5], 1)
    writer.shutdown()

    def hit(engine_id: str) -> list[tuple[int, int]]:
        rig = SchedulerRig(tiny_model, str(tmp_path), groups=groups(), storage=url, engine_id=engine_id)
        rig.scramble(2)
        req = rig.run(prompt)
        loaded = _blocks(req, rig.loads)
        _same_bytes(rig, before, written_ids, rig.block_ids[req.request_id], loaded)
        assert rig.manager.tier.stats["fetched"] >= len(loaded)
        rig.shutdown()
        return loaded

    assert hit("reader-1") == [(0, i) for i in range(6)] + [(1, 4), (1, 5)]
    store = kvstorage.open(url)
    objects = sliding_tier.storage_keys(key5)
    assert store.exists_each(objects) == [True] * len(objects)
    store.delete(objects)
    assert store.exists_each(objects) == [False] * len(objects)
    store.close()
    # blocks 3-4 are a whole window before block 5: the hit ends there, at 5 blocks
    assert hit("reader-2") == [(0, i) for i in range(5)] + [(1, 3), (1, 4)]
