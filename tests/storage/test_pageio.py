"""A page file's parts moved and checksummed (``kvtier.storage.pageio``): the compiled
loop and the Python one move the same bytes and give xxh3-64 digests of each part,
whatever the chunk and the buffers' boundaries; faults are OSErrors; nothing is hashed
that was not moved."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import xxhash

from kvtier.storage import pageio
from tests.support.services import unavailable
from tests.support.sysfs import cache_dir
from tests.support.storage import file_size_limit, object_files

RNG = np.random.default_rng(5)


def _parts(sizes_per_part, start=4096):
    """``(offset, buffers)`` per part, random bytes, parts 4 KiB apart as in a page file."""
    parts, offset = [], start
    for sizes in sizes_per_part:
        bufs = [RNG.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        parts.append((offset, bufs))
        offset += -(-sum(sizes) // 4096) * 4096
    return parts


SHAPES = [[[1]], [[100, 0, 7], [5000]], [[pageio.CHUNK + 3, 17], [2 * pageio.CHUNK], [pageio.CHUNK - 1, 1, 9]]]


@pytest.mark.parametrize("chunk", [0, 7, 4096, pageio.CHUNK])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_parts_written_and_read_back_with_each_part_digest(tmp_path, pageio_path, chunk, shape):
    parts = _parts(SHAPES[shape])
    want = tuple(xxhash.xxh3_64_intdigest(b"".join(b.tobytes() for b in bufs)) for _, bufs in parts)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert pageio.move(fd, parts, write=True, chunk=chunk) == want
        data = (tmp_path / "f").read_bytes()
        for offset, bufs in parts:
            joined = b"".join(b.tobytes() for b in bufs)
            assert data[offset:offset + len(joined)] == joined
        back = [(offset, [np.zeros_like(b) for b in bufs]) for offset, bufs in parts]
        assert pageio.move(fd, back, write=False, chunk=chunk) == want
        for (_, bufs), (_, got) in zip(parts, back):
            assert all(np.array_equal(a, b) for a, b in zip(bufs, got))
    finally:
        os.close(fd)


def test_the_python_loop_moves_pieces_that_end_at_chunk_multiples_of_the_file(tmp_path, monkeypatch):
    """Pieces are aligned in the file, not in the buffers (a part starts after its 4 KiB
    header): every piece but a buffer's last ends at a multiple of ``chunk``, none is
    longer than ``chunk``, and together they cover each buffer once, in order."""
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    calls = []
    real = pageio.io_all
    monkeypatch.setattr(pageio, "io_all", lambda call, fd, bufs, offset: calls.append(
        (offset, sum(len(b) for b in bufs))) or real(call, fd, bufs, offset))
    chunk = 4096
    parts = _parts([[3 * chunk + 5, 2 * chunk], [chunk + 1]])
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        pageio.move(fd, [(offset + 100, bufs) for offset, bufs in parts], write=True, chunk=chunk)
    finally:
        os.close(fd)
    ends = {offset + 100 + sum(len(b) for b in bufs[:i + 1]) for offset, bufs in parts for i in range(len(bufs))}
    assert all(n <= chunk and ((at + n) % chunk == 0 or at + n in ends) for at, n in calls)
    covered = [(offset + 100, sum(len(b) for b in bufs)) for offset, bufs in parts]
    pos = iter(calls)
    for start, length in covered:  # in order, no gap, no overlap
        at = start
        while at < start + length:
            got, n = next(pos)
            assert got == at
            at += n
        assert at == start + length
    assert next(pos, None) is None


def test_the_two_loops_agree_on_a_damaged_part(tmp_path, monkeypatch):
    """One flipped bit changes that part's digest only, in either loop."""
    if not pageio.compiled():
        unavailable("kvtier.storage._pageio is not built or bound, or KVTIER_NATIVE=0")
    parts = _parts([[3000], [pageio.CHUNK + 5]])
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        sums = pageio.move(fd, parts, write=True)
        os.pwrite(fd, bytes([parts[1][1][0][9] ^ 1]), parts[1][0] + 9)
        got = {}
        for flag in ("1", "0"):
            monkeypatch.setenv("KVTIER_NATIVE", flag)
            back = [(offset, [np.zeros_like(b) for b in bufs]) for offset, bufs in parts]
            got[flag] = pageio.move(fd, back, write=False)
    finally:
        os.close(fd)
    assert got["1"] == got["0"] and got["1"][0] == sums[0] and got["1"][1] != sums[1]


def test_a_read_past_the_end_is_an_eio(tmp_path, pageio_path):
    (tmp_path / "f").write_bytes(b"x" * 5000)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        into = np.zeros(2000, dtype=np.uint8)
        with pytest.raises(OSError) as e:
            pageio.move(fd, [(4096, [into])], write=False)
        assert e.value.errno == errno.EIO
        assert bytes(into[:904]) == b"x" * 904  # what was there was read
    finally:
        os.close(fd)


def test_a_write_refused_midway_is_an_oserror(tmp_path, pageio_path):
    """The file system refuses the write past a size limit: an OSError (EFBIG), the bytes
    before the limit written."""
    parts = _parts([[10000]], start=0)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with file_size_limit(6000), pytest.raises(OSError) as e:
            pageio.move(fd, parts, write=True, chunk=4096)
    finally:
        os.close(fd)
    assert e.value.errno == errno.EFBIG
    assert (tmp_path / "f").read_bytes() == parts[0][1][0].tobytes()[:6000]


def test_reads_need_writable_buffers_and_parts_their_shape(tmp_path, pageio_path):
    (tmp_path / "f").write_bytes(b"y" * 8192)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises((TypeError, BufferError)):
            pageio.move(fd, [(0, [bytes(10)])], write=False)
        with pytest.raises(TypeError):
            pageio.move(fd, [0], write=False)
    finally:
        os.close(fd)


def test_the_switch_turns_the_compiled_loop_off(monkeypatch):
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    assert pageio.compiled() is False


def test_bind_refuses_a_null_address():
    module = pageio.built("kvtier.storage._pageio")
    if module is None:
        unavailable("kvtier.storage._pageio is not built (no C compiler at install time?)")
    with pytest.raises(ValueError):
        module.bind(1, 2, 0, 4, 5)


def test_preallocate_reserves_the_file_or_says_it_did_not(tmp_path, monkeypatch):
    """Compiled, on a file system with fallocate: the new file is ``length`` bytes long
    and its blocks are reserved. Switched off: False, and the file is untouched (no
    emulation that writes zeros). A bad length is refused."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with monkeypatch.context() as mp:
            mp.setenv("KVTIER_NATIVE", "0")
            assert pageio.preallocate(fd, 3 * 4096 + 5) is False
            assert os.fstat(fd).st_size == 0
        if not pageio.compiled():
            unavailable("kvtier.storage._pageio is not built or bound, or KVTIER_NATIVE=0")
        if not pageio.preallocate(fd, 3 * 4096 + 5):
            unavailable(f"the file system of {tmp_path} has no fallocate")
        st = os.fstat(fd)
        assert st.st_size == 3 * 4096 + 5 and st.st_blocks * 512 >= 4 * 4096
        assert os.pread(fd, 100, 4096) == bytes(100)
        with pytest.raises(ValueError, match="length must be positive, got 0"):
            pageio.preallocate(fd, 0)
    finally:
        os.close(fd)


def test_the_file_stores_own_writes_reserve_each_file_whole_before_writing_it(tmp_path, monkeypatch):
    """On the per-file path (the compiled writer's, ``write_pages``, calls fallocate in
    C), every page file is preallocated at its full length, once, before its parts are
    written (a file the disk holds in one extent reads back cold in one request)."""
    import torch

    import kvtier.storage
    from kvtier import HostKVPool, KVSpec

    monkeypatch.setattr(pageio, "write_pages", lambda *a: None)
    asked = []
    real = pageio.preallocate
    monkeypatch.setattr(pageio, "preallocate", lambda fd, n: asked.append((os.fstat(fd).st_size, n)) or real(fd, n))
    store = kvtier.storage.open(f"file://{tmp_path}")
    pool = HostKVPool(KVSpec.mha(2, 2, 8), 8, 4)
    assert store.batch_set(["k0", "k1"], pool, torch.arange(8)) == [True, True]
    sizes = sorted(p.stat().st_size for p in object_files(tmp_path))
    assert sorted(n for _, n in asked) == sizes and all(before == 0 for before, _ in asked)


@pytest.mark.parametrize("size, want", [("2048K", 2 << 20), ("1024K", 1 << 20), ("1M", 1 << 20), ("512K", 512 << 10)])
def test_l2_bytes_read_the_unified_level_2_cache(tmp_path, size, want):
    caches = [("1", "Data", "48K"), ("1", "Instruction", "32K"), ("2", "Unified", size), ("3", "Unified", "105M")]
    assert pageio.l2_bytes(cache_dir(tmp_path, caches)) == want


@pytest.mark.parametrize("caches", [[], [("1", "Data", "48K")], [("2", "Unified", "lots")],
                                    [("2", "Instruction", "1M")]])
def test_l2_bytes_fall_back_where_sysfs_does_not_tell(tmp_path, caches):
    root = tmp_path / "cache"
    root.mkdir()
    assert pageio.l2_bytes(cache_dir(root, caches), default=12345) == 12345
    assert pageio.l2_bytes(str(tmp_path / "missing"), default=777) == 777


@pytest.mark.parametrize("l2, want", [(0, 256 << 10), (300 << 10, 256 << 10), (1 << 20, 256 << 10),
                                      (2 << 20, 512 << 10), (2560 << 10, 512 << 10), (4 << 20, 1 << 20),
                                      (16 << 20, 4 << 20), (32 << 20, 4 << 20)])
def test_the_write_chunk_is_the_largest_power_of_two_in_a_quarter_of_the_l2_within_bounds(l2, want):
    assert pageio.write_chunk(l2) == want
    assert pageio.WRITE_CHUNK == pageio.write_chunk(pageio.l2_bytes())
