"""File backend: corruption, hostile files, restarts across processes, capacity, path safety, options."""

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtier.storage
from kvtier.storage import file_names
from kvtier import HostKVPool, KVSpec
from kvtier.storage.objects import PagePlan
from kvtier.storage.pagefile import ALIGN, FileLayout, object_name
from tests.support import ROOT
from tests.support.pools import SPECS
from tests.support.storage import (PeakRSS, blank_host, file_size_limit, filled_host, flat_pages, object_files,
                                   run_bounded)

SPEC = SPECS["asym"]


def keys_for(n, start=0):
    return kvtier.storage.page_keys(list(range(start, start + 4 * n)), 4, namespace="m")


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "header"])
def test_corrupt_object_is_a_counted_miss_and_is_deleted(tmp_path, damage):
    host, idx = filled_host(SPEC, 2, layout="page_head")  # head order: the page_first reader stages it
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(2)
    store.batch_set(keys, host, idx)
    files = object_files(tmp_path)
    assert len(files) == 2  # one file a page, holding its 4 head groups (gcd of the 4 K and 4 V heads)
    victim = files[0]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-1] ^= 0x40
    elif damage == "truncate":
        data = data[:-7]
    elif damage == "empty":
        data = bytearray()
    else:
        data[0:4] = b"XXXX"
    victim.write_bytes(bytes(data))
    reader, ridx = blank_host(SPEC, 8)
    before = [p.clone() for p in flat_pages(reader, ridx)]
    got = store.batch_get(keys, reader, ridx)
    assert got.count(False) == 1
    bad = got.index(False)
    assert torch.equal(flat_pages(reader, ridx)[bad], before[bad]), "a corrupt page must not touch KV"
    assert store.stats()["corrupt"] == 1 and not victim.exists()


def test_a_second_process_reads_what_the_first_wrote(tmp_path):
    host, idx = filled_host(SPEC, 3, seed=4)
    store = kvtier.storage.open(f"file://{tmp_path}")
    assert store.batch_set(keys_for(3), host, idx) == [True] * 3
    want = [p.tolist() for p in flat_pages(host, idx)]
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import kvtier.storage
        from kvtier import HostKVPool
        from tests.support.pools import SPECS, bits
        store = kvtier.storage.open("file://{tmp_path}")
        keys = kvtier.storage.page_keys(list(range(12)), 4, namespace="m")
        host = HostKVPool(SPECS["asym"], 12, 4, layout="page_head")
        idx = host.alloc(12)
        print(json.dumps({{"exists": store.batch_exists(keys), "got": store.batch_get(keys, host, idx),
                          "pages": [bits(host.get_data_page(s)).tolist() for s in (0, 4, 8)]}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    import json

    result = json.loads(out.stdout)
    assert result["exists"] == 3 and result["got"] == [True] * 3 and result["pages"] == want


def test_capacity_evicts_least_recently_used_keys(tmp_path):
    host, idx = filled_host(SPEC, 5)
    probe = kvtier.storage.open(f"file://{tmp_path}/probe")
    probe.batch_set(keys_for(1), host, idx[:4])
    page_bytes = sum(p.stat().st_size for p in object_files(tmp_path / "probe"))
    # one I/O thread: with more, the pages of one batch enter the LRU in completion order
    store = kvtier.storage.open(f"file://{tmp_path}/lru", capacity_bytes=3 * page_bytes, io_threads=1)
    keys = keys_for(5)
    store.batch_set(keys[:3], host, idx[:12])
    assert store.batch_get(keys[:1], host, idx[:4]) == [True]  # key 0 becomes most recent
    store.batch_set(keys[3:4], host, idx[12:16])  # evicts key 1, the least recently used
    present = [store.batch_exists([k]) for k in keys]
    assert present == [1, 0, 1, 1, 0] and store.stats()["evictions"] == 1
    assert store.usage_bytes() == 3 * page_bytes
    # the sleeps part the files' mtimes, which the kernel stamps from a clock of a few ms
    time.sleep(0.05)
    store.batch_set(keys[3:4], host, idx[12:16])  # written again: replaces its file, counted once
    assert store.usage_bytes() == 3 * page_bytes and store.stats()["evictions"] == 1
    time.sleep(0.05)
    assert store.batch_get(keys[2:3], host, idx[8:12]) == [True]  # order now 0, 3, 2
    reopened = kvtier.storage.open(f"file://{tmp_path}/lru", capacity_bytes=2 * page_bytes)
    assert reopened.usage_bytes() == 2 * page_bytes  # shrinking the capacity evicts at open ...
    assert [reopened.batch_exists([k]) for k in keys] == [0, 0, 1, 1, 0]  # ... the oldest, by the files' mtimes



@pytest.mark.parametrize("gone", ["files", "shards"])
def test_a_store_opens_with_capacity_while_another_engine_removes_its_files(tmp_path, monkeypatch, gone):
    """Opening with ``capacity_bytes`` counts the files found. Another engine sharing the
    directory may evict a file, or a whole shard, between its listing and its stat: the
    open then counts what is left, where it raised ``FileNotFoundError``. Here every
    file, or every shard, is removed just after the directory listing names it."""
    host, idx = filled_host(SPEC, 2)
    kvtier.storage.open(f"file://{tmp_path}").batch_set(keys_for(2), host, idx)
    listing = os.scandir

    class Racing:
        def __init__(self, path):
            self.entries = listing(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.entries.close()

        def __iter__(self):
            for e in self.entries:
                if gone == "files" and e.is_file(follow_symlinks=False):
                    os.unlink(e.path)
                elif gone == "shards" and e.is_dir(follow_symlinks=False) and len(e.name) == 2:
                    shutil.rmtree(e.path)
                yield e

    monkeypatch.setattr(kvtier.storage.file.os, "scandir", Racing)
    store = kvtier.storage.open(f"file://{tmp_path}", capacity_bytes=1 << 30)
    monkeypatch.undo()
    assert store.usage_bytes() == 0 and object_files(tmp_path) == []
    assert store.batch_set(keys_for(2), host, idx) == [True, True] and store.usage_bytes() > 0


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_link_at_a_shards_name_is_removed_not_followed(tmp_path, monkeypatch, native):
    """A symlink planted at a shard's name before the store first uses that shard would
    lead the writes, reads, lookups and deletes of its keys to the directory it names.
    It is removed at the first use (a counted fault), the shard is made as the store's
    own, and nothing outside is written, read or deleted. Both paths: the compiled
    writer and reader take the store's paths."""
    monkeypatch.setenv("KVTIER_NATIVE", native)
    host, idx = filled_host(SPEC, 1)
    key, = keys_for(1)
    store = kvtier.storage.open(f"file://{tmp_path}/store")
    shard = tmp_path / "store" / "kvtier-v5" / hashlib.sha256(key.encode()).hexdigest()[:2]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"x")
    shard.symlink_to(outside)
    assert store.batch_set([key], host, idx) == [True]
    assert store.stats()["errors"] == 1 and shard.is_dir() and not shard.is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]
    reader, ridx = blank_host(SPEC, 4)
    assert store.batch_get([key], reader, ridx) == [True] and store.batch_exists([key]) == 1
    assert torch.equal(flat_pages(reader, ridx)[0], flat_pages(host, idx)[0])
    store.delete([key])
    assert store.batch_exists([key]) == 0 and (outside / "keep").exists() and store.stats()["errors"] == 1


def test_a_key_written_again_while_it_is_deleted_stays_counted_for_the_capacity(tmp_path):
    """A delete of a key and a write of it again may interleave: here the write lands
    just after the delete removed the key's old file. The new file is counted in the
    capacity, so it is evicted in its turn (before, the delete dropped its count after
    the write had made it: a file on disk that no eviction would ever remove)."""
    host, idx = filled_host(SPEC, 2)
    keys = keys_for(2)
    store = kvtier.storage.open(f"file://{tmp_path}", capacity_bytes=1 << 30, io_threads=1)
    assert store.batch_set(keys[:1], host, idx[:4]) == [True]
    one = store.usage_bytes()
    unlink = store._unlink

    def unlink_then_write_again(path):
        unlink(path)
        store._unlink = unlink
        assert store.batch_set(keys[:1], host, idx[:4]) == [True]

    store._unlink = unlink_then_write_again
    store.delete(keys[:1])
    assert store.batch_exists(keys[:1]) == 1 and store.usage_bytes() == one
    store.capacity_bytes = one  # a second key's write evicts the first, now the least recently used
    assert store.batch_set(keys[1:], host, idx[4:]) == [True]
    assert store.batch_exists(keys[:1]) == 0 and len(object_files(tmp_path)) == 1


def test_marking_a_read_key_used_touches_no_file_a_link_at_its_name_points_to(tmp_path):
    """A read key's files get a new mtime (their LRU order at the next open). A link put
    at a file's name since the read is not followed: what it points to keeps its mtime."""
    host, idx = filled_host(SPEC, 1)
    key, = keys_for(1)
    store = kvtier.storage.open(f"file://{tmp_path}/store", capacity_bytes=1 << 30)
    assert store.batch_set([key], host, idx) == [True]
    path, = object_files(tmp_path / "store")
    victim = tmp_path / "victim"
    victim.write_bytes(b"x")
    os.utime(victim, (1, 1))
    path.unlink()
    path.symlink_to(victim)
    field = path.name.split(".", 1)[1].replace(".", "/")
    store._touch(store._stem(key), [(field, [])])
    assert victim.stat().st_mtime == 1

def _sharing_a_shard(n):
    """``n`` keys whose hashes share their first byte: their files share a shard directory."""
    by_shard = {}
    for key in keys_for(64 * n):
        by_shard.setdefault(hashlib.sha256(key.encode()).hexdigest()[:2], []).append(key)
    return next(ks for ks in by_shard.values() if len(ks) >= n)[:n]


def test_a_keys_files_sit_side_by_side_in_its_shard(tmp_path):
    host, idx = filled_host(SPEC, 3)
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = _sharing_a_shard(3)
    assert store.batch_set(keys, host, idx) == [True] * 3
    root = tmp_path / "kvtier-v5"
    shard = hashlib.sha256(keys[0].encode()).hexdigest()[:2]
    assert sorted(p.name for p in root.iterdir()) == [shard, "names"]  # its shard, and the registry of names
    assert all(p.is_file() for p in (root / shard).iterdir())
    assert sorted(p.name.partition(".")[0] for p in (root / shard).iterdir()) \
        == sorted(hashlib.sha256(k.encode()).hexdigest()[2:] for k in keys)
    assert [len(store._key_files(k)) for k in keys] == [1, 1, 1]

    store.delete(keys[1:2])  # a key's delete leaves its neighbours in the shard whole
    unbound = kvtier.storage.open(f"file://{tmp_path}")  # no geometry: asks under the registry's names
    assert [unbound.batch_exists([k]) for k in keys] == [1, 0, 1] and unbound.batch_exists(keys) == 1
    assert unbound.exists_each(keys) == [True, False, True]
    shutil.rmtree(root / "names")  # a store written before the registry: its shards are listed
    assert [unbound.batch_exists([k]) for k in keys] == [1, 0, 1] and unbound.batch_exists(keys) == 1
    assert unbound.exists_each(keys) == [True, False, True]
    reader, ridx = blank_host(SPEC, 12)
    assert store.batch_get(keys, reader, ridx) == [True, False, True]
    want, got = flat_pages(host, idx), flat_pages(reader, ridx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


def test_a_bound_miss_asks_each_name_once(tmp_path):
    """A missing key's own file, then the files of its other writers (the other-TP cover):
    no name is asked twice."""
    store = kvtier.storage.open(f"file://{tmp_path}", spec=SPEC, page_size=4)
    asked = []
    is_object = store._is_object
    store._is_object = lambda path: asked.append(path) or is_object(path)
    assert store.exists_each(keys_for(2)) == [False, False]
    assert len(asked) == len(set(asked)) > 2


def test_keys_never_leave_the_directory(tmp_path):
    host, idx = filled_host(SPEC, 1)
    root = tmp_path / "store"
    store = kvtier.storage.open(f"file://{root}")
    evil = ["../../escape", "/etc/passwd", "a/../../../b"]
    for key in evil:
        assert store.batch_set([key], host, idx) == [True]
        assert store.batch_exists([key]) == 1
    assert all(root in p.parents for p in object_files(tmp_path))
    assert {p.parent.parent.name for p in object_files(tmp_path)} == {"kvtier-v5"}


def test_open_rejects_bad_urls(tmp_path):
    for url, match in [("file://host/x", "names host 'host'"), ("s3://bucket", "unknown storage scheme 's3'"),
                       ("/tmp/x", "scheme://"), ("file://", "no path")]:
        with pytest.raises(ValueError, match=match):
            kvtier.storage.open(url)
    with pytest.raises(ValueError, match="capacity_bytes"):
        kvtier.storage.open(f"file://{tmp_path}", capacity_bytes=0)
    (tmp_path / "a_file").write_text("")
    for unusable in ("/proc/x", f"{tmp_path}/a_file/below"):
        with pytest.raises(ValueError, match="file storage: cannot use directory .*/kvtier-v5: "):
            kvtier.storage.open(f"file://{unusable}")
    with pytest.raises(ValueError, match="head_groups 3 does not divide"):
        kvtier.storage.open(f"file://{tmp_path}", spec=SPEC, page_size=4, head_groups=3)


def test_unwritable_directory_is_a_counted_failure(tmp_path):
    host, idx = filled_host(SPEC, 1)
    store = kvtier.storage.open(f"file://{tmp_path}")
    Path(store._stem(keys_for(1)[0])).parent.write_text("a file where the key's shard directory should be")
    assert store.batch_set(keys_for(1), host, idx) == [False]
    assert store.stats()["errors"] >= 1 and store.stats()["write_failures"] == 1
    assert store.batch_get(keys_for(1), host, idx) == [False]


@pytest.mark.parametrize("hostile", ["sparse_1gib", "symlink_to_dev_zero", "fifo", "directory"])
def test_hostile_file_at_an_object_path_is_a_counted_miss(tmp_path, hostile):
    """Whatever sits at an object's path is opened without following links or blocking,
    and read only if it is a regular file of the expected size."""
    host, idx = filled_host(SPEC, 2)
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(2)
    store.batch_set(keys, host, idx)
    victim = object_files(tmp_path)[0]
    victim.unlink()
    if hostile == "sparse_1gib":
        with open(victim, "wb") as f:
            f.truncate(1 << 30)
    elif hostile == "symlink_to_dev_zero":
        victim.symlink_to("/dev/zero")
    elif hostile == "fifo":
        os.mkfifo(victim)
    else:
        victim.mkdir()
    reader, ridx = blank_host(SPEC, 8)
    before = [p.clone() for p in flat_pages(reader, ridx)]
    with PeakRSS() as rss:
        got = run_bounded(lambda: store.batch_get(keys, reader, ridx))
    assert got.count(False) == 1
    bad = got.index(False)
    assert torch.equal(flat_pages(reader, ridx)[bad], before[bad]), "the destination page must be untouched"
    assert torch.equal(flat_pages(reader, ridx)[1 - bad], flat_pages(host, idx)[1 - bad])
    assert store.stats()["errors"] == 1 and store.stats()["hits"] == 1
    assert rss.growth < 200 << 20, f"peak RSS grew by {rss.growth >> 20} MiB"
    store.delete(keys)  # whatever sits at a key's names goes with the key, and no fault is counted
    assert object_files(tmp_path) == [] and not victim.exists() and not victim.is_symlink()
    assert store.stats()["errors"] == 1


def test_only_objects_that_call_themselves_corrupt_are_deleted(tmp_path):
    """An intact object whose header promises another length is a counted miss and
    stays; one with bytes appended after its last part is corrupt and is deleted."""
    from kvtier.storage.pagefile import FileLayout

    host, idx = filled_host(SPEC, 2)
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(2)
    store.batch_set(keys, host, idx)
    intact, extended = object_files(tmp_path)
    assert intact.name.split(".")[0] != extended.name.split(".")[0]  # one object of each page
    key = next(k for k in keys if str(intact) in store._key_files(k))
    other = FileLayout(f"{key}#{intact.name.partition('.')[2].replace('.', '/')}", [100])
    blob = np.frombuffer(other.header([0]) + bytes(100), dtype=np.uint8)  # a whole object of one 100-byte part
    intact.write_bytes(blob.tobytes())
    extended.write_bytes(extended.read_bytes() + b"tail")
    reader = HostKVPool(SPEC, 8, 4)
    assert store.batch_get(keys, reader, reader.alloc(8)) == [False, False]
    stats = store.stats()
    assert stats["corrupt"] == 1 and stats["errors"] == 2
    assert intact.read_bytes() == blob.tobytes() and not extended.exists()


def test_options_in_the_url_query(tmp_path):
    host, idx = filled_host(SPEC, 4)
    probe = kvtier.storage.open(f"file://{tmp_path}/probe")
    probe.batch_set(keys_for(1), host, idx[:4])
    page_bytes = sum(p.stat().st_size for p in object_files(tmp_path / "probe"))
    store = kvtier.storage.open(f"file://{tmp_path}/lru?capacity_bytes={2 * page_bytes}&io_threads=1&fsync=true")
    assert (store.capacity_bytes, store.io_threads, store.fsync) == (2 * page_bytes, 1, True)
    assert store.batch_set(keys_for(4), host, idx) == [True] * 4
    assert [store.batch_exists([k]) for k in keys_for(4)] == [0, 0, 1, 1]  # the capacity applies
    assert store.stats()["evictions"] == 2


@pytest.mark.parametrize("query, match", [
    ("colour=blue", "unknown URL option 'colour'; supported URL options: capacity_bytes, cold_reads, direct_io, "
                    "direct_writes, fsync, head_groups, io_threads, page_size"),
    ("cold_reads=sometimes", "cold_reads"),
    ("capacity_bytes=100kb", "capacity_bytes='100kb' is not a int"),
    ("capacity_bytes=0", "capacity_bytes must be a int >= 1"),
    ("fsync=maybe", "fsync='maybe' is not a bool"),
    ("io_threads=2&io_threads=3", "io_threads' given more than once"),
    ("page_size=4", "spec= and page_size= bind"),
])
def test_bad_url_options_fail_at_open(tmp_path, query, match):
    with pytest.raises(ValueError, match=match):
        kvtier.storage.open(f"file://{tmp_path}?{query}")


def test_bad_keyword_options_fail_at_open(tmp_path):
    with pytest.raises(ValueError, match="io_threads' given more than once"):
        kvtier.storage.open(f"file://{tmp_path}?io_threads=2", io_threads=2)
    with pytest.raises(ValueError, match="unknown options \\['ttl'\\]; supported URL options: capacity_bytes"):
        kvtier.storage.open(f"file://{tmp_path}", ttl=60)
    with pytest.raises(ValueError, match="fsync must be a bool"):
        kvtier.storage.open(f"file://{tmp_path}", fsync="yes")


@pytest.mark.parametrize("umask", [0o000, 0o077], ids=["loosest", "strictest"])
def test_objects_are_owner_only_whatever_the_umask(tmp_path, umask):
    """The store's own modes decide, whether the umask would leave more bits (the
    loosest) or take some of them (the strictest takes a shared store's group bits)."""
    import stat

    old = os.umask(umask)
    try:
        private = kvtier.storage.open(f"file://{tmp_path}/private")
        shared = kvtier.storage.open(f"file://{tmp_path}/shared?shared=true")
        for store in (private, shared):
            pool = HostKVPool(KVSpec.mha(1, 1, 8), 8, 4)
            assert store.batch_set(["k0", "k1"], pool, torch.arange(8)) == [True, True]
    finally:
        os.umask(old)
    for name, (dirs, files) in {"private": (0o700, 0o600), "shared": (0o770, 0o660)}.items():
        root = tmp_path / name / "kvtier-v5"
        found = list(root.rglob("*"))
        assert {stat.S_IMODE(p.stat().st_mode) for p in found if p.is_dir()} | {stat.S_IMODE(root.stat().st_mode)} \
            == {dirs}
        assert {stat.S_IMODE(p.stat().st_mode) for p in found if p.is_file()} == {files}
        assert any(p.is_file() for p in found)


def test_a_write_that_fails_midway_leaves_no_file_behind(tmp_path, pageio_path):
    """The file system refuses a write in the middle of a page's second part: the page
    is not stored, counted once, and neither its temporary file nor a partial object
    stays; the store writes the page once writes succeed again, and with capacity set
    its usage counts only what was stored."""
    host, idx = filled_host(SPEC, 2)
    probe = kvtier.storage.open(f"file://{tmp_path / 'probe'}")
    probe.batch_set(keys_for(1), host, idx[:4])
    written, = object_files(tmp_path / "probe")
    layout = FileLayout(object_name(written.read_bytes()[:ALIGN]), [p.nbytes for p in PagePlan(SPEC, 4).write_parts])
    tmp_path = tmp_path / "store"
    store = kvtier.storage.open(f"file://{tmp_path}", capacity_bytes=1 << 30)
    with file_size_limit(layout.offsets[1] + 100):
        assert store.batch_set(keys_for(1), host, idx[:4]) == [False]
    assert object_files(tmp_path) == []  # (its name is in the registry: names are no objects)
    stats = store.stats()
    assert (stats["errors"], stats["write_failures"], stats["bytes_written"]) == (1, 1, 0)
    assert store.usage_bytes() == 0 and store.batch_exists(keys_for(1)) == 0
    assert store.batch_set(keys_for(1), host, idx[:4]) == [True]
    reader, ridx = blank_host(SPEC, 4)
    assert store.batch_get(keys_for(1), reader, ridx) == [True]
    assert torch.equal(flat_pages(reader, ridx)[0], flat_pages(host, idx)[0])
    assert store.usage_bytes() == len(object_files(tmp_path)[0].read_bytes())


def test_a_fault_of_the_compiled_writer_makes_its_steps_pages_unstored(tmp_path, monkeypatch):
    """An unexpected error of the compiled writer is one counted error per step; its
    step's pages are not stored (and not half-written: no file appears), and the store
    writes them once the writer works again."""
    from kvtier.storage import pageio
    from tests.support.services import unavailable

    if not pageio.compiled():
        unavailable("kvtier.storage._pageio is not built or bound, or KVTIER_NATIVE=0")
    host, idx = filled_host(SPEC, 4, seed=8)
    store = kvtier.storage.open(f"file://{tmp_path}", io_threads=1)
    real = pageio.write_pages
    monkeypatch.setattr(pageio, "write_pages", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    assert store.batch_set(keys_for(4), host, idx) == [False] * 4
    stats = store.stats()
    assert (stats["errors"], stats["write_failures"], stats["pages_written"]) == (1, 4, 0)
    assert object_files(tmp_path) == []
    monkeypatch.setattr(pageio, "write_pages", real)
    assert store.batch_set(keys_for(4), host, idx) == [True] * 4
    reader, ridx = blank_host(SPEC, 16)
    assert store.batch_get(keys_for(4), reader, ridx) == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))


def test_clear_removes_every_object_and_stray_but_keeps_the_shard_directories(tmp_path):
    """A clear leaves the store as a running one has it, shard directories made (the next
    puts then make none), and nothing else: no object, no stray file or directory,
    inside a shard or beside them."""
    host, idx = filled_host(SPEC, 6)
    keys = keys_for(6)
    store = kvtier.storage.open(f"file://{tmp_path}")
    assert store.batch_set(keys, host, idx) == [True] * 6
    root = tmp_path / "kvtier-v5"
    shards = sorted(p for p in root.iterdir() if p.is_dir() and p.name != file_names.DIRECTORY)
    assert shards and len(object_files(tmp_path)) == 6
    (shards[0] / "stray").write_bytes(b"x")
    (shards[0] / "nested").mkdir()
    (root / "zz").mkdir()  # not a shard's name
    (root / "notes.txt").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"x")
    (root / "ff").symlink_to(outside)  # a shard's name, but a link: removed, not followed
    store.clear()
    assert sorted(root.iterdir()) == shards and all(not any(s.iterdir()) for s in shards)
    assert (outside / "keep").exists()
    assert store.batch_exists(keys) == 0 and store.stats()["errors"] == 0
    assert store.batch_set(keys, host, idx) == [True] * 6
    reader, ridx = blank_host(SPEC, 24)
    assert store.batch_get(keys, reader, ridx) == [True] * 6
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
