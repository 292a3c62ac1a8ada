"""File backend reads: staging reused across steps, calls and threads; a bad object in the
middle of a batch; a fault mid-batch; every copy width of the page plans."""

import contextlib
import errno
import io
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtier.storage
from kvtier import Component, KVSpec
from kvtier.bench.storage import evict_cached
from kvtier.storage import pageio
from kvtier.storage.pagefile import ALIGN
from kvtier.layout import LAYOUTS
from tests.support import seccomp
from tests.support.pools import SPECS, bits
from tests.support.services import unavailable
from tests.support.storage import (blank_host, cached_pages_of, direct_allowed, filled_host, flat_pages,
                                   object_files as stored_files, shard_flat)

SPEC = SPECS["asym"]  # one file a page of 4 parts (head groups of the 4 K and 4 V heads), 480 bytes each


def keys_for(n, start=0, namespace="r"):
    return kvtier.storage.page_keys(list(range(start, start + 4 * n)), 4, namespace=namespace)


def object_files(store, key):
    return [Path(p) for p in store._key_files(key)]


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
    victim, = object_files(store, keys_for(6, namespace="b")[3])
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
    """The damaged part is neither the first nor the last of its page, and its page is
    neither the first nor the last of the batch: the pages around it load. A staged
    layout's page keeps every byte (no staged part is copied before all its parts
    pass); ``page_head`` reads in place, so its miss page holds what was read. The
    files are in split order (a ``page_head`` writer's): ``page_first`` expects slot
    order, so it reads them staged on the per-file path."""
    store = open_store(tmp_path, io_threads, one_page_steps)
    host, idx = filled_host(SPEC, 7, seed=3, layout="page_head")
    keys = keys_for(7)
    assert store.batch_set(keys, host, idx) == [True] * 7
    victim, = object_files(store, keys[4])
    data = bytearray(victim.read_bytes())
    assert len(data) == 8 * ALIGN + 192  # a one-block header, then each part at a block boundary
    data[3 * ALIGN + 144] ^= 0x01  # inside part 3 of 8 (K of head 2)
    victim.write_bytes(bytes(data))
    reader, ridx = blank_host(SPEC, 28, layout=layout)
    before = [p.clone() for p in flat_pages(reader, ridx)]
    assert store.batch_get(keys, reader, ridx) == [True] * 4 + [False] + [True] * 2
    pages, want = flat_pages(reader, ridx), flat_pages(host, idx)
    for i in range(7):
        if i != 4:
            assert torch.equal(pages[i], want[i]), f"page {i}"
        elif layout != "page_head":
            assert torch.equal(pages[i], before[i]), "a staged miss page is untouched"
    stats = store.stats()
    assert (stats["corrupt"], stats["errors"], stats["hits"], stats["misses"]) == (1, 1, 6, 1)


def test_a_fault_mid_batch_makes_the_remaining_objects_misses(tmp_path, monkeypatch):
    """An unexpected error while the backend reads (not an OSError of one file) is one
    counted error: pages already read load, the rest are misses and stay untouched
    (the per-file path; the compiled reader's is the next test)."""
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    store = open_store(tmp_path, 1, False)
    host, idx = filled_host(SPEC, 4, seed=5)
    keys = keys_for(4)
    store.batch_set(keys, host, idx)
    read, calls = store._read_file, []

    def failing_read(*args):
        calls.append(1)
        if len(calls) == 2:  # page 1's file
            raise RuntimeError("boom")
        return read(*args)

    monkeypatch.setattr(store, "_read_file", failing_read)
    reader, ridx = blank_host(SPEC, 16)
    before = [p.clone() for p in flat_pages(reader, ridx)]
    assert store.batch_get(keys, reader, ridx) == [True, False, False, False]
    pages, want = flat_pages(reader, ridx), flat_pages(host, idx)
    assert torch.equal(pages[0], want[0]) and all(torch.equal(pages[i], before[i]) for i in (1, 2, 3))
    assert len(calls) == 2 and store.stats()["errors"] == 1
    assert store.batch_get(keys, reader, ridx) == [True] * 4  # the store still works


@pytest.mark.parametrize("layout", ["page_head", "page_first"])
def test_a_fault_of_the_compiled_reader_makes_its_batch_misses(tmp_path, monkeypatch, layout):
    """An unexpected error of the compiled reader is one counted error; the batch's
    pages are misses, the pages it had not reached untouched, and the store still works."""
    if not pageio.compiled():
        unavailable("kvtier.storage._pageio is not built or bound, or KVTIER_NATIVE=0")
    store = open_store(tmp_path, 1, False)
    host, idx = filled_host(SPEC, 4, layout=layout, seed=6)
    keys = keys_for(4)
    store.batch_set(keys, host, idx)
    real = pageio.read_pages
    monkeypatch.setattr(pageio, "read_pages", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    reader, ridx = blank_host(SPEC, 16, layout=layout)
    before = [p.clone() for p in flat_pages(reader, ridx)]
    assert store.batch_get(keys, reader, ridx) == [False] * 4
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), before))
    assert store.stats()["errors"] == 1
    monkeypatch.setattr(pageio, "read_pages", real)
    assert store.batch_get(keys, reader, ridx) == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))


@pytest.mark.parametrize("layout", ["page_head", "page_first"])
def test_missing_pages_mid_batch_are_misses_judged_without_a_read(tmp_path, monkeypatch, pageio_path, layout):
    """Pages whose files are gone, between pages that are there, are misses that leave
    their pages untouched and count no error; the others load bit-exactly. Where the
    compiled reader found their files missing, no per-file read is tried for them (only
    the files other writers would have written are looked for): working out such a read
    took 60-100 us a missing page before."""
    store = kvtier.storage.open(f"file://{tmp_path}", io_threads=2)
    host, idx = filled_host(SPEC, 6, seed=11, layout="page_head")
    keys = keys_for(6)
    assert store.batch_set(keys, host, idx) == [True] * 6
    gone = [keys[i] for i in (1, 3, 4)]
    store.delete(gone)
    read, tried = store._read_parts, []
    monkeypatch.setattr(store, "_read_parts", lambda stem, *a: tried.append(stem) or read(stem, *a))
    reader, ridx = blank_host(SPEC, 24, layout=layout)
    before = [p.clone() for p in flat_pages(reader, ridx)]
    assert store.batch_get(keys, reader, ridx) == [True, False, True, False, False, True]
    pages, want = flat_pages(reader, ridx), flat_pages(host, idx)
    for i in range(6):
        assert torch.equal(pages[i], before[i] if keys[i] in gone else want[i]), f"page {i}"
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["errors"]) == (3, 3, 0)
    if pageio_path == "compiled":
        assert not set(tried) & {store._stem(k) for k in gone}
    else:
        assert {store._stem(k) for k in gone} <= set(tried)


def test_a_file_at_a_shards_name_is_a_counted_fault_of_a_get(tmp_path, pageio_path):
    """A regular file where a key's shard directory should be (ENOTDIR on open) fails a
    get as a counted fault, not as a plain miss: the compiled reader answers only ENOENT
    as missing and leaves the rest to the per-file path, which judges it."""
    store = kvtier.storage.open(f"file://{tmp_path}")
    key, = keys_for(1)
    Path(store._stem(key)).parent.write_text("not a directory")
    reader, ridx = blank_host(SPEC, 4)
    assert store.batch_get([key], reader, ridx) == [False]
    stats = store.stats()
    assert (stats["misses"], stats["errors"]) == (1, 1)


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


WITH_REP = KVSpec(2, (Component("k", 4, 12), Component("v", 4, 8), Component("idx", 1, 6)), torch.bfloat16)


@pytest.mark.parametrize("layout", ["page_head", "page_first"])
def test_shards_read_their_ranges_of_one_full_writers_file(tmp_path, layout):
    """A full writer leaves one file a page: head groups 0-3 and the replicated part.
    Each rank of 2 finds it (its own-size file is absent), reads only its own groups and
    the replicated part by their offsets, in place or staged, bit-exactly; then a
    damaged group the rank does not read leaves its read intact, one it reads is a miss."""
    full, idx = filled_host(WITH_REP, 3, seed=9, layout="page_head")  # head order: a part per group
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(3)
    assert store.batch_set(keys, full, idx) == [True] * 3
    files = [object_files(store, k) for k in keys]
    assert [[f.name.rsplit(".", 1)[1] for f in page] for page in files] == [["g0-4of4+rep"]] * 3
    truth = flat_pages(full, idx)
    for rank in range(2):
        shard = WITH_REP.shard(rank, 2)
        reader, ridx = blank_host(shard, 12, layout=layout)
        assert store.exists_each(keys) == [True] * 3
        assert store.batch_get(keys, reader, ridx) == [True] * 3
        for got, want in zip(flat_pages(reader, ridx), truth):
            assert torch.equal(got, bits(shard_flat(want.view(WITH_REP.dtype), WITH_REP, 4, rank, 2)))
    data = bytearray(files[1][0].read_bytes())
    data[4 * ALIGN + 10] ^= 0x01  # inside head group 3: rank 1's, not rank 0's
    files[1][0].write_bytes(bytes(data))
    for rank, want in ((0, [True] * 3), (1, [True, False, True])):
        reader, ridx = blank_host(WITH_REP.shard(rank, 2), 12, layout=layout)
        assert store.batch_get(keys, reader, ridx) == want, rank
    assert store.stats()["corrupt"] == 1 and not files[1][0].exists()


ALIGNED = KVSpec.mha(2, 2, 64)  # 16-token pages: each head's K or V piece is 4 KiB, every part 8 KiB


NEEDS_DIRECT = pytest.mark.skipif(not (hasattr(os, "O_DIRECT") and hasattr(os, "RWF_NOWAIT")),
                                  reason="needs Linux's O_DIRECT and RWF_NOWAIT")


@NEEDS_DIRECT
@pytest.mark.parametrize("layout", ["page_head", "page_first"])
def test_cold_aligned_pages_read_with_direct_io_bit_exactly(tmp_path, monkeypatch, layout):
    """The per-file path (where the compiled reader is not used: staged layouts, no C
    compiler, KVTIER_NATIVE=0): files whose header is not cached are read with O_DIRECT
    (aligned parts, in place or staged), cached ones buffered; both bit-exact, a damaged
    part still a miss."""
    if not direct_allowed(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    host, idx = filled_host(ALIGNED, 4, page_size=16, seed=11, layout=layout)  # files of the reader's order
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = kvtier.storage.page_keys(list(range(64)), 16, namespace="d")
    assert store.batch_set(keys, host, idx) == [True] * 4
    opened = []
    real = store._open_direct
    monkeypatch.setattr(store, "_open_direct", lambda *a: opened.append(1) or real(*a))
    reader, ridx = blank_host(ALIGNED, 64, page_size=16, layout=layout)
    assert store.batch_get(keys, reader, ridx) == [True] * 4  # just written, so cached: no direct read
    assert opened == [] and store.direct_io
    # NOTE: cold as the store sees it: the page cache may keep a page that was just used
    # (pages in per-CPU batches are not dropped), so the test does not rely on eviction
    monkeypatch.setattr(store, "_is_cold", lambda fd, size, head: (True, False))
    reader, ridx = blank_host(ALIGNED, 64, page_size=16, layout=layout)
    assert store.batch_get(keys, reader, ridx) == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
    assert len(opened) == 4 and store.direct_io
    victim, = object_files(store, keys[2])
    data = bytearray(victim.read_bytes())
    data[2 * ALIGN + 5] ^= 0x10  # part 1 of 2
    victim.write_bytes(bytes(data))
    assert store.batch_get(keys, reader, ridx) == [True, True, False, True]
    assert store.stats()["corrupt"] == 1


@pytest.fixture
def read_statuses(monkeypatch):
    """Every status the compiled reader returns for a file it read, as each call returns
    (its threads share a batch's files: each answers ``ELSEWHERE`` for the others'
    files); skips where it is not used."""
    if not pageio.compiled():
        unavailable("kvtier.storage._pageio is not built or bound, or KVTIER_NATIVE=0")
    seen, real = [], pageio.read_pages

    def spy(*args):
        out = real(*args)
        seen.extend(s for s in out if s != pageio.ELSEWHERE)
        return out

    monkeypatch.setattr(pageio, "read_pages", spy)
    return seen


@NEEDS_DIRECT
@pytest.mark.parametrize("cold_reads", ["staged", "in_place", "auto"])
@pytest.mark.parametrize("layout", ["page_head", "page_first", "page_first_direct"])
def test_the_compiled_reader_reads_cached_files_and_cold_ones_with_direct_io(tmp_path, read_statuses, layout,
                                                                           cold_reads):
    """Pages of files in the pool's own order are read by the compiled reader: just
    written (cached) buffered straight into the pool, once dropped from the page cache
    with O_DIRECT through staging (copied out once the file checks out) or straight
    into the pool, both bit-exact; a damaged part is a miss (judged and deleted by the
    per-file path)."""
    if not direct_allowed(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    host, idx = filled_host(ALIGNED, 4, page_size=16, layout=layout, seed=15)
    store = kvtier.storage.open(f"file://{tmp_path}?cold_reads={cold_reads}")
    keys = kvtier.storage.page_keys(list(range(64)), 16, namespace="c")
    assert store.batch_set(keys, host, idx) == [True] * 4
    reader, ridx = blank_host(ALIGNED, 64, page_size=16, layout=layout)
    assert store.batch_get(keys, reader, ridx) == [True] * 4
    assert read_statuses == [pageio.READ] * 4
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
    for _ in range(20):  # a page just used may stay cached a moment
        evict_cached(tmp_path)
        read_statuses.clear()
        reader, ridx = blank_host(ALIGNED, 64, page_size=16, layout=layout)
        assert store.batch_get(keys, reader, ridx) == [True] * 4
        if read_statuses == [pageio.DIRECT] * 4:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the files stayed cached after 20 evictions: {list(read_statuses)}")
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
    assert store.direct_io
    learned = {m for m, rate in store.cold_reads.rates().items() if rate is not None}
    assert learned == (set() if cold_reads != "auto" else {"staged"})  # the first cold batch of auto: staged
    victim, = object_files(store, keys[1])
    data = bytearray(victim.read_bytes())
    data[2 * ALIGN + 5] ^= 0x10  # part 1 of 2
    victim.write_bytes(bytes(data))
    evict_cached(tmp_path)
    read_statuses.clear()
    assert store.batch_get(keys, reader, ridx) == [True, False, True, True]
    # the statuses come in the order the I/O threads answered
    assert len(read_statuses) == 4 and read_statuses.count(pageio.OTHER) == 1
    assert store.stats()["corrupt"] == 1 and not victim.exists()


@NEEDS_DIRECT
@pytest.mark.parametrize("ask,pages", [("cachestat", 4), ("cachestat", 64), ("nowait", 4)],
                         ids=["cachestat", "cachestat-sampled", "nowait"])
def test_a_file_out_of_the_page_cache_is_cold(tmp_path, monkeypatch, ask, pages):
    """The cold check counts the file's cached pages without reading (``cachestat``: the
    whole of a small file, three stretches of a large one), or where it cannot asks for
    the header without waiting (then read into ``head``): warm after a read, cold once
    the file's pages are dropped (retried: a page just used may stay cached a moment)."""
    if ask == "cachestat":
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            if pageio.cached_pages(fd, 0, 1) is None:
                unavailable("no cachestat here: kvtier.storage._pageio not built, KVTIER_NATIVE=0 or Linux < 6.5")
        finally:
            os.close(fd)
    else:
        monkeypatch.setattr(pageio, "cached_pages", lambda *a: None)
    store = kvtier.storage.open(f"file://{tmp_path}")
    path = tmp_path / "probe"
    path.write_bytes(bytes(range(256)) * 16 * pages)
    head = np.zeros(ALIGN, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, pages * ALIGN, 0)
        assert store._is_cold(fd, pages * ALIGN, head) == (False, ask == "nowait")
        assert bytes(head[:256]) == (bytes(range(256)) if ask == "nowait" else bytes(256))
        for _ in range(20):
            evict_cached(tmp_path)
            if store._is_cold(fd, pages * ALIGN, np.zeros(ALIGN, dtype=np.uint8)) == (True, False):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the file stayed cached after 20 evictions")
    finally:
        os.close(fd)


@NEEDS_DIRECT
def test_a_filesystem_without_direct_io_reads_buffered(monkeypatch, tmp_path):
    """Where opening with O_DIRECT fails (tmpfs), the store turns direct reads off and
    reads the same bytes buffered (the per-file path, which the compiled reader hands
    such files to)."""
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    host, idx = filled_host(ALIGNED, 2, page_size=16, seed=12)
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = kvtier.storage.page_keys(list(range(32)), 16, namespace="t")
    assert store.batch_set(keys, host, idx) == [True] * 2
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(store, "_is_cold", lambda fd, size, head: (True, False))
    reader, ridx = blank_host(ALIGNED, 32, page_size=16, layout="page_head")
    assert store.batch_get(keys, reader, ridx) == [True] * 2
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
    assert store.direct_io is False


@pytest.fixture
def tmpfs_dir():
    """A new directory on a tmpfs (``/dev/shm``), removed after the test."""
    mounts = Path("/proc/mounts").read_text().split("\n") if Path("/proc/mounts").exists() else []
    if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts if line):
        pytest.skip("no tmpfs at /dev/shm here")
    path = Path(tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


_TMPFS_ROUND_TRIP = """
import json, os, torch
import kvtier.storage
from kvtier import KVSpec
from kvtier.storage import pageio
from tests.support.storage import blank_host, filled_host, flat_pages
root, spec = {root!r}, KVSpec.mha(2, 2, 64)
store = kvtier.storage.open(f"file://{{root}}")
host, idx = filled_host(spec, 3, page_size=16, layout="page_head", seed=5)
keys = kvtier.storage.page_keys(list(range(48)), 16, namespace="t")
put = store.batch_set(keys, host, idx)
reader, ridx = blank_host(spec, 48, page_size=16, layout="page_head")
got = store.batch_get(keys, reader, ridx)
same = all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
fd = os.open(root, os.O_RDONLY)
print(json.dumps({{"compiled": pageio.compiled(), "cachestat": pageio.cached_pages(fd, 0, 1) is not None,
                  "put": put, "got": got, "same": same, "errors": store.stats()["errors"]}}))
"""


@pytest.mark.parametrize("how", ["python", "compiled"])
def test_a_store_on_tmpfs_reads_its_pages_where_the_page_cache_cannot_be_counted(tmpfs_dir, monkeypatch, how):
    """Where ``cachestat`` cannot be asked (the Python path, a kernel before 6.5, a sandbox
    that forbids it), the cold check asks for a file's header without waiting; tmpfs
    answers that with EOPNOTSUPP, which made every get of a store on it an error and a
    miss. A tmpfs file is in memory: it is read as cached. The compiled path runs in a
    child whose ``cachestat`` fails with ENOSYS, as on an older kernel."""
    code = _TMPFS_ROUND_TRIP.format(root=str(tmpfs_dir))
    if how == "python":
        monkeypatch.setenv("KVTIER_NATIVE", "0")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<tmpfs round trip>", "exec"), {"__name__": "tmpfs_round_trip"})
        result = json.loads(out.getvalue())
    else:
        if not seccomp.available():
            pytest.skip("no seccomp filter for this machine's system call numbers")
        child = seccomp.run_denied("cachestat", errno.ENOSYS, code)
        assert child.returncode == 0, child.stderr[-2000:]
        result = json.loads(child.stdout)
        if not result["compiled"]:
            unavailable("kvtier.storage._pageio is not built or bound")
    assert result["cachestat"] is False  # (the check that takes the header's path)
    assert result == {**result, "put": [True] * 3, "got": [True] * 3, "same": True, "errors": 0}


def _cached_share(path) -> float | None:
    """The share of ``path``'s pages in the page cache (None where it cannot be counted)."""
    cached = cached_pages_of(path)
    return None if cached is None else cached / -(-os.path.getsize(path) // 4096)


@NEEDS_DIRECT
@pytest.mark.parametrize("native", ["compiled", "python"])
@pytest.mark.parametrize("layout", ["page_head", "page_first"])
def test_direct_writes_round_trip_bit_exactly(tmp_path, monkeypatch, layout, native):
    """With ``direct_writes``, aligned pages are written with O_DIRECT (in place or from
    staging; by the compiled writer, or the per-file path where it is not used): their
    files are out of the page cache once written, unaligned ones (written buffered) in
    it; all read back bit-exactly, from a new store too."""
    if not direct_allowed(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    if native == "python":
        monkeypatch.setattr(pageio, "write_pages", lambda *a, **k: None)
    elif not pageio.compiled():
        unavailable("kvtier.storage._pageio is not built or bound, or KVTIER_NATIVE=0")
    store = kvtier.storage.open(f"file://{tmp_path}?direct_writes=true")
    host, idx = filled_host(ALIGNED, 4, page_size=16, layout=layout, seed=13)
    keys = kvtier.storage.page_keys(list(range(64)), 16, namespace="w")
    assert store.batch_set(keys, host, idx) == [True] * 4
    aligned = [str(p) for p in stored_files(tmp_path)]
    small, sidx = filled_host(SPEC, 2, seed=14)  # 480-byte parts: no O_DIRECT
    assert store.batch_set(keys_for(2), small, sidx) == [True] * 2
    unaligned = [str(p) for p in stored_files(tmp_path) if str(p) not in aligned]
    assert len(aligned) == 4 and len(unaligned) == 2 and store.direct_writes
    shares = [_cached_share(p) for p in aligned + unaligned]
    if None in shares:
        unavailable("the page cache's residency cannot be counted here (cachestat, Linux 6.5)")
    assert shares == [0.0] * 4 + [1.0] * 2
    for reader_store in (store, kvtier.storage.open(f"file://{tmp_path}")):
        reader, ridx = blank_host(ALIGNED, 64, page_size=16, layout="page_head")
        assert reader_store.batch_get(keys, reader, ridx) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
    back, bidx = blank_host(SPEC, 8)
    assert store.batch_get(keys_for(2), back, bidx) == [True] * 2
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(back, bidx), flat_pages(small, sidx)))


def test_batches_are_cut_into_steps_of_at_least_least_pages_within_a_workers_share(tmp_path):
    """``_run``'s steps: ``CHUNK_BYTES`` of pages (one page where pages are larger), at
    least ``least`` pages, never more than one worker's share of the batch."""
    store = kvtier.storage.open(f"file://{tmp_path}", io_threads=2)
    for n, least, want in ((20, 1, [1] * 20), (20, 8, [8, 8, 4]), (6, 8, [3, 3])):
        steps = []
        store._run(lambda chunk: steps.append(chunk), n, store.CHUNK_BYTES * 2, least=least)
        assert sorted(len(c) for c in steps) == sorted(want) and sorted(i for c in steps for i in c) == list(range(n))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_compiled_readers_threads_share_a_batch_each_file_read_once(tmp_path, monkeypatch, threads):
    """Each of ``io_threads`` threads reads the batch in one call of the compiled reader,
    the calls taking its files in turn from one claim: every file is read by exactly one
    call (the others answer ``ELSEWHERE`` for it), and every page comes back bit-exact."""
    if not pageio.compiled():
        unavailable("kvtier.storage._pageio is not built or bound, or KVTIER_NATIVE=0")
    host, idx = filled_host(SPEC, 64, seed=21)
    store = kvtier.storage.open(f"file://{tmp_path}", io_threads=threads)
    keys = keys_for(64)
    assert store.batch_set(keys, host, idx) == [True] * 64
    answers, real = [], pageio.read_pages

    def spy(*args):
        assert len(args[5]) == 64  # the whole batch
        answers.append(out := real(*args))
        return out

    monkeypatch.setattr(pageio, "read_pages", spy)
    reader, ridx = blank_host(SPEC, 64 * 4)
    assert store.batch_get(keys, reader, ridx) == [True] * 64
    assert 1 <= len(answers) <= threads
    taken = [sum(a[f] != pageio.ELSEWHERE for a in answers) for f in range(64)]
    assert taken == [1] * 64
    assert all(a[f] == pageio.READ for a in answers for f in range(64) if a[f] != pageio.ELSEWHERE)
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
