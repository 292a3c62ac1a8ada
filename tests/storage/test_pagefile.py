"""The file format's bounds: the longest object name and the header room a geometry
needs are exact (every field a writer of any tensor-parallel size can write fits, the
longest meets the bound), and a key is refused exactly when its longest name would not
fit the header's 16-bit name length."""

from __future__ import annotations

import pytest
import torch

import kvtier.storage
from kvtier import Component, HostKVPool, KVSpec
from kvtier.errors import CorruptObject
from kvtier.storage.codec import MAX_NAME_BYTES
from kvtier.storage.objects import PagePlan
from kvtier.storage.pagefile import ALIGN, HEAD, LAYER, SLOT, SPLIT, FileLayout, field_parts, file_field, \
    header_room, longest_name
from tests.support.storage import blank_host, filled_host, flat_pages

GEOMETRIES = {
    "mha 8 groups": KVSpec.mha(2, 8, 16),
    "asym 12 groups": KVSpec.mha(2, 12, 24, v_head_dim=16),
    "mla (rep only)": KVSpec.mla(2, kv_lora_rank=16, qk_rope_head_dim=4),
    "groups + rep": KVSpec(2, (Component("k", 4, 8), Component("v", 4, 4), Component("idx", 1, 6)), torch.float32),
}


def _writer_fields(spec: KVSpec, page_size: int, head_groups: int | None = None):
    """Every file a writer of each tensor-parallel size writes, in each order its pool's
    layout can write it: ``(field, part sizes, order)``."""
    plan = PagePlan(spec, page_size, head_groups)
    for size in range(1, plan.groups + 1):
        if plan.groups % size or (size > 1 and not any(c.head_num > 1 for c in spec.components)):
            continue
        for rank in range(size):
            shard = PagePlan(spec.shard(rank, size) if size > 1 else spec, page_size, plan.groups)
            field = file_field(shard, shard.write_parts)
            for order in (HEAD, SLOT, LAYER, SPLIT):
                parts = field_parts(plan, field.rsplit("/", 1)[1], order)
                yield field, [n for _, n in parts], order


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_the_bounds_are_those_of_the_files_writers_write(name):
    """Over the files writers of every tensor-parallel size write (built by the store's
    own ``file_field`` and ``FileLayout``), the longest name and the largest header are
    exactly the bounds: each fits, and the largest meets them."""
    spec, key = GEOMETRIES[name], "k" * 40
    for head_groups in (None, 1):
        plan = PagePlan(spec, 16, head_groups)
        names, headers = [], []
        for field, sizes, order in _writer_fields(spec, 16, head_groups):
            names.append(len(f"{key}#{field}".encode()))
            headers.append(FileLayout(f"{key}#{field}", sizes, order).header_len)
        assert max(names) == longest_name(len(key), plan)
        assert max(headers) == header_room(len(key), plan)
        for key_bytes in (0, *range(3800, 4100, 4)):  # across a header block boundary: each order's in turn
            big = [FileLayout("k" * key_bytes + f"#{f}", s, o).header_len
                   for f, s, o in _writer_fields(spec, 16, head_groups)]
            assert max(big) == header_room(key_bytes, plan)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_a_part_per_component_header_one_block_past_head_order_round_trips_on_both_paths(tmp_path, monkeypatch,
                                                                                          layout):
    """A store of one head group writes ``page_first``/``page_first_direct`` pages with a
    checksum per component (two here), head order with one: a key whose head-order
    header fills its 4 KiB block exactly needs a second block in these orders. Both
    paths write it and read it back bit-exactly, each the other's file too; before,
    the pure path had room for one block only: its writes failed, and it counted the
    compiled path's files corrupt and deleted them."""
    spec = KVSpec.mha(2, 2, 8)
    field = file_field(PagePlan(spec, 4, 1), PagePlan(spec, 4, 1).write_parts)
    key = "n/" + "a" * (ALIGN - 26 - 1 - len(field) - 8 - 2)  # a head-order header of ALIGN bytes
    assert FileLayout(f"{key}#{field}", [1]).header_len == ALIGN
    assert FileLayout(f"{key}#{field}", [1, 1], SLOT).header_len == 2 * ALIGN
    host, idx = filled_host(spec, 1, layout=layout, seed=3)
    for writer, reader in (("1", "0"), ("0", "1"), ("0", "0")):
        store = kvtier.storage.open(f"file://{tmp_path / (writer + reader)}", head_groups=1)
        monkeypatch.setenv("KVTIER_NATIVE", writer)
        assert store.batch_set([key], host, idx) == [True]
        monkeypatch.setenv("KVTIER_NATIVE", reader)
        back, back_idx = blank_host(spec, 4, layout=layout)
        assert store.batch_get([key], back, back_idx) == [True]
        assert torch.equal(flat_pages(back, back_idx)[0], flat_pages(host, idx)[0])
        assert (store.stats()["errors"], store.stats()["corrupt"]) == (0, 0)


def test_a_key_is_refused_exactly_when_its_longest_name_would_not_fit(tmp_path):
    spec = KVSpec.mha(1, 2, 8)
    plan = PagePlan(spec, 4)
    store = kvtier.storage.open(f"file://{tmp_path}")
    pool = HostKVPool(spec, 8, 4)
    room = MAX_NAME_BYTES - longest_name(0, plan)
    assert store.batch_set(["x" * room], pool, torch.arange(4)) == [True]
    with pytest.raises(ValueError, match=f"up to {MAX_NAME_BYTES + 1} bytes"):
        store.batch_set(["x" * (room + 1)], pool, torch.arange(4))


def test_a_renamed_layout_is_the_one_built_for_that_name():
    """``renamed`` (the store's shortcut for files of one field) gives the header,
    offsets and checks of a layout built for the new name; a name of another length
    (another header) is refused."""
    sizes = [5000, 300, 4096]
    first, second = "key-1#fp/p16/g0-2of2+rep", "key-2#fp/p16/g0-2of2+rep"
    renamed, built = FileLayout(first, sizes).renamed(second), FileLayout(second, sizes)
    assert (renamed.offsets, renamed.total, renamed.header_len) == (built.offsets, built.total, built.header_len)
    sums = [1, 2, 3]
    assert renamed.header(sums) == built.header(sums) != FileLayout(first, sizes).header(sums)
    assert renamed.checksums(built.header(sums)) == (1, 2, 3)
    with pytest.raises(CorruptObject):
        renamed.checksums(FileLayout(first, sizes).header(sums))
    with pytest.raises(ValueError, match="a name of 25 bytes for a layout of 24"):
        FileLayout(first, sizes).renamed("key-10#fp/p16/g0-2of2+rep")
