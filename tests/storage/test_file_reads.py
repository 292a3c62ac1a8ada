"""File backend reads: staging reused across steps, calls and threads; a bad object in the
middle of a batch; a fault mid-batch; every copy width of the page plans."""

import threading

import pytest
import torch

import kvtier.storage
from kvtier import KVSpec
from kvtier.layout import LAYOUTS
from helpers import SPECS
from storage_helpers import blank_host, filled_host, flat_pages

SPEC = SPECS["asym"]  # 4 objects per page (head groups of the 4 K and 4 V heads)


def keys_for(n, start=0, namespace="r"):
    return kvtier.storage.page_keys(list(range(start, start + 4 * n)), 4, namespace=namespace)


def object_files(store, key):
    return sorted(p for p in store._key_dir(key).iterdir())


def open_store(tmp_path, io_threads, one_page_steps):
    store = kvtier.storage.open(f"file://{tmp_path}", io_threads=io_threads)
    if one_page_steps:
        store.CHUNK_BYTES = 1  # every page its own step: many steps, each reusing the staging
    return store


STEPS = pytest.mark.parametrize("io_threads,one_page_steps", [(1, False), (1, True), (2, True), (3, True)])


@STEPS
def test_reused_staging_never_lends_one_page_bytes_to_another(tmp_path, io_threads, one_page_steps):
    """Every page comes back with exactly its own bytes, call after call, although the
    staging that held the previous call's (or step's) objects is reused; a truncated
    object read over staging that still holds a whole object of the same size is a miss."""
    store = open_store(tmp_path, io_threads, one_page_steps)
    first, idx = filled_host(SPEC, 6, seed=1)
    second, _ = filled_host(SPEC, 6, seed=2)
    assert store.batch_set(keys_for(6, namespace="a"), first, idx) == [True] * 6
    assert store.batch_set(keys_for(6, namespace="b"), second, idx) == [True] * 6
    victim = object_files(store, keys_for(6, namespace="b")[3])[1]
    victim.write_bytes(victim.read_bytes()[:-5])
    reader, ridx = blank_host(SPEC, 24)
    assert store.batch_get(keys_for(6, namespace="a"), reader, ridx) == [True] * 6
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(first, idx)))
    got = store.batch_get(keys_for(6, namespace="b"), reader, ridx)
    assert got == [True, True, True, False, True, True]
    pages, want, old = flat_pages(reader, ridx), flat_pages(second, idx), flat_pages(first, idx)
    for i in range(6):
        assert torch.equal(pages[i], old[i] if i == 3 else want[i]), f"page {i}"
    assert store.stats()["corrupt"] == 1 and not victim.exists()


@STEPS
@pytest.mark.parametrize("layout", ["page_head", "page_first"])
def test_a_corrupt_object_mid_batch_is_a_miss_that_leaves_its_page_untouched(tmp_path, io_threads,
                                                                            one_page_steps, layout):
    """The damaged object is neither the first nor the last of its page, and its page is
    neither the first nor the last of the batch: the pages around it load, its own page
    keeps every byte (no part of it is copied before all its parts pass)."""
    store = open_store(tmp_path, io_threads, one_page_steps)
    host, idx = filled_host(SPEC, 7, seed=3)
    keys = keys_for(7)
    assert store.batch_set(keys, host, idx) == [True] * 7
    victim = object_files(store, keys[4])[2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    reader, ridx = blank_host(SPEC, 28, layout=layout)
    before = [p.clone() for p in flat_pages(reader, ridx)]
    assert store.batch_get(keys, reader, ridx) == [True] * 4 + [False] + [True] * 2
    pages, want = flat_pages(reader, ridx), flat_pages(host, idx)
    for i in range(7):
        assert torch.equal(pages[i], before[i] if i == 4 else want[i]), f"page {i}"
    stats = store.stats()
    assert (stats["corrupt"], stats["errors"], stats["hits"], stats["misses"]) == (1, 1, 6, 1)


def test_a_fault_mid_batch_makes_the_remaining_objects_misses(tmp_path, monkeypatch):
    """An unexpected error while the backend reads (not an OSError of one object) is one
    counted error: pages already read load, the rest are misses and stay untouched."""
    store = open_store(tmp_path, 1, False)
    host, idx = filled_host(SPEC, 4, seed=5)
    keys = keys_for(4)
    store.batch_set(keys, host, idx)
    read, calls = store._read, []

    def failing_read(*args):
        calls.append(1)
        if len(calls) == 7:  # the third object of page 1
            raise RuntimeError("boom")
        return read(*args)

    monkeypatch.setattr(store, "_read", failing_read)
    reader, ridx = blank_host(SPEC, 16)
    before = [p.clone() for p in flat_pages(reader, ridx)]
    assert store.batch_get(keys, reader, ridx) == [True, False, False, False]
    pages, want = flat_pages(reader, ridx), flat_pages(host, idx)
    assert torch.equal(pages[0], want[0]) and all(torch.equal(pages[i], before[i]) for i in (1, 2, 3))
    assert len(calls) == 7 and store.stats()["errors"] == 1
    assert store.batch_get(keys, reader, ridx) == [True] * 4  # the store still works


def test_concurrent_gets_each_get_their_own_pages(tmp_path):
    """Four threads read different pages through one store (its shared workers, each
    caller working too) into one pool, over and over: every page is byte-exact."""
    store = open_store(tmp_path, 3, True)
    host, idx = filled_host(SPEC, 16, seed=6)
    keys = keys_for(16)
    assert store.batch_set(keys, host, idx) == [True] * 16
    want = flat_pages(host, idx)
    reader, ridx = blank_host(SPEC, 64)
    errors = []

    def reads(t):
        mine = slice(4 * t, 4 * t + 4)
        slots = ridx[16 * t:16 * t + 16]
        try:
            for _ in range(20):
                assert store.batch_get(keys[mine], reader, slots) == [True] * 4
                got = flat_pages(reader, slots)
                assert all(torch.equal(g, w) for g, w in zip(got, want[mine]))
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=reads, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a reader still runs after 60 s"
    assert not errors, errors[0]
    assert store.stats()["hits"] == 4 * 20 * 4 and store.stats()["errors"] == 0


@pytest.mark.parametrize("spec", [KVSpec.mha(2, 2, 3, v_head_dim=5), KVSpec.mha(2, 2, 3, dtype=torch.float32),
                                  KVSpec.mha(2, 4, 4, dtype=torch.float32)], ids=["6_10_bytes", "12_bytes", "16_bytes"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_run_width_round_trips_across_layouts(tmp_path, spec, layout):
    """Page plans copy each head's dim run as the widest ints that tile it (2, 4 or 8
    bytes here): a page written from one layout reads back bit-exact into another."""
    host, idx = filled_host(spec, 3, layout="page_head", seed=7)
    store = kvtier.storage.open(f"file://{tmp_path}")
    assert store.batch_set(keys_for(3), host, idx) == [True] * 3
    reader, ridx = blank_host(spec, 12, layout=layout)
    assert store.batch_get(keys_for(3), reader, ridx) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
    writer, widx = filled_host(spec, 3, layout=layout, seed=8)
    assert store.batch_set(keys_for(3, namespace="w"), writer, widx) == [True] * 3
    assert store.batch_get(keys_for(3, namespace="w"), host, idx) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(host, idx), flat_pages(writer, widx)))
