"""A page file's parts moved and checksummed: the compiled loop, or the same in Python.

``move(fd, parts, write)`` reads (or writes) each part ``(offset, buffers)`` at its
offset and returns each part's xxh3-64 digest. Bytes are moved ``CHUNK`` at a time and
each chunk is hashed while it is in the CPU's cache, so the checksum costs no second
pass over memory. The compiled loop (``kvtier.storage._pageio``) runs with the GIL
released and uses the xxHash that the ``xxhash`` package itself compiled, found through
the symbols its extension exports; it is used only after a digest it computes matches
``xxhash.xxh3_64_intdigest``. Where it is missing, or ``KVTIER_NATIVE=0``, the Python
loop below gives the same bytes and digests.

``read_pages`` reads a batch of page files straight into a pool and checks them, and
``write_pages`` writes a batch from one, each in one compiled call (no Python per file;
compiled only). ``cached_pages`` says
how much of a file the page cache holds without reading it, so that a cold file can
be read with O_DIRECT; ``preallocate`` reserves a new file whole on disk, so that it
gets one extent.
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile

import numpy as np
import xxhash

from ..compiled import built, switched_on
from ..machine import CACHE_DIR, cache_bytes

#: Bytes moved and hashed at a time: well inside a core's L2 cache
CHUNK = 256 << 10


def l2_bytes(cache_dir: str = CACHE_DIR, default: int = 1 << 20) -> int:
    """Bytes of one core's L2 cache as Linux's sysfs tells them, or ``default`` where it
    does not (:func:`kvtier.machine.cache_bytes`)."""
    return cache_bytes(2, cache_dir, default)


def write_chunk(l2: int) -> int:
    """Bytes a page file's write calls take at most for a core with ``l2`` bytes of L2
    cache: the largest power of two in a quarter of it, within 256 KiB..4 MiB.

    Each call's bytes are hashed just after the call (``_pageio_write.c``), from the
    core's caches, where the kernel's copy into the page cache left them; that copy
    moves the call's bytes in and as many of the page cache's out through the same
    cache, so a call of half the L2 already fills it and the hash finds the call's
    first bytes pushed out (the profile below). The calls end at multiples of this in
    the file.

    Measured on an Intel Xeon with 2 MiB of L2 a core (2026-12-06), new 8 MiB page files
    written by two I/O threads, ext4, the variants alternated in one process, best
    rounds of 5-10:
    - 512 KiB calls against 1 MiB ones: ``page_first`` 32 files a round 9.75 / 9.18 GB/s,
      9.50 / 8.82 (128 files), 9.43 / 9.00, 8.36 / 7.91; ``page_head`` 9.87 / 9.27 and
      8.19 / 7.92 (128 files); 2 MiB calls 7.54 and 7.08. vLLM's buffered ``fs`` tier in
      the same rounds 9.44, 9.47, 9.49, 8.11, 9.73, 7.50. Medians were mixed (512 KiB
      first in 3 of the 5 recorded). 256 KiB calls: 9.56, 9.53, 9.09, 9.59, mostly
      between the two.
    - A system profile (``perf``) of 1 MiB calls' puts: the kernel's copy 58% of the
      time, xxh3 13% (about 32 GB/s, half what it hashes from L2 on that core).

    Before, each call's bytes were hashed just before it and the calls took the largest
    power of two in the whole L2: on an AMD EPYC (Zen 4, 1 MiB L2) 1 MiB calls put at
    7.3-7.5 GB/s best against 6.9-7.0 for 2 MiB, and hashing after 1 MiB calls there was
    slower (6.6 against 7.1-7.2: the call's bytes and the page cache's overflow that L2);
    this rule's 256 KiB calls, hashed after, were not measured there. Warm gets were level
    from files written in calls of 512 KiB, 1, 2 or 4 MiB."""
    chunk = 256 << 10
    while chunk < 4 << 20 and chunk * 8 <= l2:
        chunk *= 2
    return chunk


#: Bytes written in one call at most (the calls end at its multiples in the file), each
#: call's bytes hashed from the CPU's caches (``write_pages``: just after the call; the
#: per-file path's :func:`move`: just before): :func:`write_chunk` of this machine's L2
WRITE_CHUNK = write_chunk(l2_bytes())
#: A file no longer than this is written in one call from offset 0, header first (its
#: parts hashed before); a longer one in ``WRITE_CHUNK`` calls, hashed after each. At
#: its default it is the compiled writer's own rule (a file no longer than its chunk is
#: one call): tests lower it to 0 to write small files in chunks.
#: NOTE: a MiMo page's file (1.4 MiB) was written in one call until 2026-12-06 (with
#: 1 MiB calls it had read back warm 5% slower, put level); in 512 KiB calls, hashed
#: after, `kvtier bench storage --pages 192 --layers 9 --heads 4 --head-dim 192
#: --v-head-dim 128` put at 0.90-0.97x of vLLM's buffered tier against 0.81-0.86x in
#: one call, warm gets 0.83-0.85x of raw files against 0.83-0.87x (three alternated pairs)
WHOLE_WRITE_BYTES = WRITE_CHUNK
_SYMBOLS = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", "XXH3_64bits_update", "XXH3_64bits_digest")


def _bound():
    """``_pageio`` bound to the ``xxhash`` package's compiled XXH3 and checked, else None."""
    module = built("kvtier.storage._pageio")
    if module is None:
        return None
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)
        # NOTE: the package exports a dispatching update (AVX2/AVX-512 where the CPU has
        # them) beside the baseline one; prefer it
        names = [f"{n}_dispatch" if n.endswith("_update") and hasattr(lib, f"{n}_dispatch") else n
                 for n in _SYMBOLS]
        addresses = [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names]
    except (AttributeError, OSError):  # an xxhash build that does not export them
        return None
    module.bind(*addresses)
    probe = np.frombuffer(os.urandom(3 * CHUNK + 123), dtype=np.uint8)
    into = np.zeros_like(probe)
    with tempfile.TemporaryFile() as f:
        os.pwrite(f.fileno(), probe, 0)
        sums = module.move(f.fileno(), [(0, [into[:CHUNK + 7], into[CHUNK + 7:]])], CHUNK, False)
    if sums != (xxhash.xxh3_64_intdigest(probe),) or not np.array_equal(into, probe):
        return None
    return module


_pageio: list = []  # bound on first use


def compiled() -> bool:
    """Whether :func:`move` uses the compiled loop: built, bound, and not switched off."""
    if not switched_on():
        return False
    if not _pageio:
        _pageio.append(_bound())
    return _pageio[0] is not None


def cached_pages(fd: int, offset: int, length: int) -> int | None:
    """How many pages of ``fd``'s bytes ``[offset, offset + length)`` the page cache holds,
    counted without starting any read (Linux's ``cachestat``); None where that cannot be
    asked (the module not built or switched off, an older kernel)."""
    module = built("kvtier.storage._pageio") if switched_on() else None
    return None if module is None else module.cached_pages(fd, offset, length)


def preallocate(fd: int, length: int) -> bool:
    """Reserve the first ``length`` bytes of the new file ``fd`` on disk in one request
    (Linux's ``fallocate``), so the file system can give it one extent: written
    piece by piece, a page file one block over a power of two (8 MiB and its 4 KiB
    header) was split in two, and a cold read then takes two disk requests. False
    (nothing done) where it cannot be asked: the module not built or switched off, a
    file system without it. Never emulated by writing zeros."""
    module = built("kvtier.storage._pageio") if switched_on() else None
    return False if module is None else module.preallocate(fd, length)


def move(fd: int, parts: list[tuple[int, list]], write: bool, chunk: int | None = None) -> tuple[int, ...]:
    """Each part ``(offset, buffers)`` read from ``fd`` into its contiguous buffers (or
    written from them), in pieces that end at multiples of ``chunk`` in the file (0: a
    buffer at once; default ``CHUNK``), and its xxh3-64 digest. Raises ``OSError``
    (``EIO`` where a read meets the end of the file).

    NOTE: the pieces are aligned in the file, not in the buffers: Linux's page cache
    sizes the folios of a write by its offset's alignment and length, and a file
    written in pieces offset by its 4 KiB header (as before) was held in 4-16 KiB
    folios that read back at about half the speed of the large ones."""
    chunk = CHUNK if chunk is None else chunk
    if compiled():
        return _pageio[0].move(fd, parts, chunk, write)
    call, sums = os.pwritev if write else os.preadv, []
    for offset, bufs in parts:
        h = xxhash.xxh3_64()
        for buf in bufs:
            view, a = memoryview(buf).cast("B"), 0
            while a < len(view):
                piece = view[a:a + chunk - offset % chunk] if chunk else view[a:]
                if write:
                    h.update(piece)
                io_all(call, fd, [piece], offset)
                if not write:
                    h.update(piece)
                offset += len(piece)
                a += len(piece)
        sums.append(h.intdigest())
    return tuple(sums)


#: ``read_pages``'s status of each file
READ, MISSING, COLD, OTHER, DIRECT = range(5)
#: ``read_pages``'s status of a file another call sharing the claim took (5 is the
#: reader's own, never answered)
ELSEWHERE = 6


def read_pages(pool, header_len: int, total: int, nsums: int, parts: list, files: list,
               direct: bool, staging=None, claim=None) -> bytes | None:
    """Page files of one layout (``header_len``, ``total`` bytes, ``nsums`` checksums)
    read straight into ``pool`` (a writable contiguous buffer) in one compiled call, the
    GIL released; None where the compiled loop is not used (see :func:`compiled`).

    ``parts``: the parts to read, in file order, ``(checksum index, file offset, pieces)``
    each, a piece ``(start, step, bytes)`` going to ``pool[start + page * step:][:bytes]``,
    or ``(start, step, bytes, dims, byte strides)``: read into ``staging`` (a writable
    buffer; each staged part at a multiple of 4096 bytes) and, once its file checks out,
    copied to the array of those dims and strides at ``pool[start + page * step:]``;
    ``files``: ``(path, header prefix, page)`` each. A file counts as read if it is a
    regular file of ``total`` bytes, its header is the prefix, the checksums and zeros,
    and every part read matches its checksum. A cached file is read ``CHUNK`` at a time,
    each chunk hashed while in the CPU's cache. With ``direct``, a file mostly out of
    the page cache (the same three stretches as the file store counts) is read with
    O_DIRECT, one request per run of parts that follow each other in the file, then
    hashed; a run whose buffers are not aligned for it is read buffered. Where
    ``staging`` holds two files' staged parts (or none are staged), a thread beside the
    caller's hashes each cold file while the next one is read; where it holds three or
    more, warm files use its first stretch and cold ones the others in turn. Where it
    holds two files' parts whole (in-place ones too, each part at a multiple of 4096
    bytes), a cold file goes through it whole and every piece is copied out once the
    file checks out.

    ``claim``: a counter (:func:`new_claim`) that calls over the same ``files`` on
    several threads share: each call reads the next file no call took yet, until none
    is left, so that every thread stays busy to the batch's end in one call each.

    Per file one status: ``READ``, ``DIRECT`` (read with O_DIRECT), ``MISSING`` (ENOENT), ``COLD``
    (cold, but the file system refuses O_DIRECT: nothing read), ``OTHER`` (for the
    caller's own path to read again and judge) or, with ``claim``, ``ELSEWHERE`` (another
    call's). A page whose file is not read may hold bytes read meanwhile. Raises
    ``ValueError`` (nothing read) for a piece of any page outside ``pool``."""
    if not compiled():
        return None
    return _pageio[0].read_pages(pool, header_len, total, nsums, parts, files, CHUNK, direct, staging, claim)


def new_claim() -> np.ndarray:
    """A counter for :func:`read_pages` calls that share one batch of files."""
    return np.zeros(1, dtype=np.int64)


def write_pages(pool, header_len: int, total: int, parts: list, files: list, fsync: bool, mode: int,
                dir_mode: int, staging=None, direct: bool = False) -> bytes | None:
    """Page files of one layout (``header_len``, ``total`` bytes) written from ``pool`` (a
    contiguous buffer) in one compiled call, the GIL released; None where the compiled
    loop is not used (see :func:`compiled`).

    ``parts``: every part of the file in file order, ``(index, file offset, pieces)``
    each (the index is its checksum's place in the header: 0, 1, ...), pieces as
    :func:`read_pages` takes them (a staged one is gathered into ``staging`` and
    written from it); ``files``: ``(temporary path, path, header prefix, page)`` each.
    Each file is made new at its temporary path with ``mode`` (its directory with
    ``dir_mode`` where that is missing), reserved whole (:func:`preallocate`), written
    in one ``pwritev`` per ``WRITE_CHUNK`` of the file, each call's bytes hashed just
    after it (from the CPU's cache, where the kernel's copy left them), then its header
    (the prefix, the checksums, zeros); a file no longer than ``WHOLE_WRITE_BYTES`` in
    one call, header first (each write call is a round of the file system's own: a call
    per piece of every part cost puts a fifth or more); fsync'd with ``fsync``, and
    renamed to its path. With ``direct``, a file whose header and parts (addresses,
    lengths, offsets) are multiples of 4096 bytes is written with O_DIRECT in one
    request, header first (as vLLM's fs tier writes a block, where a call per part
    waited on the disk for each), left in flight (the thread's Linux AIO context) while
    the next file is made, staged and hashed; others buffered, as without it. ``staging``
    then holds two files' staged parts where it can (else each file waits for the last
    one's write before it is staged).
    Per file one status: 0 written, else the errno of what failed (at most 255); a
    file that fails leaves nothing behind. Raises ``ValueError`` (nothing written) for
    a piece of any page outside ``pool`` or parts that do not end the file."""
    if not compiled() or not hasattr(_pageio[0], "write_pages"):  # an extension built before it
        return None
    chunk = 0 if total <= WHOLE_WRITE_BYTES else WRITE_CHUNK  # 0: the whole file in one call
    return _pageio[0].write_pages(pool, header_len, total, parts, files, chunk, fsync, mode, dir_mode, staging, direct)


def _skip(bufs: list, n: int) -> list:
    """``bufs`` less their first ``n`` bytes (and empty buffers)."""
    out = [b for b in bufs if len(b)]
    while out and n >= len(out[0]):
        n -= len(out.pop(0))
    if n:
        out[0] = out[0][n:]
    return out


def io_all(call, fd: int, bufs: list, offset: int) -> None:
    """``preadv``/``pwritev`` of every byte of ``bufs`` at ``offset`` (a call may move fewer)."""
    bufs = _skip(bufs, 0)
    while bufs:
        n = call(fd, bufs[:1024], offset)  # at most IOV_MAX buffers a call
        if n == 0:
            raise OSError(errno.EIO, "the file ended early (changed while it was read)")
        offset += n
        bufs = _skip(bufs, n)
