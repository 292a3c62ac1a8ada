"""``pageio.write_pages``, the compiled batch writer of page files: each file holds its
page's parts at their offsets, bit-exact, behind the header the reader expects (the
same bytes as the store's per-file path writes), at the store's exact modes; a file
that fails leaves nothing behind and gets its errno; bad input is refused before any
file is made."""

from __future__ import annotations

import errno
import os
import stat

import numpy as np
import pytest
import torch
import xxhash

from kvtier.storage import pageio
from kvtier.storage.pagefile import FileLayout
from tests.storage.test_read_pages import SIZES, STEP, _pieces, _pool, _staged
from tests.support.services import unavailable
from tests.support.storage import cached_pages_of, direct_allowed, file_size_limit, object_files

RNG = np.random.default_rng(23)
LAYOUT = FileLayout("a#f", SIZES)
MODES = (0o660, 0o770)  # as a shared store: a strict umask would take bits


@pytest.fixture(autouse=True)
def _compiled():
    if not pageio.compiled():
        unavailable("kvtier.storage._pageio is not built or bound, or KVTIER_NATIVE=0")


def _filled() -> np.ndarray:
    pool = _pool()
    pool[:] = RNG.integers(0, 256, pool.size, dtype=np.uint8)
    return pool


def _gathered(pool: np.ndarray, parts, page: int) -> list[bytes]:
    """Each part's bytes in page ``page`` of ``pool``, as ``parts`` (in place or staged) lay them out."""
    out = []
    for _, _, pieces in parts:
        data = b""
        for start, step, nbytes, *shape in pieces:
            at = start + page * step
            if not shape:
                data += pool[at:at + nbytes].tobytes()
                continue
            (rows, width), (stride, _) = shape
            data += b"".join(pool[at + r * stride:at + r * stride + width].tobytes() for r in range(rows))
        out.append(data)
    return out


def _expected_file(name: str, parts: list[bytes]) -> bytes:
    """A page file as ``FileLayout`` lays it out: header, parts at their offsets, zeros between."""
    layout = FileLayout(name, SIZES)
    data = bytearray(layout.header([xxhash.xxh3_64_intdigest(p) for p in parts]))
    for offset, part in zip(layout.offsets, parts):
        data += bytes(offset - len(data)) + part
    return bytes(data)


def _check_holds(data: bytes, layout: FileLayout, gathered: list[bytes], offsets=None, what: str = "") -> None:
    """``data``, a written file, holds ``layout``'s header of ``gathered``'s checksums and
    each part at its offset (``layout``'s, or ``offsets``)."""
    assert data[:layout.header_len] == layout.header([xxhash.xxh3_64_intdigest(g) for g in gathered]), what
    offsets = layout.offsets if offsets is None else offsets
    assert [data[o:o + len(g)] for o, g in zip(offsets, gathered)] == gathered, what


def _files(tmp_path, pages: dict) -> list:
    return [(str(tmp_path / f".{name}.tmp"), str(tmp_path / name), FileLayout(f"{name}#f", SIZES).prefix(), page)
            for name, page in pages.items()]


def _write(pool, parts, files, staging=None, fsync=False):
    return list(pageio.write_pages(pool, LAYOUT.header_len, LAYOUT.total, parts, files, fsync, *MODES, staging))


@pytest.mark.parametrize("how", ["in-place", "staged", "staged-fsync"])
def test_files_hold_their_pages_parts_behind_the_readers_header(tmp_path, how):
    """Every file is byte for byte the layout's: its header with each part's checksum,
    each part (in place, or gathered from strided rows) at its offset, zeros between;
    no temporary file stays, and the reader reads the pages back as they were."""
    parts = _pieces(range(4)) if how == "in-place" else _staged(range(4))
    staging = None if how == "in-place" else np.zeros(32768, dtype=np.uint8)
    pool, pages = _filled(), {"a": 0, "b": 3}
    assert _write(pool, parts, _files(tmp_path, pages), staging, fsync=how.endswith("fsync")) == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    for name, page in pages.items():
        assert (tmp_path / name).read_bytes() == _expected_file(f"{name}#f", _gathered(pool, parts, page))
    back = _pool()
    read = pageio.read_pages(back, LAYOUT.header_len, LAYOUT.total, 4, parts,
                             [(path, prefix, page) for _, path, prefix, page in _files(tmp_path, pages)], False,
                             np.zeros(32768, dtype=np.uint8))
    assert list(read) == [pageio.READ] * 2
    for page in pages.values():
        assert _gathered(back, parts, page) == _gathered(pool, parts, page)


@pytest.mark.parametrize("chunk", [4096, 3000, 0], ids=["aligned-chunks", "odd-chunks", "one-call"])
@pytest.mark.parametrize("how", ["in-place", "staged"])
def test_files_longer_than_a_chunk_are_the_same_bytes(tmp_path, monkeypatch, chunk, how):
    """A file is written in calls that end at multiples of the chunk (or, 0, in one),
    however the chunks cut its parts, pieces and zeros: the same bytes either way."""
    monkeypatch.setattr(pageio, "WRITE_CHUNK", chunk)
    monkeypatch.setattr(pageio, "WHOLE_WRITE_BYTES", 0)  # these small files in chunks too
    parts = _pieces(range(4)) if how == "in-place" else _staged(range(4))
    staging = None if how == "in-place" else np.zeros(32768, dtype=np.uint8)
    pool = _filled()
    assert _write(pool, parts, _files(tmp_path, {"a": 1}), staging) == [0]
    assert (tmp_path / "a").read_bytes() == _expected_file("a#f", _gathered(pool, parts, 1))


@pytest.mark.parametrize("chunk", [2 << 20, 4096], ids=["one-call", "chunks"])
def test_wide_gaps_between_parts_are_zeros(tmp_path, monkeypatch, chunk):
    """Parts further apart than the format puts them (more than a block of zeros between)."""
    monkeypatch.setattr(pageio, "WRITE_CHUNK", chunk)
    monkeypatch.setattr(pageio, "WHOLE_WRITE_BYTES", 0)
    shift = 3 * 4096 + 512
    parts = [(k, offset + (k > 0) * shift, pieces) for k, offset, pieces in _pieces(range(4))]
    pool = _filled()
    files = _files(tmp_path, {"a": 2})
    assert list(pageio.write_pages(pool, LAYOUT.header_len, LAYOUT.total + shift, parts, files, False,
                                   *MODES)) == [0]
    data = (tmp_path / "a").read_bytes()
    gathered = _gathered(pool, parts, 2)
    assert len(data) == LAYOUT.total + shift
    assert data[LAYOUT.offsets[0]:LAYOUT.offsets[0] + SIZES[0]] == gathered[0]
    assert data[LAYOUT.offsets[0] + SIZES[0]:LAYOUT.offsets[1] + shift] == bytes(LAYOUT.offsets[1] + shift -
                                                                                 LAYOUT.offsets[0] - SIZES[0])
    for k in range(1, 4):
        assert data[LAYOUT.offsets[k] + shift:LAYOUT.offsets[k] + shift + SIZES[k]] == gathered[k]
    sums = [int.from_bytes(data[at:at + 8], "little") for at in range(len(LAYOUT.prefix()),
                                                                      len(LAYOUT.prefix()) + 32, 8)]
    assert sums == [xxhash.xxh3_64_intdigest(g) for g in gathered]


@pytest.mark.parametrize("whole_bytes", [0, LAYOUT.total - 1, LAYOUT.total, 2 << 20])
def test_files_up_to_the_whole_write_size_go_in_one_call(tmp_path, monkeypatch, whole_bytes):
    """A file no longer than ``WHOLE_WRITE_BYTES`` is written in one call (chunk 0 to the
    compiled writer), a longer one in ``WRITE_CHUNK`` calls; the same bytes either way."""
    monkeypatch.setattr(pageio, "WRITE_CHUNK", 4096)
    monkeypatch.setattr(pageio, "WHOLE_WRITE_BYTES", whole_bytes)
    assert pageio.compiled()
    real, chunks = pageio._pageio[0], []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def write_pages(self, *args):
            chunks.append(args[5])
            return real.write_pages(*args)

    monkeypatch.setattr(pageio, "_pageio", [Spy()])
    pool = _filled()
    assert _write(pool, _pieces(range(4)), _files(tmp_path, {"a": 1})) == [0]
    assert chunks == [0 if LAYOUT.total <= whole_bytes else 4096]
    assert (tmp_path / "a").read_bytes() == _expected_file("a#f", _gathered(pool, _pieces(range(4)), 1))


ALIGNED_SIZES = [2 * 4096] * 4  # every part a multiple of a block: files that O_DIRECT can write


def _aligned_parts(staged: bool) -> list:
    """Parts of a layout of ``ALIGNED_SIZES``, each in two block-aligned pieces in the pool
    (in place) or gathered from 8 rows of 1 KiB at a 2 KiB stride (staged)."""
    layout = FileLayout("k#f", ALIGNED_SIZES)
    if staged:
        return [(k, layout.offsets[k], [(k * 16384, STEP, n, (8, n // 8), (2048, 1))])
                for k, n in enumerate(ALIGNED_SIZES)]
    return [(k, layout.offsets[k], [(3 * 4096 * k, STEP, n // 2), (3 * 4096 * k + n, STEP, n // 2)])
            for k, n in enumerate(ALIGNED_SIZES)]


def _needs_direct(tmp_path) -> None:
    if not direct_allowed(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="needs Linux's O_DIRECT")
@pytest.mark.parametrize("how", ["in-place", "staged-once", "staged-twice"])
def test_direct_writes_make_the_same_files_out_of_the_page_cache(tmp_path, how):
    """With ``direct``, a file aligned for O_DIRECT is written with it (one request for
    the whole file, in flight while the next file is made; staged parts in a stretch of
    their own where staging holds two files' parts, else after the last write is done):
    the same bytes as a buffered write, none of them left in the page cache; a file that
    is not aligned (a part of 100 bytes over a block) is written buffered, as without it."""
    _needs_direct(tmp_path)
    layout = FileLayout("k#f", ALIGNED_SIZES)
    parts = _aligned_parts(how != "in-place")
    # block-aligned, as the store's arena is: one file's staged parts, or two
    staging = None if how == "in-place" else _pool()[:32768 * (2 if how == "staged-twice" else 1)]
    pool = _filled()
    names = {f"d{i}": (0, 3, 1, 2)[i % 4] for i in range(12)}  # pages in turn: a stretch reused too early shows
    files = [(str(tmp_path / f".{n}.tmp"), str(tmp_path / n), FileLayout(f"{n}#f", ALIGNED_SIZES).prefix(), page)
             for n, page in names.items()]
    plain = [(str(tmp_path / f".p{n}.tmp"), str(tmp_path / f"p{n}"), prefix, page) for (_, _, prefix, page), n
             in zip(files, names)]
    for batch, direct in ((files, True), (plain, False)):
        assert list(pageio.write_pages(pool, layout.header_len, layout.total, parts, batch, False, *MODES, staging,
                                       direct)) == [0] * len(names)
    unaligned = _files(tmp_path, {"u": 2})  # its last part 100 bytes over a block
    assert list(pageio.write_pages(pool, LAYOUT.header_len, LAYOUT.total, _pieces(range(4)), unaligned, False,
                                   *MODES, None, True)) == [0]
    counts = [cached_pages_of(tmp_path / n) for n in [*names, *(f"p{n}" for n in names), "u"]]
    if None in counts:
        unavailable("the page cache's residency cannot be counted here (cachestat, Linux 6.5)")
    pages_each = layout.total // 4096
    assert counts == [0] * len(names) + [pages_each] * len(names) + [-(-LAYOUT.total // 4096)]
    for n, page in names.items():
        data = (tmp_path / n).read_bytes()
        assert data == (tmp_path / f"p{n}").read_bytes()
        _check_holds(data, FileLayout(f"{n}#f", ALIGNED_SIZES), _gathered(pool, parts, page))
    assert (tmp_path / "u").read_bytes() == _expected_file("u#f", _gathered(pool, _pieces(range(4)), 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, *(f"p{n}" for n in names), "u"])


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="needs Linux's O_DIRECT")
def test_a_direct_write_keeps_the_zeros_of_block_aligned_gaps(tmp_path):
    """Parts whole blocks further apart than the format puts them: every stretch aligned,
    but zeros between two parts, which one request of the stretches back to back would
    drop. The file holds each part at its offset and zeros between, as a buffered write."""
    _needs_direct(tmp_path)
    layout, shift = FileLayout("g#f", ALIGNED_SIZES), 2 * 4096
    parts = [(k, offset + (k > 1) * shift, pieces) for k, offset, pieces in _aligned_parts(False)]
    pool = _filled()
    files = [(str(tmp_path / ".g.tmp"), str(tmp_path / "g"), layout.prefix(), 1)]
    assert list(pageio.write_pages(pool, layout.header_len, layout.total + shift, parts, files, False, *MODES, None,
                                   True)) == [0]
    data, gathered = (tmp_path / "g").read_bytes(), _gathered(pool, parts, 1)
    offsets = [offset for _, offset, _ in parts]
    assert len(data) == layout.total + shift
    _check_holds(data, layout, gathered, offsets)
    assert data[offsets[1] + len(gathered[1]):offsets[2]] == bytes(shift)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="needs Linux's O_DIRECT")
@pytest.mark.parametrize("files_staged", [1, 2])
def test_a_staged_direct_write_in_flight_keeps_its_bytes(tmp_path, files_staged):
    """Large staged files written with O_DIRECT one after another (each write in flight
    while the next file is made and staged): every file holds its own page's bytes,
    whether the staging holds one file's parts (each waits for the last write) or two."""
    _needs_direct(tmp_path)
    sizes, rows = [1 << 20] * 2, 256  # 2 MiB files: each write is still in flight when the next is staged
    layout = FileLayout("k#f", sizes)
    step = 4 << 20
    raw = np.zeros(3 * step + 4096, dtype=np.uint8)
    pool = raw[-raw.ctypes.data % 4096:][:3 * step]
    pool[:] = RNG.integers(0, 256, pool.size, dtype=np.uint8)
    # each part 256 rows of 4 KiB at an 8 KiB stride
    parts = [(k, layout.offsets[k], [(k * (2 << 20), step, n, (rows, n // rows), (2 * n // rows, 1))])
             for k, n in enumerate(sizes)]
    raw_staging = np.zeros(files_staged * sum(sizes) + 4096, dtype=np.uint8)
    staging = raw_staging[-raw_staging.ctypes.data % 4096:][:files_staged * sum(sizes)]
    pages = [i % 3 for i in range(8)]
    files = [(str(tmp_path / f".f{i}.tmp"), str(tmp_path / f"f{i}"), layout.prefix(), page)
             for i, page in enumerate(pages)]
    assert list(pageio.write_pages(pool, layout.header_len, layout.total, parts, files, False, *MODES, staging,
                                   True)) == [0] * len(pages)
    for i, page in enumerate(pages):
        _check_holds((tmp_path / f"f{i}").read_bytes(), layout, _gathered(pool, parts, page), what=f"file {i}")


def _aio_rings() -> int:
    """How many Linux AIO rings this process has mapped (one per context it made)."""
    with open("/proc/self/maps") as maps:
        return sum("[aio]" in line for line in maps)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT") or not hasattr(os, "fork"), reason="needs Linux's O_DIRECT and fork")
def test_a_forked_child_writes_direct_files_whole(tmp_path):
    """The writer keeps an AIO context per thread, and a fork does not carry it over (the
    child's kernel refuses the parent's): the child's thread makes its own (its ring is
    mapped in the child once it writes) and writes each direct file whole and out of the
    page cache, as the parent does with its own."""
    _needs_direct(tmp_path)
    layout, parts, pool = FileLayout("k#f", ALIGNED_SIZES), _aligned_parts(False), _filled()

    def batch(tag: str) -> list:
        return [(str(tmp_path / f".{tag}{i}.tmp"), str(tmp_path / f"{tag}{i}"), layout.prefix(), i % 4)
                for i in range(6)]

    def write(files) -> list:
        return list(pageio.write_pages(pool, layout.header_len, layout.total, parts, files, False, *MODES, None,
                                       True))

    assert write(batch("p")) == [0] * 6  # this thread's context is made here
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code alone
        try:
            rings = _aio_rings()
            written = write(batch("c"))
            os._exit(0 if written == [0] * 6 and _aio_rings() == rings + 1 else 1)
        except BaseException:
            os._exit(2)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert write(batch("q")) == [0] * 6  # and the parent's context still serves it
    counts = [cached_pages_of(tmp_path / f"{tag}{i}") for tag in "pcq" for i in range(6)]  # (before reading them)
    for i in range(6):
        gathered = _gathered(pool, parts, i % 4)
        for tag in "pcq":
            _check_holds((tmp_path / f"{tag}{i}").read_bytes(), layout, gathered, what=f"{tag}{i}")
    if None in counts:
        unavailable("the page cache's residency cannot be counted here (cachestat, Linux 6.5)")
    assert counts == [0] * 18


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="needs Linux's O_DIRECT")
def test_a_direct_file_that_fails_is_its_own_and_leaves_nothing(tmp_path):
    """Among direct writes in flight one after another, a file that cannot be made (a
    file where its directory should be, a temporary name taken) gets its errno and
    leaves nothing; the files before and after it are written whole."""
    _needs_direct(tmp_path)
    layout = FileLayout("k#f", ALIGNED_SIZES)
    (tmp_path / "blocked").write_text("a file where a directory should be")
    (tmp_path / ".taken.tmp").write_text("someone else's")
    pool = _filled()
    prefix = layout.prefix()
    files = [(str(tmp_path / ".a.tmp"), str(tmp_path / "a"), prefix, 0),
             (str(tmp_path / "blocked" / ".x.tmp"), str(tmp_path / "blocked" / "x"), prefix, 1),
             (str(tmp_path / ".b.tmp"), str(tmp_path / "b"), prefix, 2),
             (str(tmp_path / ".taken.tmp"), str(tmp_path / "taken"), prefix, 3),
             (str(tmp_path / ".c.tmp"), str(tmp_path / "c"), prefix, 3)]
    parts = _aligned_parts(False)
    assert list(pageio.write_pages(pool, layout.header_len, layout.total, parts, files, False, *MODES, None,
                                   True)) == [0, errno.ENOTDIR, 0, errno.EEXIST, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".taken.tmp", "a", "b", "blocked", "c"]
    assert (tmp_path / ".taken.tmp").read_text() == "someone else's"
    for name, page in (("a", 0), ("b", 2), ("c", 3)):
        _check_holds((tmp_path / name).read_bytes(), layout, _gathered(pool, parts, page))


def test_an_object_written_again_is_replaced_whole(tmp_path):
    pool = _filled()
    assert _write(pool, _pieces(range(4)), _files(tmp_path, {"a": 0})) == [0]
    assert _write(pool, _pieces(range(4)), _files(tmp_path, {"a": 2})) == [0]
    assert (tmp_path / "a").read_bytes() == _expected_file("a#f", _gathered(pool, _pieces(range(4)), 2))


@pytest.mark.parametrize("umask", [0o000, 0o077], ids=["loosest", "strictest"])
def test_files_and_the_directories_made_for_them_get_exactly_their_modes(tmp_path, umask):
    old = os.umask(umask)
    try:
        files = [(str(tmp_path / "shard" / ".a.tmp"), str(tmp_path / "shard" / "a"), LAYOUT.prefix(), 0)]
        assert _write(_filled(), _pieces(range(4)), files) == [0]
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "shard").stat().st_mode) == MODES[1]
    assert stat.S_IMODE((tmp_path / "shard" / "a").stat().st_mode) == MODES[0]


def test_a_file_that_fails_leaves_nothing_and_gets_its_errno(tmp_path):
    """Each failure is its file's alone (the others of the batch are written): a file
    where its directory should be, a directory whose parent is missing, a temporary
    name taken (left as it was), and a write past the file size limit."""
    (tmp_path / "blocked").write_text("a file where a directory should be")
    (tmp_path / ".taken.tmp").write_text("someone else's")
    files = [(str(tmp_path / "blocked" / ".x.tmp"), str(tmp_path / "blocked" / "x"), LAYOUT.prefix(), 0),
             (str(tmp_path / "gone" / "deeper" / ".y.tmp"), str(tmp_path / "gone" / "deeper" / "y"),
              LAYOUT.prefix(), 1),
             (str(tmp_path / ".taken.tmp"), str(tmp_path / "taken"), LAYOUT.prefix(), 2),
             *_files(tmp_path, {"a": 3})]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert _write(_filled(), _pieces(range(4)), files) == [errno.ENOTDIR, errno.ENOENT, errno.EEXIST, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "a"])
    assert (tmp_path / ".taken.tmp").read_text() == "someone else's"
    with file_size_limit(LAYOUT.offsets[1] + 100):
        assert _write(_filled(), _pieces(range(4)), _files(tmp_path, {"big": 0})) == [errno.EFBIG]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "a"])


def test_bad_input_is_refused_before_any_file_is_made(tmp_path):
    pool, parts, files = _filled(), _pieces(range(4)), _files(tmp_path, {"a": 0, "b": 1})
    outside = [(k, offset, [(start, STEP, n + (k == 3) * STEP * 4) for start, step, n in pieces])
               for k, offset, pieces in parts]
    cases = [
        (pool, parts[:3], files, None, "the parts end at"),
        (pool, [parts[1], parts[0], *parts[2:]], files, None, "file order"),
        (pool, [(k + 1, o, p) for k, o, p in parts], files, None, "checksum"),
        (pool, [parts[0], (1, parts[0][1] + 100, parts[1][2]), *parts[2:]], files, None,
         "part 0 ends at 12288, past the next part"),
        (pool, outside, files, None, "outside the pool"),
        (pool, parts, [*files[:1], (*files[1][:3], 4)], None, "page 4 puts piece 0 outside"),
        (pool, parts, [(*files[0][:2], bytes(LAYOUT.header_len), 0)], None, "exceed the header"),
        (pool, _staged(range(4)), files, np.zeros(4096, dtype=np.uint8), "need 32768 bytes of staging, got 4096"),
    ]
    for pool_, parts_, files_, staging, message in cases:
        with pytest.raises(ValueError, match=message):
            _write(pool_, parts_, files_, staging)
    assert list(tmp_path.iterdir()) == []


def test_the_store_writes_the_same_files_either_way(tmp_path, monkeypatch):
    """``FileStorage``'s compiled writer and its per-file path make the same files, byte
    for byte, for staged (page_first) and in-place (page_head) pools."""
    import kvtier.storage
    from tests.support.pools import SPECS
    from tests.support.storage import filled_host

    keys = kvtier.storage.page_keys(list(range(12)), 4, namespace="same")
    for layout in ("page_first", "page_head"):
        host, idx = filled_host(SPECS["asym"], 3, layout=layout, seed=5)
        contents = []
        for name, stub in (("compiled", False), ("per-file", True)):
            if stub:
                monkeypatch.setattr(pageio, "write_pages", lambda *a: None)
            store = kvtier.storage.open(f"file://{tmp_path / layout / name}")
            assert store.batch_set(keys, host, idx) == [True] * 3
            root = tmp_path / layout / name
            contents.append({p.relative_to(root): p.read_bytes() for p in object_files(root)})
            monkeypatch.undo()
        assert len(contents[0]) == 3 and contents[0] == contents[1]


def test_an_extension_built_before_the_writer_leaves_puts_to_the_per_file_path(tmp_path, monkeypatch):
    """A ``_pageio`` without ``write_pages`` (built by an older kvtier): ``write_pages``
    says None and the store's puts go file by file, stored all the same."""
    import kvtier.storage
    from tests.support.pools import SPECS
    from tests.support.storage import blank_host, filled_host, flat_pages

    class Older:
        def __getattr__(self, name):
            if name == "write_pages":
                raise AttributeError(name)
            return getattr(real, name)

    real = pageio._pageio[0]
    monkeypatch.setattr(pageio, "_pageio", [Older()])
    assert pageio.write_pages(_filled(), LAYOUT.header_len, LAYOUT.total, _pieces(range(4)),
                              _files(tmp_path, {"a": 0}), False, *MODES) is None
    host, idx = filled_host(SPECS["asym"], 2, seed=3)
    keys = kvtier.storage.page_keys(list(range(8)), 4, namespace="older")
    store = kvtier.storage.open(f"file://{tmp_path / 'store'}")
    assert store.batch_set(keys, host, idx) == [True, True]
    reader, ridx = blank_host(SPECS["asym"], 8)
    assert store.batch_get(keys, reader, ridx) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
