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
from kvtier.storage.pagefile import FileLayout, file_field, header_room, longest_name

GEOMETRIES = {
    "mha 8 groups": KVSpec.mha(2, 8, 16),
    "asym 12 groups": KVSpec.mha(2, 12, 24, v_head_dim=16),
    "mla (rep only)": KVSpec.mla(2, kv_lora_rank=16, qk_rope_head_dim=4),
    "groups + rep": KVSpec(2, (Component("k", 4, 8), Component("v", 4, 4), Component("idx", 1, 6)), torch.float32),
}


def _writer_fields(spec: KVSpec, page_size: int):
    """Every file a writer of each tensor-parallel size writes: ``(field, part sizes)``."""
    plan = PagePlan(spec, page_size)
    for size in range(1, plan.groups + 1):
        if plan.groups % size or (size > 1 and not any(c.head_num > 1 for c in spec.components)):
            continue
        for rank in range(size):
            shard = PagePlan(spec.shard(rank, size) if size > 1 else spec, page_size, plan.groups)
            yield file_field(shard, shard.write_parts), [p.nbytes for p in shard.write_parts]


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_the_bounds_are_those_of_the_files_writers_write(name):
    """Over the files writers of every tensor-parallel size write (built by the store's
    own ``file_field`` and ``FileLayout``), the longest name and the largest header are
    exactly the bounds: each fits, and the largest meets them."""
    spec, key = GEOMETRIES[name], "k" * 40
    plan = PagePlan(spec, 16)
    names, headers = [], []
    for field, sizes in _writer_fields(spec, 16):
        names.append(len(f"{key}#{field}".encode()))
        headers.append(FileLayout(f"{key}#{field}", sizes).header_len)
    assert max(names) == longest_name(len(key), plan)
    assert max(headers) == header_room(len(key), plan)
    for key_bytes in (0, 4000, 4096 - 26):  # across a header block boundary too
        big = [FileLayout("k" * key_bytes + f"#{f}", s).header_len for f, s in _writer_fields(spec, 16)]
        assert max(big) == header_room(key_bytes, plan)


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
