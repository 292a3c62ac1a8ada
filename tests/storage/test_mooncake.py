"""Mooncake Store backend: zero-copy specifics and a master that goes away."""

import pytest
import torch

import kvtier.storage
from kvtier import HostKVPool, UnsupportedLayoutError
from tests.support.pools import SPECS
from tests.support.services import MooncakeMaster
from tests.support.storage import filled_host, flat_pages

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



def test_an_object_of_another_size_misses_its_page_and_no_other(store):
    """An object of another size under a page's name is that page's miss and one counted
    error; every other page is served at once (before, its code opened the breaker and
    every page missed for ``backoff`` seconds). A service fault still opens it:
    test_master_down_gives_misses_not_exceptions."""
    host, idx = filled_host(SPEC, 2, layout="page_head")
    keys = keys_for(2)
    assert store.batch_set(keys, host, idx) == [True, True]
    _, names, _, sizes, _ = store._batch(keys[:1], host, idx[:4], writing=False)
    client = store.client()
    client.remove(names[0])
    assert client.put(names[0], b"\x77" * (sum(sizes[0]) + 1)) == 0
    reader = HostKVPool(SPEC, 8, 4, layout="page_head")
    ridx = reader.alloc(8)
    assert store.batch_get(keys[:1], reader, ridx[:4]) == [False]
    assert (store.stats()["errors"], store.stats()["corrupt"]) == (1, 1)
    assert store.batch_get(keys[1:], reader, ridx[4:]) == [True]
    assert torch.equal(flat_pages(reader, ridx[4:])[0], flat_pages(host, idx[4:])[0])
    # deleted, page and marker, as the other stores delete a corrupt object: the page can be put again
    assert store.exists_each(keys) == [False, True]
    assert store.batch_set(keys[:1], host, idx[:4]) == [True]
    assert store.batch_get(keys[:1], reader, ridx[:4]) == [True]
    assert torch.equal(flat_pages(reader, ridx[:4])[0], flat_pages(host, idx[:4])[0])

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
    from tests.support.services import free_port

    store = kvtier.storage.open(f"mooncake://127.0.0.1:{free_port()}?protocol=tcp&metadata=P2PHANDSHAKE",
                                connect_timeout=0.5)
    host, idx = filled_host(SPEC, 1, layout="page_head")
    assert store.batch_set(keys_for(1), host, idx) == [False]
    assert store.batch_exists(keys_for(1)) == 0
    assert store.stats()["errors"] >= 1
    store.close()


def test_the_client_is_the_one_the_store_calls(store):
    host, idx = filled_host(SPEC, 1, layout="page_head")
    assert store.batch_set(keys_for(1), host, idx) == [True]
    client = store.client()
    assert type(client).__name__ == "MooncakeDistributedStore" and store.client() is client
    assert client.batch_is_exist([f"mc-test/{keys_for(1)[0]}", "mc-test/nothing"]) == [1, 0]  # kvtier's marker
    assert client.put("mc-test/raw", b"raw bytes") == 0
    store.clear()  # everything under the store's prefix, its own objects or not
    assert client.batch_is_exist(["mc-test/raw"]) == [0]
    store.close()
    assert store.client() is None


def test_no_client_while_the_master_cannot_be_reached():
    from tests.support.services import free_port

    store = kvtier.storage.open(f"mooncake://127.0.0.1:{free_port()}?protocol=tcp&metadata=P2PHANDSHAKE",
                                connect_timeout=0.5, backoff=0)
    errors = store.stats()["errors"]
    assert store.client() is None and store.stats()["errors"] == errors + 1
    store.close()


def test_bad_urls(mooncake_master):
    with pytest.raises(ValueError, match="host:port"):
        kvtier.storage.open("mooncake://?metadata=x")
    for query, match in [("colour=blue", "unknown URL option 'colour'; supported URL options: backoff, "
                                         "connect_timeout, global_segment_size, head_groups, layout"),
                         ("protocol=udp", "protocol must be a tcp\\|rdma"),
                         ("global_segment_size=big", "global_segment_size='big' is not a int"),
                         ("layout=diagonal", "layout must be a layer_first\\|page_first"),
                         ("connect_timeout=0", "connect_timeout must be a number >= 0.001"),
                         ("layout=page_head", "layout= binds a mooncake store together with spec=")]:
        with pytest.raises(ValueError, match=match):
            kvtier.storage.open(f"{mooncake_master.url.split('?')[0]}?{query}")
    with pytest.raises(ValueError, match="'protocol' given more than once"):
        kvtier.storage.open(mooncake_master.url, protocol="tcp")


def test_url_options_apply(mooncake_master):
    url = f"{mooncake_master.url}&prefix=q-opts/&backoff=7.5&connect_timeout=0.25&global_segment_size={64 << 20}"
    store = kvtier.storage.open(url)
    try:
        assert (store.prefix, store._breaker.backoff, store._connect_timeout) == ("q-opts/", 7.5, 0.25)
        host, idx = filled_host(SPEC, 2, layout="page_head")
        assert store.batch_set(keys_for(2), host, idx) == [True, True]
        plain = kvtier.storage.open(mooncake_master.url)  # the default prefix: other objects
        assert plain.batch_exists(keys_for(2)) == 0
        plain.close()
        reader = HostKVPool(SPEC, 8, 4, layout="page_head")
        ridx = reader.alloc(8)
        assert store.batch_get(keys_for(2), reader, ridx) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(flat_pages(host, idx), flat_pages(reader, ridx)))
    finally:
        store.clear()
        store.close()


def test_delete_removes_only_the_keys_named(store):
    """Keys are opaque text: deleting "a" leaves "a/b", "a#b" and "a%23b" (and their bytes) alone."""
    keys = ["a", "a/b", "a#b", "a%23b", "a.*", "b"]
    host, idx = filled_host(SPEC, len(keys), layout="page_head")
    assert store.batch_set(keys, host, idx) == [True] * len(keys)
    store.delete(["a", "a.*"])
    assert [store.batch_exists([k]) for k in keys] == [0, 1, 1, 1, 0, 1]
    reader = HostKVPool(SPEC, 4 * len(keys), 4, layout="page_head")
    ridx = reader.alloc(4 * len(keys))
    assert store.batch_get(keys, reader, ridx) == [False, True, True, True, False, True]
    for i in (1, 2, 3, 5):
        assert torch.equal(flat_pages(host, idx)[i], flat_pages(reader, ridx)[i])
    assert store.stats()["errors"] == 0
