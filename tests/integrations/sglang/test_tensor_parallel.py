"""Pages written by the ranks of one tensor-parallel size, read bit-exactly by another.

Each rank is its own sglang host pool holding ``heads // tp_size`` heads, attached by
its own controller with its ``tp_rank``/``tp_size``; they share one store.
"""

import pytest

pytest.importorskip("sglang.srt")

from tests.support.sglang_rig import (PAGE_SIZE, STORAGE_BATCH_SIZE, attach, backup, fill_random, kvtier_config,  # noqa: E402
                                      make_pools, prefetch, same_tokens)

HEADS = 8
PAGES = STORAGE_BATCH_SIZE + 4
TOKENS = list(range(5000, 5000 + PAGES * PAGE_SIZE))


def writers(kind, layout, url, tp_size=2):
    """``tp_size`` ranks that each back up the same prompt's pages of their own heads."""
    ranks = []
    for rank in range(tp_size):
        device, host = make_pools(kind, layout, tp_size=tp_size, heads=HEADS)
        fill_random(host, seed=100 + rank)
        controller = attach(device, host, extra_config=kvtier_config(url), tp_rank=rank, tp_size=tp_size)
        slots = host.alloc(PAGES * PAGE_SIZE)
        stored = backup(controller, slots, TOKENS) if not controller.backup_skip else 0
        ranks.append((controller, host, slots, stored))
    return ranks


def reader(kind, layout, url, rank, tp_size):
    device, host = make_pools(kind, layout, tp_size=tp_size, heads=HEADS)
    controller = attach(device, host, extra_config=kvtier_config(url), tp_rank=rank, tp_size=tp_size)
    hit, pages, slots = prefetch(controller, host, TOKENS)
    assert (hit, pages) == (PAGES * PAGE_SIZE, PAGES)
    return host, slots


@pytest.mark.parametrize("kind, write_layout, read_layout", [
    ("asym", "page_first", "page_first_direct"),
    ("mha", "page_head", "layer_first"),
    ("mha", "page_first_direct", "page_head"),
])
def test_two_ranks_at_tp2_are_read_by_tp1_and_tp4(kind, write_layout, read_layout, tmp_path):
    url = f"file://{tmp_path}"
    ranks = writers(kind, write_layout, url)
    assert [stored for *_, stored in ranks] == [PAGES * PAGE_SIZE] * 2
    per_writer = HEADS // 2
    whole, slots = reader(kind, read_layout, url, rank=0, tp_size=1)
    for w, (_, host, src, _) in enumerate(ranks):  # tp1 holds every head: writer w's are [4w, 4w + 4)
        assert same_tokens(whole, slots, host, src, heads_a=slice(w * per_writer, (w + 1) * per_writer))
    for rank in range(4):  # tp4 rank r holds heads [2r, 2r + 2): a half of writer r // 2's
        quarter, slots = reader(kind, read_layout, url, rank=rank, tp_size=4)
        _, host, src, _ = ranks[rank // 2]
        first = rank % 2 * 2
        assert same_tokens(host, src, quarter, slots, heads_a=slice(first, first + 2))


def test_mla_is_replicated_rank0_writes_and_every_rank_of_any_size_reads(tmp_path):
    url = f"file://{tmp_path}"
    ranks = writers("mla", "page_first", url)
    assert [c.backup_skip for c, *_ in ranks] == [False, True]  # sglang's own rule: one writer for MLA
    assert ranks[0][1].kv_buffer.shape[-1] == ranks[1][1].kv_buffer.shape[-1]
    _, host, src, _ = ranks[0]
    for rank in (0, 3):
        replica, slots = reader("mla", "page_unified", url, rank=rank, tp_size=4)
        assert same_tokens(host, src, replica, slots)


def test_tp_lcm_size_sets_the_head_groups_shared_by_those_sizes(tmp_path):
    url = f"file://{tmp_path}"
    lcm = kvtier_config(url, tp_lcm_size=4)
    device, host = make_pools("mha", "page_head", tp_size=2, heads=HEADS)
    fill_random(host, 7)
    writer = attach(device, host, extra_config=lcm, tp_rank=1, tp_size=2)
    assert writer.storage_config.should_split_heads
    src = host.alloc(2 * PAGE_SIZE)
    assert backup(writer, src, TOKENS[:2 * PAGE_SIZE]) == 2 * PAGE_SIZE
    device, quarter = make_pools("mha", "page_head", tp_size=4, heads=HEADS)
    controller = attach(device, quarter, extra_config=kvtier_config(url, tp_lcm_size=4), tp_rank=3, tp_size=4)
    hit, pages, dst = prefetch(controller, quarter, TOKENS[:2 * PAGE_SIZE])
    assert pages == 2 and same_tokens(host, src, quarter, dst, heads_a=slice(2, 4))
    # without the same tp_lcm_size, the objects are cut differently and not found
    device, other = make_pools("mha", "page_head", tp_size=4, heads=HEADS)
    plain = attach(device, other, extra_config=kvtier_config(url), tp_rank=3, tp_size=4)
    assert prefetch(plain, other, TOKENS[:2 * PAGE_SIZE])[:2] == (0, 0)
