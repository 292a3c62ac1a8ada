"""``pageio.read_pages``, the compiled batch reader of page files: each file's wanted
parts land at their pieces in the pool, bit-exact, from the page cache or (cold) with
O_DIRECT; anything but an intact file of the expected object is not read, with its
status; a piece outside the pool is refused before any byte moves."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import xxhash

from kvtier.bench.storage import evict_cached
from kvtier.storage import pageio
from kvtier.storage.pagefile import ALIGN, FileLayout
from tests.support.hostile import Emptying
from tests.support.services import unavailable
from tests.support.storage import direct_allowed

RNG = np.random.default_rng(17)
SIZES = [2 * ALIGN, 2 * ALIGN, 2 * ALIGN, ALIGN + 100]  # the last part unaligned, as a rep part may be
PAGES = 4
# the pool: per page, each part split in two pieces (as K and V of a head group are),
# a block apart (the pieces of the 8 KiB parts stay aligned for O_DIRECT)
HALVES = [(n // 2, n - n // 2) for n in SIZES]
STEP = 16 * ALIGN  # bytes from page to page (room between pages; aligned)


@pytest.fixture(autouse=True)
def _compiled():
    if not pageio.compiled():
        unavailable("kvtier.storage._pageio is not built or bound, or KVTIER_NATIVE=0")


def _pool(pages: int = PAGES) -> np.ndarray:
    raw = np.zeros(pages * STEP + ALIGN, dtype=np.uint8)  # aligned for O_DIRECT
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + pages * STEP]


def _pieces(wanted):
    """``read_pages``'s parts for the parts ``wanted`` of a layout of ``SIZES``."""
    layout = FileLayout("k#f", SIZES)
    out, start = [], 0
    for k, (a, b) in enumerate(HALVES):
        if k in wanted:
            out.append((k, layout.offsets[k], [(start, STEP, a), (start + a + ALIGN, STEP, b)]))
        start += a + b + ALIGN
    return out


def _expected(pool_pages: dict, contents: dict, wanted, pages: int = PAGES) -> np.ndarray:
    """The pool once the files ``contents`` (name -> parts' bytes) are read to their pages."""
    want = _pool(pages)
    for name, page in pool_pages.items():
        for k, _, pieces in _pieces(wanted):
            data = contents[name][k]
            (s0, _, a), (s1, _, b) = pieces
            want[s0 + page * STEP:s0 + page * STEP + a] = data[:a]
            want[s1 + page * STEP:s1 + page * STEP + b] = data[a:]
    return want


def _write(path, name: str, parts=None) -> list[np.ndarray]:
    layout = FileLayout(name, SIZES)
    parts = parts or [RNG.integers(0, 256, n, dtype=np.uint8) for n in SIZES]
    with open(path, "wb") as f:
        f.write(layout.header([xxhash.xxh3_64_intdigest(p) for p in parts]))
        for k, p in enumerate(parts):
            f.seek(layout.offsets[k])
            f.write(p.tobytes())
    return parts


def _files(tmp_path, pages: dict):
    layout = FileLayout("k#f", SIZES)
    return [(str(tmp_path / name), FileLayout(f"{name}#f", SIZES).prefix(), page) for name, page in pages.items()], \
        layout


def _read(pool, files, layout, wanted=range(len(SIZES)), direct=False):
    return list(pageio.read_pages(pool, layout.header_len, layout.total, len(SIZES), _pieces(wanted), files, direct))


@pytest.mark.parametrize("wanted", [range(4), [1, 3], [0, 1]], ids=["all", "gaps", "first-two"])
def test_cached_files_land_at_their_pages_bit_exactly(tmp_path, wanted):
    pages = {"a": 2, "b": 0, "c": 3}  # names of one length: one layout
    contents = {name: _write(tmp_path / name, f"{name}#f") for name in pages}
    files, layout = _files(tmp_path, pages)
    pool = _pool()
    assert _read(pool, files, layout, wanted) == [pageio.READ] * 3
    assert np.array_equal(pool, _expected(pages, contents, wanted))  # page 1 and the gaps untouched


def test_anything_but_the_intact_expected_file_is_not_read(tmp_path):
    """Missing; under a regular file (ENOTDIR: ``OTHER``, for the caller to judge, not
    missing); a symlink to a good file; a FIFO (no block); another size; another
    object's header; a damaged part; bytes in the header's padding. Another object's
    file moves no byte into the pool."""
    good = _write(tmp_path / "g", "g#f")
    os.symlink(tmp_path / "g", tmp_path / "s")
    os.mkfifo(tmp_path / "p")
    _write(tmp_path / "x", "x#f")
    with open(tmp_path / "x", "ab") as f:
        f.write(b"\0")
    _write(tmp_path / "o", "q#f")  # a whole file, of key q
    bad = [p.copy() for p in good]
    _write(tmp_path / "d", "d#f", bad)
    with open(tmp_path / "d", "r+b") as f:
        f.seek(FileLayout("d#f", SIZES).offsets[2] + 7)
        f.write(bytes([bad[2][7] ^ 1]))
    _write(tmp_path / "h", "h#f")
    with open(tmp_path / "h", "r+b") as f:
        f.seek(ALIGN - 1)
        f.write(b"\1")
    names = ["m", "g/m", "s", "p", "x", "o", "d", "h", "g"]
    files, layout = _files(tmp_path, {name: i % PAGES for i, name in enumerate(names)})
    pool = _pool()
    got = _read(pool, files[:6], layout)
    assert got == [pageio.MISSING] + [pageio.OTHER] * 5
    assert not pool.any()
    assert _read(pool, files[6:], layout) == [pageio.OTHER, pageio.OTHER, pageio.READ]


def test_calls_sharing_a_claim_read_each_file_once_between_them(tmp_path):
    """Calls over the same files that share a claim, on threads at once, take each file
    once: the call that took it answers its status and the others ``ELSEWHERE``; a
    missing file too is answered once; every read page lands bit-exactly."""
    names = [f"f{i:02d}" for i in range(40)]
    pages = {name: i for i, name in enumerate(names)}  # a page each
    contents = {name: _write(tmp_path / name, f"{name}#f") for name in names if name != "f02"}
    files, layout = _files(tmp_path, pages)
    pool, claim, answers = _pool(len(names)), pageio.new_claim(), []

    def read():
        answers.append(pageio.read_pages(pool, layout.header_len, layout.total, len(SIZES), _pieces(range(4)), files,
                                         False, None, claim))

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 3 and claim[0] >= len(files)
    mine = [[a[f] for a in answers if a[f] != pageio.ELSEWHERE] for f in range(len(files))]
    assert mine == [[pageio.MISSING] if name == "f02" else [pageio.READ] for name in names]
    del pages["f02"]  # its page untouched
    assert np.array_equal(pool, _expected(pages, contents, range(4), len(names)))


def test_a_claim_must_be_an_aligned_int64_counter(tmp_path):
    _write(tmp_path / "a", "a#f")
    files, layout = _files(tmp_path, {"a": 0})
    pool = _pool()
    unaligned = np.zeros(2, np.int64).view(np.uint8)[1:9]
    for bad in (np.zeros(4, np.uint8), np.zeros(3, np.int64)[:0], unaligned):
        with pytest.raises(ValueError, match="claim must be an 8-byte aligned int64 counter"):
            pageio.read_pages(pool, layout.header_len, layout.total, len(SIZES), _pieces(range(4)), files, False,
                              None, bad)
    assert not pool.any()


def test_a_piece_outside_the_pool_is_refused_before_any_byte_moves(tmp_path):
    _write(tmp_path / "a", "a#f")
    _write(tmp_path / "b", "b#f")
    files, layout = _files(tmp_path, {"a": 0, "b": PAGES})  # page PAGES is past the pool
    pool = _pool()
    with pytest.raises(ValueError, match=r"page 4 puts piece 0 outside the pool's \d+ bytes"):
        _read(pool, files, layout)
    assert not pool.any()
    with pytest.raises(ValueError, match="checksum 4 of 4"):
        pageio.read_pages(pool, layout.header_len, layout.total, 4, [(4, layout.offsets[3], [])], files[:1], False)
    with pytest.raises(ValueError, match="outside the pool"):
        pageio.read_pages(pool, layout.header_len, layout.total, 4, [(0, layout.offsets[0], [(-1, 0, 1)])],
                          files[:1], False)
    assert not pool.any()


BIG = 2 ** 63 - 1


@pytest.mark.parametrize("nsums, piece, message", [
    (2 ** 61, (0, 0, 16), "2305843009213693952 checksums exceed the header"),  # 8 * nsums wraps to 0
    (4, (BIG - 7, 0, 16), "outside the pool"),  # start + bytes wraps negative
    (4, (0, 0, 2 * ALIGN, (2, ALIGN), (BIG, 1)), "reach past 2"),  # the rows' reach wraps
    (4, (0, 0, 2 * ALIGN, (2 ** 62, 2, ALIGN), (0, ALIGN, 1)), "reach past 2"),  # the item count wraps
    (4, (0, BIG, 16), "page 1 puts piece 0 outside"),  # page * step past the pool
], ids=["checksums", "start", "stride", "dims", "step"])
def test_numbers_that_wrap_past_2_63_are_refused_before_any_byte_moves(tmp_path, nsums, piece, message):
    """Sizes and offsets whose sums or products pass 2^63 (which wrapped and passed the
    pool's and the header's bounds, then read or wrote far outside them): ValueError,
    of an intact file, with the pool untouched."""
    _write(tmp_path / "a", "a#f")
    files, layout = _files(tmp_path, {"a": 1})
    pool, staging = _pool(), _pool()
    with pytest.raises(ValueError, match=message):
        pageio.read_pages(pool, layout.header_len, layout.total, nsums, [(0, layout.offsets[0], [piece])], files,
                          False, staging)
    assert not pool.any()


@pytest.mark.parametrize("emptied", ["parts", "pieces", "files"])
def test_lists_that_python_empties_while_they_are_parsed_are_read_whole(tmp_path, emptied):
    """Parsing an argument reads numbers that may run Python (``__index__``): code there
    that empties the caller's list of parts, of a part's pieces or of files changes
    nothing, where the parser read on from the emptied list (its freed items)."""
    contents = _write(tmp_path / "a", "a#f")
    files, layout = _files(tmp_path, {"a": 1})
    listed = []
    parts = _pieces(range(4))
    if emptied == "parts":
        listed[:] = [(Emptying(listed, k), offset, pieces) for k, offset, pieces in parts]
        parts = listed
    elif emptied == "pieces":
        k, offset, pieces = parts[0]
        listed[:] = [(Emptying(listed, start), step, n) for start, step, n in pieces]
        parts[0] = (k, offset, listed)
    else:
        listed[:] = [(path, prefix, Emptying(listed, page)) for path, prefix, page in files]
        files = listed
    pool = _pool()
    assert list(pageio.read_pages(pool, layout.header_len, layout.total, len(SIZES), parts, files, False)) \
        == [pageio.READ]
    assert np.array_equal(pool, _expected({"a": 1}, {"a": contents}, range(4)))


def test_a_files_list_emptied_during_the_call_is_read_whole(tmp_path):
    """The call reads the files' prefixes with the GIL released: another thread that
    empties the caller's list meanwhile (it held the only reference to each prefix) and
    allocates as much again, which takes the freed memory, changes nothing: every file
    is read."""
    n, size, prefix_len = 32, 4 << 20, 60 << 10  # prefixes below malloc's mmap threshold: freed, then reused
    header_len = (prefix_len + 8 + ALIGN - 1) // ALIGN * ALIGN
    part = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    part[0] = 0  # (not the pool's 1s: its first byte tells when the first file lands)
    digest = xxhash.xxh3_64_intdigest(part).to_bytes(8, "little")
    files = []
    for i in range(n):
        prefix = os.urandom(prefix_len)
        with open(tmp_path / f"f{i}", "wb") as f:
            f.write(prefix + digest + bytes(header_len - prefix_len - 8) + part.tobytes())
        files.append((str(tmp_path / f"f{i}"), prefix, 0))
    del prefix
    raw = np.zeros(size + ALIGN, dtype=np.uint8)
    pool = raw[-raw.ctypes.data % ALIGN:][:size]
    pool[:] = 1  # (its memory touched first: the call is then the files' reads)
    got = {}

    def read():
        parts = [(0, header_len, [(0, 0, size)])]
        got["status"] = list(pageio.read_pages(pool, header_len, header_len + size, 1, parts, files, False))

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    while pool[0] == 1 and reader.is_alive() and time.monotonic() < deadline:
        pass  # until the call is under way: the first of its files landed
    files.clear()
    taken = [os.urandom(prefix_len) for _ in range(2 * n)]  # noqa: F841 (held until the call is done)
    reader.join()
    assert got == {"status": [pageio.READ] * n} and np.array_equal(pool, part)


@pytest.mark.parametrize("wanted", [range(4), [1, 3], [0, 1]], ids=["all", "gaps", "first-two"])
def test_cold_files_are_read_with_direct_io_bit_exactly(tmp_path, wanted):
    """Out of the page cache, with ``direct``: read with O_DIRECT (so still not cached
    after), one request per run of parts, the unaligned last part buffered; the same
    bytes as a cached read."""
    if not direct_allowed(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    pages = {"a": 1, "b": 3}
    contents = {name: _write(tmp_path / name, f"{name}#f") for name in pages}
    files, layout = _files(tmp_path, pages)
    for _ in range(20):  # a page just used may stay cached a moment
        evict_cached(tmp_path)
        pool = _pool()
        got = _read(pool, files, layout, wanted, direct=True)
        if got == [pageio.DIRECT] * 2:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the files stayed cached after 20 evictions: {got}")
    assert np.array_equal(pool, _expected(pages, contents, wanted))
    if pageio.cached_pages(os.open(tmp_path, os.O_RDONLY), 0, 1) is None:  # (a directory's fd: closed at exit)
        return
    for name in pages:
        fd = os.open(tmp_path / name, os.O_RDONLY)
        try:
            direct = [k for k in wanted if SIZES[k] % ALIGN == 0]
            assert [pageio.cached_pages(fd, layout.offsets[k], SIZES[k]) for k in direct] == [0] * len(direct)
        finally:
            os.close(fd)


def _staged(wanted):
    """Parts ``wanted`` staged: each an array of rows at a 2 KiB stride in the pool (a
    strided layout, as page_first's heads are), 16 KiB apart per part."""
    layout = FileLayout("k#f", SIZES)
    rows = {n: (n // 1024, 1024) if n % 1024 == 0 else (4, n // 4) for n in SIZES}
    return [(k, layout.offsets[k], [(k * 16384, STEP, SIZES[k], rows[SIZES[k]], (2048, 1))]) for k in wanted]


def _staged_expected(pool_pages, contents, wanted):
    want = _pool()
    for name, page in pool_pages.items():
        for k, _, [(start, step, _, (nrows, width), (stride, _))] in _staged(wanted):
            for r in range(nrows):
                at = start + page * step + r * stride
                want[at:at + width] = contents[name][k][r * width:(r + 1) * width]
    return want


@pytest.mark.parametrize("direct,slots", [(False, 1), (True, 1), (True, 2), (True, 4)],
                         ids=["cached", "cold", "cold-two-files-of-staging", "cold-four-files-of-staging"])
def test_staged_parts_are_copied_out_only_once_their_file_checks_out(tmp_path, direct, slots):
    """Staged pieces (arrays of strided rows) are read into staging and copied to their
    rows; a file with a damaged part moves no byte into the pool, staged or not. With
    staging for two files or more, a cold file is judged while the next one is read
    into the next stretch."""
    if direct and not direct_allowed(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    pages = {"a": 0, "b": 3}
    contents = {name: _write(tmp_path / name, f"{name}#f") for name in pages}
    bad = [p.copy() for p in contents["b"]]
    bad[3][5] ^= 1
    _write(tmp_path / "c", "c#f", [*bad[:3], contents["b"][3]])  # part 3 damaged
    with open(tmp_path / "c", "r+b") as f:
        f.seek(FileLayout("c#f", SIZES).offsets[3] + 5)
        f.write(bytes([bad[3][5]]))
    files, layout = _files(tmp_path, {**pages, "c": 1})
    raw = np.zeros(slots * 32768 + ALIGN, dtype=np.uint8)
    staging = raw[-raw.ctypes.data % ALIGN:][:slots * 32768]
    want = _staged_expected(pages, contents, range(4))
    for _ in range(20 if direct else 1):
        if direct:
            evict_cached(tmp_path)
        pool = _pool()
        got = list(pageio.read_pages(pool, layout.header_len, layout.total, 4, _staged(range(4)), files, direct,
                                     staging))
        if not direct or got[:2] == [pageio.DIRECT] * 2:
            break
        time.sleep(0.05)
    assert got == [pageio.DIRECT if direct else pageio.READ] * 2 + [pageio.OTHER]
    assert np.array_equal(pool, want)  # page 1 (the damaged file's) untouched
    with pytest.raises(ValueError, match="need 32768 bytes of staging, got 4096"):
        pageio.read_pages(pool, layout.header_len, layout.total, 4, _staged(range(4)), files, False, staging[:4096])


def test_cold_files_are_judged_in_order_while_the_next_is_read(tmp_path):
    """A batch of cold files among missing and damaged ones: each cold file is hashed
    while the next is read, and every status is its own file's (a damaged file between
    good ones is not read, the good ones after it are)."""
    if not direct_allowed(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    pages = {"a": 0, "b": 2, "c": 3}
    contents = {name: _write(tmp_path / name, f"{name}#f") for name in pages}
    bad = _write(tmp_path / "d", "d#f")
    with open(tmp_path / "d", "r+b") as f:
        f.seek(FileLayout("d#f", SIZES).offsets[1] + 3)
        f.write(bytes([bad[1][3] ^ 1]))
    files, layout = _files(tmp_path, {"a": 0, "m": 1, "d": 1, "b": 2, "c": 3})
    for _ in range(20):
        evict_cached(tmp_path)
        pool = _pool()
        got = _read(pool, files, layout, direct=True)
        if got[0] == got[3] == got[4] == pageio.DIRECT:
            break
        time.sleep(0.05)
    assert got == [pageio.DIRECT, pageio.MISSING, pageio.OTHER, pageio.DIRECT, pageio.DIRECT]
    want = _expected(pages, contents, range(4))
    for page in pages.values():  # the damaged file's page may hold what was read of it
        assert np.array_equal(pool[page * STEP:(page + 1) * STEP], want[page * STEP:(page + 1) * STEP])


def test_staged_cold_and_warm_files_of_one_batch_keep_apart(tmp_path):
    """Staging for four files: warm files are read into its first stretch, cold ones in
    turn into the others; a batch of cold, warm, cold, missing and cold files lands
    bit-exactly, each at its page."""
    if not direct_allowed(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    cold_dir, warm_dir = tmp_path / "cold", tmp_path / "warm"
    cold_dir.mkdir(), warm_dir.mkdir()
    where = {"a": cold_dir, "b": warm_dir, "c": cold_dir, "d": cold_dir}
    pages = {"a": 0, "b": 1, "c": 2, "d": 3}
    contents = {name: _write(where[name] / name, f"{name}#f") for name in pages}
    layout = FileLayout("k#f", SIZES)
    files = [(str(where[name] / name), FileLayout(f"{name}#f", SIZES).prefix(), page) for name, page in pages.items()]
    files.insert(3, (str(cold_dir / "m"), FileLayout("m#f", SIZES).prefix(), 0))
    raw = np.zeros(4 * 32768 + ALIGN, dtype=np.uint8)
    staging = raw[-raw.ctypes.data % ALIGN:][:4 * 32768]
    want = [pageio.DIRECT, pageio.READ, pageio.DIRECT, pageio.MISSING, pageio.DIRECT]
    for _ in range(20):
        evict_cached(cold_dir)
        (warm_dir / "b").read_bytes()
        pool = _pool()
        got = list(pageio.read_pages(pool, layout.header_len, layout.total, 4, _staged(range(4)), files, True,
                                     staging))
        if got == want:
            break
        time.sleep(0.05)
    assert got == want
    assert np.array_equal(pool, _staged_expected(pages, contents, range(4)))
