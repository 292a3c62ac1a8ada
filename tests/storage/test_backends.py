"""Every storage backend against the same contract: round trips, prefixes, isolation, TP sharing,
geometry as identity, and misuse refused before any I/O."""

import pytest
import torch

import kvtier.storage
from kvtier import Component, HostKVPool, KVSpec
from tests.support.pools import SPECS, bits
from tests.support.storage import filled_host, flat_pages, shard_flat


def keys_for(n_pages, page_size=4, namespace="model", salt=None, start=0):
    return kvtier.storage.page_keys(list(range(start, start + n_pages * page_size)), page_size,
                                    namespace=namespace, salt=salt)


@pytest.mark.parametrize("layouts", [("page_first", "page_head"), ("page_head", "layer_first")])
@pytest.mark.parametrize("spec_name", ["mha", "asym", "mla"])
def test_round_trip_across_layouts(open_store, spec_name, layouts):
    spec = SPECS[spec_name]
    writer, idx = filled_host(spec, 5, layout=layouts[0])
    store = open_store()
    keys = keys_for(5)
    assert store.batch_set(keys, writer, idx) == [True] * 5
    reader = HostKVPool(spec, 8 * 4, 4, layout=layouts[0 if open_store.zero_copy else 1])
    ridx = reader.alloc(5 * 4).flip(0).view(-1, 4).flip(1).reshape(-1)  # other pages, other order
    assert store.batch_get(keys, reader, ridx) == [True] * 5
    for a, b in zip(flat_pages(writer, idx), flat_pages(reader, ridx)):
        assert torch.equal(a, b)
    stats = store.stats()
    assert stats["hits"] == 5 and stats["errors"] == 0 and stats["bytes_read"] == stats["bytes_written"] > 0


def test_exists_counts_leading_pages(open_store):
    spec = SPECS["asym"]
    host, idx = filled_host(spec, 4)
    store = open_store()
    keys = keys_for(4)
    assert store.batch_exists(keys) == 0 and store.batch_exists([]) == 0
    store.batch_set([keys[0], keys[1], keys[3]], host, torch.cat([idx[:8], idx[12:]]))
    assert store.batch_exists(keys) == 2
    assert store.batch_exists(keys[3:]) == 1
    assert store.batch_get(keys, host, idx) == [True, True, False, True]
    store.delete(keys[:1])
    assert store.batch_exists(keys) == 0 and store.batch_exists(keys[1:]) == 1
    store.clear()
    assert store.batch_exists(keys[1:]) == 0


def bind(open_store, spec, page_size, layout="page_first"):
    return dict(spec=spec, page_size=page_size, **({"layout": layout} if open_store.zero_copy else {}))


def test_exists_for_the_bound_geometry_or_any(open_store):
    host, idx = filled_host(SPECS["mha"], 2)
    keys = keys_for(2)
    open_store().batch_set(keys, host, idx)
    assert open_store().batch_exists(keys) == 2  # unbound: any geometry
    assert open_store(**bind(open_store, SPECS["mha"], 4)).batch_exists(keys) == 2
    assert open_store(**bind(open_store, SPECS["asym"], 4)).batch_exists(keys) == 0
    assert open_store(**bind(open_store, SPECS["mha"], 2)).batch_exists(keys) == 0


def test_calls_never_rebind_the_geometry(open_store):
    """What batch_exists answers does not depend on which pool called last."""
    host, idx = filled_host(SPECS["mha"], 2)
    keys = keys_for(2)
    store = open_store()
    store.batch_set(keys, host, idx)
    before = store.batch_exists(keys)
    other = HostKVPool(SPECS["asym"], 8, 4)
    assert store.batch_get(keys, other, other.alloc(8)) == [False, False]
    assert store.batch_exists(keys) == before == 2
    bound = open_store(**bind(open_store, SPECS["mha"], 4))
    for pool in (other, HostKVPool(SPECS["mha"], 8, 2), HostKVPool(SPECS["mha"], 8, 4, layout="page_head")):
        if pool.layout == "page_head" and not open_store.zero_copy:
            continue  # copy backends' objects do not depend on the layout
        with pytest.raises(ValueError, match="this store is bound to"):
            bound.batch_get(keys, pool, pool.alloc(8))
    assert bound.stats()["misses"] == 0 and bound.batch_exists(keys) == 2


def test_another_page_size_misses_and_deletes_nothing(open_store):
    """Page size is part of an object's identity: a reader with another one misses, and
    the writer's objects stay readable."""
    spec = SPECS["asym"]
    writer, widx = filled_host(spec, 2, page_size=16)
    keys = keys_for(2, page_size=16)
    store = open_store()
    assert store.batch_set(keys, writer, widx) == [True, True]
    small = HostKVPool(spec, 32, 8, layout=writer.layout)
    sidx = small.alloc(16)
    before = bits(small.get_data_page(0)).clone()
    assert store.batch_get(keys, small, sidx) == [False, False]
    assert torch.equal(bits(small.get_data_page(0)), before)
    reader = HostKVPool(spec, 32, 16, layout=writer.layout)
    ridx = reader.alloc(32)
    assert store.batch_get(keys, reader, ridx) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(writer, widx), flat_pages(reader, ridx)))
    assert store.stats()["corrupt"] == 0 and store.stats()["errors"] == 0


def test_repeated_destination_pages_raise_before_io(open_store):
    host, idx = filled_host(SPECS["mha"], 2)
    store = open_store()
    keys = keys_for(2)
    store.batch_set(keys, host, idx)
    reader = HostKVPool(SPECS["mha"], 8, 4)
    before = bits(reader.get_data_page(0)).clone()
    with pytest.raises(ValueError, match="same page more than once"):
        store.batch_get(keys, reader, torch.cat([torch.arange(4), torch.arange(4)]))
    assert torch.equal(bits(reader.get_data_page(0)), before)
    assert store.stats()["hits"] + store.stats()["misses"] == 0
    assert store.batch_set(keys, host, torch.cat([idx[:4], idx[:4]])) == [True, True]  # a source may repeat


def test_a_too_long_key_raises_before_any_key_is_written(open_store):
    host, idx = filled_host(SPECS["mha"], 3)
    store = open_store()
    good = keys_for(2)
    cases = [("x" * 65_536, "key 2 is 65536 bytes \\(UTF-8\\), over the limit of 65535"),
             ("\u00e9" * 32_768, "key 2 is 65536 bytes"),
             ("\ud800", "not encodable as UTF-8")]
    if not open_store.zero_copy:  # '<key>#<field>' must fit an object header too
        cases.append(("x" * 65_535, "would be up to 6\\d{4} bytes, over the header's 65535"))
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            store.batch_set([*good, bad], host, idx)
    assert store.batch_exists(good) == 0 and store.stats()["pages_written"] == 0


def test_keys_may_be_any_iterable_read_once(open_store):
    host, idx = filled_host(SPECS["mha"], 3)
    store = open_store()
    keys = keys_for(3)
    assert store.batch_set(iter(keys), host, idx) == [True] * 3
    assert store.batch_exists(k for k in keys) == 3
    reader = HostKVPool(SPECS["mha"], 12, 4)
    ridx = reader.alloc(12)
    assert store.batch_get((k for k in keys), reader, ridx) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(host, idx), flat_pages(reader, ridx)))
    store.delete(k for k in keys[:1])
    assert store.batch_exists(tuple(keys)) == 0 and store.batch_exists(keys[1:]) == 2


def test_namespaces_salts_dtypes_and_dims_are_isolated(open_store):
    spec = SPECS["mha"]
    host, idx = filled_host(spec, 2)
    store = open_store()
    store.batch_set(keys_for(2), host, idx)
    assert store.batch_exists(keys_for(2, namespace="other")) == 0
    assert store.batch_exists(keys_for(2, salt="tenant-b")) == 0
    assert store.batch_exists(keys_for(2)) == 2
    for other in (KVSpec.mha(3, 2, 8, dtype=torch.float16), KVSpec.mha(3, 2, 8, v_head_dim=4), KVSpec.mha(2, 2, 8)):
        reader = HostKVPool(other, 8, 4)
        ridx = reader.alloc(8)
        before = bits(reader.get_data_page(0)).clone()
        assert store.batch_get(keys_for(2), reader, ridx) == [False, False]
        assert torch.equal(bits(reader.get_data_page(0)), before)


def test_bad_calls_raise_before_any_io(open_store):
    host, idx = filled_host(SPECS["mha"], 2)
    store = open_store()
    with pytest.raises(ValueError, match="len\\(keys\\) \\* page_size = 3 \\* 4"):
        store.batch_set(keys_for(3), host, idx)
    with pytest.raises(ValueError, match="list of non-empty str"):
        store.batch_get("abc", host, idx[:4])
    with pytest.raises(ValueError, match="HostKVPool"):
        store.batch_get(keys_for(2), None, idx)
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        store.batch_set(keys_for(1), host, idx[2:6])
    assert store.stats()["bytes_written"] == 0


THREE = KVSpec(2, (Component("k", 4, 12), Component("v", 4, 8), Component("idx", 1, 6)), torch.bfloat16)


@pytest.mark.parametrize("spec", [SPECS["asym"], THREE], ids=["asym", "with_replicated"])
def test_tensor_parallel_writers_and_readers_of_other_sizes(open_store, spec):
    """2 ranks with half the heads write; 1 full rank and 4 quarter ranks read bit-exactly."""
    page_size, pages = 4, 3
    full_host, full_idx = filled_host(spec, pages, page_size, seed=5)
    truth = flat_pages(full_host, full_idx)
    keys = keys_for(pages)
    store = open_store()
    for rank in range(2):  # each writer rank holds its heads of the same KV
        shard = spec.shard(rank, 2)
        host = HostKVPool(shard, pages * page_size, page_size, layout="page_head")
        idx = host.alloc(pages * page_size)
        for i, s in enumerate(idx[::page_size].tolist()):
            host.set_from_flat_data_page(s, shard_flat(truth[i].view(spec.dtype), spec, page_size, rank, 2))
        assert store.batch_set(keys, host, idx) == [True] * pages
    reader = HostKVPool(spec, pages * page_size, page_size,
                        layout="page_head" if open_store.zero_copy else "page_first")
    ridx = reader.alloc(pages * page_size)
    assert store.batch_get(keys, reader, ridx) == [True] * pages
    assert all(torch.equal(a, b) for a, b in zip(truth, flat_pages(reader, ridx)))
    for rank in range(4):
        shard = spec.shard(rank, 4)
        quarter = HostKVPool(shard, pages * page_size, page_size,
                             layout="page_head" if open_store.zero_copy else "layer_first")
        qidx = quarter.alloc(pages * page_size)
        assert store.batch_get(keys, quarter, qidx) == [True] * pages
        for i, got in enumerate(flat_pages(quarter, qidx)):
            assert torch.equal(got, bits(shard_flat(truth[i].view(spec.dtype), spec, page_size, rank, 4)))


def test_a_call_whose_pool_another_thread_closed_does_the_work_itself(open_store):
    """``close()`` on another thread may shut the I/O pool down between a call taking it
    and handing it work: the calling thread then moves every page itself, where a put
    raised ``RuntimeError`` (and a get counted a fault and missed). The state is set
    up as that race leaves it: the call finds a pool already shut down."""
    from concurrent.futures import ThreadPoolExecutor

    store = open_store()
    if not hasattr(store, "_pool_lock"):
        pytest.skip(f"{store.scheme}:// moves a batch in one client call, on no pool of I/O threads")
    assert store.io_threads == 2  # the default
    store.CHUNK_BYTES = 1  # a chunk per page: the helper has work to take
    writer, idx = filled_host(SPECS["asym"], 4, layout="page_head")
    reader = HostKVPool(SPECS["asym"], 4 * 4, 4, layout="page_head")
    keys = keys_for(4)
    for call in (lambda: store.batch_set(keys, writer, idx), lambda: store.batch_get(keys, reader, idx)):
        closed = ThreadPoolExecutor(1)
        closed.shutdown()
        with store._pool_lock:
            store._pool = closed
        assert call() == [True] * 4
    for a, b in zip(flat_pages(writer, idx), flat_pages(reader, idx)):
        assert torch.equal(bits(a), bits(b))
    assert store.stats()["errors"] == 0
