"""Mooncake Store backend: zero-copy specifics and a master that goes away."""

import pytest
import torch

import kvtier.storage
from kvtier import HostKVPool, UnsupportedLayoutError
from helpers import SPECS
from services import MooncakeMaster
from storage_helpers import filled_host, flat_pages

SPEC = SPECS["asym"]


def keys_for(n):
    return kvtier.storage.page_keys(list(range(4 * n)), 4, namespace="mc")


@pytest.fixture
def store(mooncake_master):
    s = kvtier.storage.open(mooncake_master.url, prefix="mc-test/")
    yield s
    s.clear()
    s.close()


def test_other_layouts_never_read_raw_bytes_of_another_format(store):
    host, idx = filled_host(SPEC, 2, layout="page_first")
    assert store.batch_set(keys_for(2), host, idx) == [True, True]
    for layout in ("layer_first", "page_first_direct", "page_head"):
        other = HostKVPool(SPEC, 8, 4, layout=layout)
        assert store.batch_get(keys_for(2), other, other.alloc(8)) == [False, False]
    same = HostKVPool(SPEC, 8, 4, layout="page_first")
    sidx = same.alloc(8)
    assert store.batch_get(keys_for(2), same, sidx) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(host, idx), flat_pages(same, sidx)))


def test_shard_without_split_heads_layout_is_a_named_error(store):
    shard = HostKVPool(SPEC.shard(0, 2), 8, 4, layout="page_first")
    with pytest.raises(UnsupportedLayoutError, match="page_head"):
        store.batch_set(keys_for(2), shard, shard.alloc(8))


def test_master_down_gives_misses_not_exceptions():
    master = MooncakeMaster().start()
    try:
        store = kvtier.storage.open(master.url, prefix="down/")
        host, idx = filled_host(SPEC, 2, layout="page_head")
        assert store.batch_set(keys_for(2), host, idx) == [True, True]
        master.stop()
        assert store.batch_exists(keys_for(2)) == 0
        assert store.batch_get(keys_for(2), host, idx) == [False, False]
        assert store.batch_set(keys_for(2), host, idx) == [False, False]
        store.delete(keys_for(2))
        assert store.stats()["errors"] >= 3
        store.close()
    finally:
        master.stop()


def test_unreachable_master_at_open_is_counted_and_retried_later():
    from services import free_port

    store = kvtier.storage.open(f"mooncake://127.0.0.1:{free_port()}?protocol=tcp&metadata=P2PHANDSHAKE",
                                connect_timeout=0.5)
    host, idx = filled_host(SPEC, 1, layout="page_head")
    assert store.batch_set(keys_for(1), host, idx) == [False]
    assert store.batch_exists(keys_for(1)) == 0
    assert store.stats()["errors"] >= 1
    store.close()


def test_bad_urls(mooncake_master):
    with pytest.raises(ValueError, match="host:port"):
        kvtier.storage.open("mooncake://?metadata=x")
    with pytest.raises(ValueError, match="unknown options"):
        kvtier.storage.open(mooncake_master.url + "&colour=blue")
