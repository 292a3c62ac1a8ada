"""``file:///dir``: one file per page (and writer), in 256 shard directories; the embedded default.

    <dir>/kvtier-v5/<h[0:2]>/<h[2:]>.<field>    h = sha256(key), field = "<fingerprint>.p<page size>.g<a>-<b>of<G>"
    (plus "+rep" for the replicated part; "<fingerprint>.p<page size>.rep" when that is all)

A key's files sit side by side in its shard, named by the key's hash and their field:
no directory per key, whose ``mkdir`` cost a new page more than writing 1.4 MiB of it.
``<dir>/kvtier-v5/names/`` names every field a writer wrote under (``file_names``), so a
store bound to no geometry looks a key up without listing its shard.

The file format is ``kvtier.storage.pagefile``: a checked header, then the page's
parts at aligned offsets: from a ``page_head`` pool in split order (a part per
component and head group, each component's groups in turn), from a pool that holds
a component's page contiguously (``page_first``) in slot order (a part per
component), else in head order (a part per head group). So ``page_head`` and
``page_first`` pools read and write their parts in place (``preadv``/``writev``
straight between the file and the pool, no staging copy) and other layouts go
through a per-thread staging arena. A reader expects its
own layout's order and reads a file of the other one (another layout wrote it) on
the per-file path. A reader of another tensor-parallel size than the writer finds
the files holding its head groups among the names its geometry's writers can write,
and reads only their ranges (slot-order parts with more heads than it holds: whole). Parts move through
``kvtier.storage.pageio``, which hashes each chunk while it is in the CPU's cache; a
file the page cache does not hold is read with O_DIRECT where the filesystem allows.
A batch's files are read in one compiled call per I/O thread, the threads taking
them in turn (``pageio.read_pages``: parts in place, or staged and copied out once the
file checks out) wherever the pool is one allocation; only the files it did not read
go through the per-file path.
Objects of earlier layouts are not read: they are misses (version 1, one file per
part under ``kvtier-v1``; version 2, the same files as now in a directory per key
under ``kvtier-v2``, then in shards under ``kvtier-v3``, head order only; version 3
under ``kvtier-v4``, ``page_head`` pools' files in head order).

Key text never becomes a path (it is hashed), so no key can leave ``dir``. KV is as
sensitive as the prompts it came from: directories are created 0700 and objects 0600
(owner only, whatever the umask), or 0770 / 0660 with ``shared`` for a cache that a
group of users' engines share. Writes go to a temporary file in the same directory
and are renamed into place (``os.replace``), so readers see a whole object or none.
With ``capacity_bytes`` the least recently used keys are evicted (the files of theirs
this store knows: found at open or written since); the LRU order is seeded from the
files' mtimes at open, and a hit touches the files it read, so it survives restarts.

Reads trust nothing found in the directory: an object is opened with
``O_NOFOLLOW | O_NONBLOCK`` (a symlink or a FIFO neither redirects nor blocks the
read), must be a regular file, and is read only if its size is the size its name
implies; a file of another size gives at most its header to judge it by. Every part
read is checked against its header's checksum before its page counts as loaded. A
miss's destination page may hold bytes read before a check failed: it is never
reported loaded.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import itertools
import os
import re
import shutil
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
import xxhash

from ..errors import CorruptObject, NotAnObject, UnexpectedObject, UsageError
from ..pools import HostKVPool
from .base import _check_keys
from .codec import MAX_NAME_BYTES
from .cold_reads import CHOICES as COLD_CHOICES, ColdReads
from .objects import PagePlan, Part
from .options import Opt, check_options
from . import file_names, pageio
from .pagefile import (ALIGN, HEAD, LAYER, ORDERS, SLOT, SPLIT, FileLayout, OtherOrder, align_up, field_groups,
                       field_parts, file_field, header_room, longest_name, part_name, writer_files)
from .threaded import ThreadedStorage, aligned

_ROOT = "kvtier-v5"
_SHARD_NAME = re.compile(r"[0-9a-f]{2}")  # <h[:2]>
_counter = itertools.count()
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# Cold reads bypass the page cache where the platform and the filesystem allow it
_O_DIRECT, _RWF_NOWAIT = getattr(os, "O_DIRECT", 0), getattr(os, "RWF_NOWAIT", 0)
#: what a file system that cannot read without waiting answers ``RWF_NOWAIT`` with (tmpfs: EOPNOTSUPP)
_NO_NOWAIT = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PROBE = 16 * _PAGE  # bytes of a large file whose cached pages are counted at each of three places


class _Page:
    """One batch's copies between a pool's pages and the parts of ``plan``: per part, its
    pieces' numpy views over every page (see ``PagePlan.part_views``), and the staging
    bytes it needs (0 when the pool holds each piece contiguously: it moves in place)."""

    def __init__(self, plan: PagePlan, pool: HostKVPool, parts: list[Part], order: int = HEAD) -> None:
        self.plan, self.pool, self.order = plan, pool, order  # order: of the files these parts are cut for
        self.parts = {part_name(p): (p, plan.part_views(pool, p)) for p in parts}
        self.staged = {name: 0 if all(view[0].flags.c_contiguous for view, _, _ in views) else part.nbytes
                       for name, (part, views) in self.parts.items()}
        #: Staging for every part at once, each starting at a multiple of ``ALIGN`` (direct I/O)
        self.staging_bytes = sum(align_up(n) for n in self.staged.values())
        #: Staging for every part at once, in place or not: what the compiled reader's cold
        #: files go through (see the NOTE in ``_pageio_read.c``)
        self.cold_staging_bytes = sum(align_up(part.nbytes) for part, _ in self.parts.values())
        self._flat, self._spans = _flat_spans(pool, self.parts, self.staged)
        self._pieces: dict[str, list | None] = {}  # see pieces

    def compiled(self, names) -> bool:
        """Whether ``pageio.read_pages`` can move every part of ``names``: in place, or
        staged as arrays inside the pool's one allocation (``pieces``)."""
        return self._flat is not None and all(self.pieces(name) is not None for name in names)

    def pieces(self, name: str) -> list[tuple] | None:
        """Part ``name``'s pieces for ``pageio.read_pages``: where it moves in place,
        ``(byte offset in page 0, bytes from page to page, bytes)``; else ``(start,
        step, bytes, dims, byte strides)`` of each piece's array in ``flat`` (None
        where one is not such an array: a stride not positive, the last dim not
        contiguous)."""
        if name in self._spans:
            return self._spans[name]
        if name not in self._pieces:
            self._pieces[name] = _staged_pieces(self._flat, self.parts[name][1])
        return self._pieces[name]

    @property
    def flat(self) -> np.ndarray | None:
        """The pool's memory as one flat uint8 array (None: not one allocation)."""
        return self._flat

    def buffers(self, names: list[str], page: int, staging) -> tuple[dict[str, tuple[list, list]], int]:
        """Per part of ``names``, of ``page``: its buffers in file order (each piece in place,
        or a slice of the part's own stretch of ``staging``) and the ``(piece, staged)``
        pairs of arrays (one shape and dtype) that go through staging; and the bytes of
        ``staging`` used."""
        out, used = {}, 0
        for name in names:
            if name in self._spans:  # in place: slices of the pool's one allocation (cheaper than views)
                flat = self._flat
                out[name] = [flat[a + page * step:a + page * step + n] for a, step, n in self._spans[name]], []
                continue
            part, views = self.parts[name]
            bufs, staged = [], []
            for view, offset, nbytes in views:
                piece = view[page]
                if not self.staged[name]:
                    bufs.append(piece.reshape(-1).view(np.uint8))
                    continue
                buf = staging[used + offset:used + offset + nbytes]
                bufs.append(buf)
                staged.append((piece, buf.view(piece.dtype).reshape(piece.shape)))
            out[name] = bufs, staged
            used += align_up(self.staged[name])
        return out, used


def _order(plan: PagePlan, pool: HostKVPool) -> int:
    """The order of parts (``pagefile``) in which a pool's files are written, and read
    first: the first of split, slot and layer order whose parts the pool holds
    contiguously (``page_head``, ``page_first``, ``page_first_direct``), so its pages
    move in place; else head order (``layer_first`` is staged in any)."""
    held = plan.held_groups
    if not held:
        return HEAD

    def in_place(parts) -> bool:
        return all(view[0].flags.c_contiguous for p in parts for view, _, _ in plan.part_views(pool, p))

    if in_place(plan.split_parts(held)):
        return SPLIT
    return next((order for order in (SLOT, LAYER)
                 if in_place(plan.component_parts(held.start, held.stop, ORDERS[order]))), HEAD)


def _write_parts(plan: PagePlan, order: int) -> list[Part]:
    """The parts of a writer's file in ``order``, in file order."""
    if order == HEAD:
        return plan.write_parts
    held, rep = plan.held_groups, [p for p in plan.write_parts if part_name(p) == "rep"]
    if order == SPLIT:
        return plan.split_parts(held) + rep
    return plan.component_parts(held.start, held.stop, ORDERS[order]) + rep


def _file_parts(plan: PagePlan, field: str, wanted, order: int) -> list[tuple[str, Part | None]]:
    """The parts a reader of ``plan`` reads of a file of ``field`` in ``order``, to get its
    parts ``wanted`` (head-order names), in file order, each with its cut of the pool
    (None: a slot-order part holding heads the pool does not, read whole and cut here)."""
    tail = field.rsplit("/", 1)[1]
    names = [n for n, _ in field_parts(plan, tail, order) or ()]
    by_name = {part_name(p): p for p in plan.read_parts}
    if order == HEAD:
        return [(n, by_name[n]) for n in names if n in wanted]
    if order == SPLIT:  # per component, the wanted head groups' parts (named h{j}of{G}.<component>)
        span = field_groups(tail) if names else None
        groups = [j for j in range(*span) if f"h{j}of{plan.groups}" in wanted] if span else []
        return ([(part_name(p), p) for p in plan.split_parts(groups)]
                + ([("rep", by_name["rep"])] if "rep" in wanted else []))
    cut = plan.component_parts(*field_groups(tail), ORDERS[order]) if any(w != "rep" for w in wanted) else []
    return list(zip(names, cut)) + ([("rep", by_name["rep"])] if "rep" in wanted else [])


def _component_cuts(plan: PagePlan, pool: HostKVPool, field: str, wanted, bufs: dict, page: int,
                    order: int) -> list[tuple]:
    """``(piece, staged)`` pairs taking the heads of ``wanted`` groups (head-order names)
    from the whole per-component parts ``bufs`` (name -> bytes; slot or layer ``order``)
    of a file of ``field`` into ``page`` of ``pool``."""
    a, _ = field_groups(field.rsplit("/", 1)[1])
    groups = sorted(int(w[1:].split("of")[0]) for w in wanted if w != "rep")
    held, out = plan.held_groups, []
    for name, buf in bufs.items():
        if name == "rep":
            for view, offset, nbytes in plan.part_views(pool, _rep(plan)):
                piece = view[page]
                out.append((piece, buf[offset:offset + nbytes].view(piece.dtype).reshape(piece.shape)))
            continue
        c = plan.spec.full.component(name.split(".")[1])
        per = c.head_num // plan.groups
        dest = pool.page_views[c.name].np_all_layers[page]  # (slot, layer, head, dim)
        if order == LAYER:
            part = buf.view(dest.dtype).reshape(dest.shape[1], dest.shape[0], -1, dest.shape[3]).transpose(1, 0, 2, 3)
        else:
            part = buf.view(dest.dtype).reshape(dest.shape[0], dest.shape[1], -1, dest.shape[3])
        for j in groups:
            out.append((dest[:, :, (j - held.start) * per:(j - held.start + 1) * per],
                        part[:, :, (j - a) * per:(j - a + 1) * per]))
    return out


def _rep(plan: PagePlan) -> Part:
    return next(p for p in plan.read_parts if part_name(p) == "rep")


def _empty(nbytes: int) -> np.ndarray:
    """``nbytes`` new bytes starting at a multiple of ``ALIGN`` (for direct I/O): not the
    thread's arena, whose bytes the caller's scratch already holds."""
    return aligned(np.empty(nbytes + ALIGN - 1, dtype=np.uint8), nbytes, ALIGN)


def _flat_spans(pool: HostKVPool, parts: dict, staged: dict) -> tuple[np.ndarray | None, dict]:
    """The pool's memory as one flat uint8 array and, per part that moves in place, its
    pieces as ``(byte offset in page 0, bytes from page to page, bytes)`` in it; ``(None,
    {})`` where the pool is not one allocation (buffers it wraps) or a piece falls outside."""
    raw = getattr(pool, "raw", None)
    if raw is None or not raw.is_contiguous() or raw.device.type != "cpu":
        return None, {}
    flat = raw.view(-1).view(torch.uint8).numpy()
    base, spans = flat.ctypes.data, {}
    for name, (_, views) in parts.items():
        if staged[name]:
            continue
        pieces = []
        for view, _, nbytes in views:
            start, step = view.ctypes.data - base, view.strides[0]
            if start < 0 or step < 0 or start + (view.shape[0] - 1) * step + nbytes > flat.nbytes:
                return None, {}
            pieces.append((start, step, nbytes))
        spans[name] = pieces
    return flat, spans


def _staged_pieces(flat: np.ndarray | None, views) -> list[tuple] | None:
    """``_Page.pieces`` of a staged part (its ``(view, offset, nbytes)`` views)."""
    if flat is None:
        return None
    out = []
    for view, _, nbytes in views:
        start, step = view.ctypes.data - flat.ctypes.data, view.strides[0]
        dims, strides = view.shape[1:], view.strides[1:]
        extent = sum((d - 1) * st for d, st in zip(dims[:-1], strides[:-1])) + dims[-1] * view.itemsize if dims else 0
        if (not dims or start < 0 or step < 0 or min(strides) < 0 or strides[-1] != view.itemsize
                or start + (view.shape[0] - 1) * step + extent > flat.nbytes):
            return None
        out.append((start, step, nbytes, dims, strides))
    return out


def _by_name_length(keys, field: str, indices) -> list[list[tuple[int, str]]]:
    """``(index, object name)`` of each of ``indices``, in groups whose names have as many
    UTF-8 bytes: their files share a layout (one compiled call per group)."""
    groups: dict[int, list] = {}
    for i in indices:
        name = f"{keys[i]}#{field}"
        groups.setdefault(len(name.encode()), []).append((i, name))
    return list(groups.values())


def _tmp_path(stem: str, name: str) -> str:
    """A new temporary path for the file ``<stem>.<name>``, in its shard: hidden (a dot
    first), and unique to this process, thread and call."""
    shard, tail = stem.rsplit("/", 1)
    return f"{shard}/.{tail}.{name}.{os.getpid()}.{threading.get_ident()}.{next(_counter)}.tmp"


def _checksum(bufs: list) -> int:
    if len(bufs) == 1:
        return xxhash.xxh3_64_intdigest(bufs[0])
    h = xxhash.xxh3_64()
    for b in bufs:
        h.update(b)
    return h.intdigest()


def _runs(indices: list[int]) -> list[list[int]]:
    """``indices`` (ascending) split into runs of consecutive ones."""
    runs = [[i] for i in indices[:1]]
    for i in indices[1:]:
        if i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _follow(parts: list, start: int) -> bool:
    """Whether ``parts`` (``(offset, buffers)`` each) follow each other from ``start``, no gap between."""
    for offset, bufs in parts:
        if offset != start:
            return False
        start += sum(len(b) for b in bufs)
    return True


def _aligned(bufs: list, offset: int) -> bool:
    """Whether a read of ``bufs`` at ``offset`` meets direct I/O's alignment (every buffer's
    address and length, and the offset, multiples of ``ALIGN``)."""
    return offset % ALIGN == 0 and all(b.ctypes.data % ALIGN == 0 and len(b) % ALIGN == 0 for b in bufs)



class FileStorage(ThreadedStorage):
    scheme = "file"
    OPTIONS = {**ThreadedStorage.OPTIONS, "capacity_bytes": Opt(int, 1, none_ok=True), "fsync": Opt(bool),
               "shared": Opt(bool), "direct_io": Opt(bool), "direct_writes": Opt(bool),
               "cold_reads": Opt(str, choices=COLD_CHOICES)}
    CHUNK_BYTES = 4 << 20  # about a core's share of the CPU cache: staged parts are checked while cached
    READ_STAGING_BYTES = 16 << 20  # a reader thread's staging for cold files, at most (see _staged_files)

    def __init__(self, path: str | os.PathLike, *, capacity_bytes: int | None = None, fsync: bool = False,
                 shared: bool = False, direct_io: bool = True, direct_writes: bool = False, cold_reads: str = "auto",
                 **options) -> None:
        super().__init__(**options)
        check_options(self.OPTIONS, capacity_bytes=capacity_bytes, fsync=fsync, shared=shared, direct_io=direct_io,
                      direct_writes=direct_writes, cold_reads=cold_reads)
        #: Read files whose header is not in the page cache with O_DIRECT (where the
        #: platform, the filesystem and the buffers' alignment allow; a filesystem that
        #: refuses turns it off).
        self.direct_io = direct_io and bool(_O_DIRECT and _RWF_NOWAIT)
        #: Write with O_DIRECT too (same conditions): steady write speed on disks whose
        #: page cache writeback stalls, at the cost of recent pages no longer being
        #: read from the page cache.
        self.direct_writes = direct_writes and bool(_O_DIRECT)
        #: Where the compiled reader puts cold files: staging or the pool, learned from
        #: this store's own cold reads, or fixed (``kvtier.storage.cold_reads``)
        self.cold_reads = ColdReads(cold_reads)
        self.root = Path(path).resolve() / _ROOT
        self._dir_mode, self._file_mode = (0o770, 0o660) if shared else (0o700, 0o600)
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            self._mkdir(self.root)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(13, "not writable")
        except OSError as e:
            raise UsageError(f"file storage: cannot use directory {self.root}: {e.strerror or e}") from None
        self._root_name = str(self.root)
        self._layouts: dict[tuple[str, int], tuple[FileLayout, list[str]]] = {}  # see _layout
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._lock = threading.Lock()
        # a key's stem (see _stem) -> {file name after the stem: bytes}, least recently used first
        self._lru: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._total = 0  # bytes of every file in self._lru
        self._shards: set[str] = set()  # shard names seen as this store's own directories (_stem)
        if capacity_bytes is not None:
            self._scan()

    # -- paths -------------------------------------------------------------------------------
    def _stem(self, key: str) -> str:
        """``<root>/<h[:2]>/<h[2:]>``: the path of ``key``'s files up to ``.<field>``. A str:
        the I/O paths build their paths as strings (pathlib costs more per object than the
        open, fstat and close together)."""
        h = hashlib.sha256(key.encode()).hexdigest()
        shard = h[:2]
        if shard not in self._shards:
            self._check_shard(shard)
        return f"{self._root_name}/{shard}/{h[2:]}"

    def _check_shard(self, name: str) -> None:
        """Shard ``name`` seen as a real directory (then not looked at again), or not made
        yet (its first write makes it, checked). A symlink at its name would lead every
        read, write and delete of its keys out of the store: it is removed (the link, not
        what it points to), a counted fault. Anything else there fails each call on its
        keys (ENOTDIR), counted as any file system's fault.

        NOTE: once per shard and process: a shard swapped for a link later is followed
        until the next process. Only a writer of the store's directory can do that, who
        can write its objects too (``shared`` stores trust their group)."""
        path = f"{self._root_name}/{name}"
        try:
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                self._shards.add(name)
            if not stat.S_ISLNK(mode):
                return
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            self._fault("shard", e)
            return
        self._fault("shard", NotAnObject(errno.ELOOP, "a link at a shard's name, removed", path))

    def _key_files(self, key: str) -> list[str]:
        """The paths of every file of ``key`` (any geometry, any writer), sorted. Lists its
        shard: for the calls that know no geometry (``exists`` unbound, ``delete``)."""
        shard, tail = self._stem(key).rsplit("/", 1)
        return sorted(f"{shard}/{name}" for name in self._listed(shard).get(tail, ()))

    @staticmethod
    def _listed(shard: str) -> dict[str, list[str]]:
        """The object files in directory ``shard``, per key hash (the part of their name
        before the first dot; temporary files, which start with a dot, left out)."""
        out: dict[str, list[str]] = {}
        try:
            with os.scandir(shard) as entries:
                for e in entries:
                    if not e.name.startswith("."):
                        out.setdefault(e.name.partition(".")[0], []).append(e.name)
        except (FileNotFoundError, NotADirectoryError):
            pass
        return out

    @staticmethod
    def _file_name(field: str) -> str:
        return field.replace("/", ".")  # fingerprints and part names hold [A-Za-z0-9=_+-] only

    # -- which files -----------------------------------------------------------------------------
    @staticmethod
    def _sources(plan: PagePlan) -> list[tuple[str, list[str]]]:
        """``(field, parts to read)`` of the files a writer of the reader's own
        tensor-parallel size wrote: the reader's head groups, and ``rep`` from rank 0's file."""
        groups = [p for p in plan.read_parts if part_name(p) != "rep"]
        if not groups or plan.write_parts == plan.read_parts:  # rank 0, or only replicated parts
            return [(file_field(plan, plan.read_parts), [part_name(p) for p in plan.read_parts])]
        out = [(file_field(plan, groups), [part_name(p) for p in groups])]
        if len(groups) < len(plan.read_parts):  # rep, which rank 0 wrote after its own groups
            out.append((f"{plan.prefix}/g0-{len(groups)}of{plan.groups}+rep", ["rep"]))
        return out

    def _cover(self, stem: str, plan: PagePlan,
               there: dict[str, bool] | None = None) -> list[tuple[str, list[str]]] | None:
        """Files of the key at ``stem`` that together hold every part the reader needs
        (written by another tensor-parallel size than the reader's), with the parts to
        read from each. For each part still lacking, the files that can hold it are
        looked for (whole-page writers first) until one is there; a part no file holds
        ends the search: a miss asks as many names as the head groups have divisors.
        ``there``: fields already asked for (whether each is there), not asked again."""
        out: dict[str, list[str]] = {}
        there = dict(there or {})
        for wanted, fields in _holders(plan):
            for field in fields:
                if field not in there:
                    there[field] = self._is_object(f"{stem}.{self._file_name(field)}")
                if there[field]:
                    out.setdefault(field, []).append(wanted)
                    break
            else:
                return None
        return list(out.items())

    def _layout(self, key: str, plan: PagePlan, field: str, order: int) -> tuple[FileLayout, list[str]]:
        """The layout of ``key``'s file of ``field`` (parts in ``order``) and the names of
        its parts in file order."""
        name = f"{key}#{field}"
        layout, names = self._shape(plan, field, name, order)
        return layout.renamed(name), names

    def _shape(self, plan: PagePlan, field: str, name: str, order: int) -> tuple[FileLayout, list[str]]:
        """The layout of the files of ``field`` (parts in ``order``) whose names have as
        many UTF-8 bytes as ``name`` (built for one of them: rename it, or ask its
        ``prefix``), and the names of their parts in file order.
        NOTE: built once per field and name length: building one parses the field and
        lays out every part (about 20 us per file, a fifth of a warm file's Python work)."""
        shape = (field, len(name.encode()), order)
        known = self._layouts.get(shape)
        if known is None:
            parts = field_parts(plan, field.rsplit("/", 1)[1], order)
            known = FileLayout(name, [n for _, n in parts], order), [part for part, _ in parts]
            if len(self._layouts) >= 4096:  # a bound: key lengths vary, fields do not
                self._layouts.clear()
            self._layouts[shape] = known
        return known

    # -- the contract ----------------------------------------------------------------------------
    def exists_each(self, keys: Sequence[str]) -> list[bool]:
        return self._exists(keys, False)

    def batch_exists(self, keys: Sequence[str]) -> int:
        present = self._exists(keys, True)
        return next((i for i, p in enumerate(present) if not p), len(present))

    def _exists(self, keys: Sequence[str], leading: bool) -> list[bool]:
        """Per key, whether it is present (for the bound geometry, else any); with
        ``leading``, the keys up to the first missing one only."""
        keys = _check_keys(keys)
        if not keys:
            return []
        t0 = time.perf_counter()
        try:
            if self._bound is None:
                return self._has_any(keys, leading)
            sources = self._sources(self._bound)
            out = []
            for key in keys:
                stem = self._stem(key)
                there = {f: self._is_object(f"{stem}.{self._file_name(f)}") for f, _ in sources}
                out.append(all(there.values()) or self._cover(stem, self._bound, there) is not None)
                if leading and not out[-1]:
                    break
            return out
        except Exception as e:  # a storage fault is a miss, never an exception for the caller
            self._fault("exists", e)
            return [False] * len(keys)
        finally:
            self._stats.timed("exists", time.perf_counter() - t0)

    def _checked(self, keys, host_pool, host_indices, writing: bool):
        """``(keys, pages, plan, head_room)``: the batch checked, and the bytes that hold
        the header of any of its files."""
        keys, pages = self._check_pages(keys, host_pool, host_indices, writing=writing)
        plan = self._plan(host_pool)
        key_bytes = max((len(k.encode()) for k in keys), default=0)
        longest = longest_name(key_bytes, plan)
        if longest > MAX_NAME_BYTES:
            raise UsageError(f"object names '<key>#<field>' would be up to {longest} bytes, over the header's "
                             f"{MAX_NAME_BYTES}; use shorter keys")
        return keys, pages, plan, header_room(key_bytes, plan)

    def batch_set(self, keys: Sequence[str], host_pool: HostKVPool, host_indices: torch.Tensor) -> list[bool]:
        keys, pages, plan, head_room = self._checked(keys, host_pool, host_indices, writing=True)
        order = _order(plan, host_pool)
        parts = _write_parts(plan, order)
        copies = _Page(plan, host_pool, parts, order)
        field = file_field(plan, plan.write_parts)
        stored = [False] * len(keys)
        compiled = pageio.compiled() and copies.compiled([part_name(p) for p in parts])
        t0 = time.perf_counter()
        try:  # named before any file of the name lands (file_names): unbound look-ups ask only those
            file_names.register(self._root_name, self._file_name(field), self._file_mode, self._mkdir)
        except OSError as e:  # its files are still written: bound readers and gets find them
            self._fault("write", e)

        def set_chunk(chunk: range) -> None:
            # direct writes: two files' staging, one for the write in flight, one for the next file
            _, head, staging = self._scratch(head_room, copies, 2 if compiled and self.direct_writes else 1)
            try:
                written = self._write_compiled(keys, pages, plan, field, copies, chunk, staging) if compiled else ()
            except Exception as e:  # an unexpected fault of the compiled writer: its step's pages are not stored
                self._fault("write", e)
                return
            for i in chunk:
                if i in written:
                    stored[i] = True
                    continue
                try:  # anything the compiled writer did not write: written again here, which judges it
                    self._write_page(keys[i], plan, field, copies, pages[i], head, staging)
                    stored[i] = True
                except Exception as e:
                    self._fault("write", e)

        self._run(set_chunk, len(keys), sum(p.nbytes for p in plan.write_parts), least=8 if compiled else 1)
        written = sum(stored)
        self._stats.add(pages_written=written, write_failures=len(keys) - written,
                        bytes_written=written * sum(p.nbytes for p in plan.write_parts))
        self._stats.timed("set", time.perf_counter() - t0)
        return stored

    def batch_get(self, keys: Sequence[str], host_pool: HostKVPool, host_indices: torch.Tensor) -> list[bool]:
        keys, pages, plan, head_room = self._checked(keys, host_pool, host_indices, writing=False)
        order = _order(plan, host_pool)
        sources = self._sources(plan)
        # the parts of the files the reader's own-size writers write, cut for the order they expect
        parts = [p for field, wanted in sources for _, p in _file_parts(plan, field, wanted, order)]
        copies = _Page(plan, host_pool, parts, order)
        loaded = [False] * len(keys)
        compiled = pageio.compiled() and copies.compiled([part_name(p) for p in parts])
        mode = self.cold_reads.pick() if compiled and self.direct_io else None
        counts = []  # per chunk: (files the compiled reader was given, of them read cold)
        page_bytes = sum(p.nbytes for p in plan.read_parts)
        t0 = time.perf_counter()

        def get_rest(chunk: range) -> None:  # the pages the compiled reader did not read: one by one
            scratch = self._scratch(head_room, copies)
            for i in chunk:
                loaded[rest[i]] = self._get_page(keys[rest[i]], plan, sources, copies, pages[rest[i]], scratch,
                                                 gone.get(rest[i], ()))

        rest, gone = range(len(keys)), {}
        try:
            if compiled:
                read, gone = self._read_compiled(keys, pages, plan, sources, copies, mode, head_room, counts)
                for i in read:
                    loaded[i] = True
                    if self.capacity_bytes is not None:
                        self._touch(self._stem(keys[i]), sources)
                rest = [i for i in rest if not loaded[i]]
            self._run(get_rest, len(rest), page_bytes)
        except Exception as e:  # an unexpected fault: the pages not yet loaded stay misses
            self._fault("get", e)
        seconds, hits = time.perf_counter() - t0, sum(loaded)
        if mode is not None:
            files, cold = sum(f for f, _ in counts), sum(c for _, c in counts)
            self.cold_reads.learn(mode, files, cold, hits * page_bytes, seconds)
        self._stats.add(hits=hits, misses=len(keys) - hits, bytes_read=hits * page_bytes)
        self._stats.timed("get", seconds)
        return loaded

    # -- one page ----------------------------------------------------------------------------------
    def _staged_files(self, copies: _Page, mode: str | None) -> int:
        """How many files' staging the compiled reader gets: one without direct reads or
        with cold files read into the pool (``mode``, see ``kvtier.storage.cold_reads``);
        else two at least (a cold file is hashed, and copied out, while the next is read), up to
        8 within ``READ_STAGING_BYTES`` (warm files use the first, cold ones the others in
        turn), each of a whole page (``cold_staging_bytes``).
        NOTE: O_DIRECT reads into the same staging file after file took about twice as
        long as reads into the pool on this VM's disk, and one stretch per file of a call
        recovered most of it (in one process, alternating page_first and page_head pools
        over the same cold files)."""
        if not self.direct_io or mode != "staged":
            return 1
        return max(2, min(8, self.READ_STAGING_BYTES // max(copies.cold_staging_bytes, 1)))

    def _scratch(self, head_room: int, copies: _Page, files: int = 1, per_file: int | None = None) -> tuple:
        """This thread's ``(sink, head, staging)`` from its aligned arena: ``ALIGN`` bytes that
        take the zeros between parts a read skips, ``head_room`` for a header, then staging
        for ``files`` pages at once (the compiled reader hashes a cold file while it reads
        the next one) of ``per_file`` bytes each (default ``copies.staging_bytes``).
        NOTE: kept with the arena it was cut from: a batch asks once per page, and the
        slicing costs tens of us once a page's copy has pushed it out of the CPU's caches."""
        shape = (head_room, files * (copies.staging_bytes if per_file is None else per_file))
        last = getattr(self._local, "scratch", None)
        if last is not None and last[0] == shape and last[1] is getattr(self._local, "arena", None):
            return last[2]
        arena = self._arena(ALIGN + head_room + shape[1], align=ALIGN)
        out = arena[:ALIGN], arena[ALIGN:ALIGN + head_room], arena[ALIGN + head_room:]
        self._local.scratch = shape, self._local.arena, out
        return out

    def _write_page(self, key: str, plan: PagePlan, field: str, copies: _Page, page: int, head, staging) -> None:
        """Write one page's file from the pool, its header through ``head``."""
        layout, names = self._layout(key, plan, field, copies.order)
        (dests, _), parts = copies.buffers(names, page, staging), []
        for i, name in enumerate(names):
            part_bufs, staged = dests[name]
            for piece, buf in staged:
                np.copyto(buf, piece)
            parts.append((layout.offsets[i], part_bufs))
        self._write(self._stem(key), self._file_name(field), layout, head[:layout.header_len], parts)

    def _write_compiled(self, keys, pages, plan: PagePlan, field: str, copies: _Page, chunk: range,
                        staging) -> set[int]:
        """The pages of ``chunk`` whose files the compiled writer wrote (``pageio.write_pages``:
        parts in place, or gathered through ``staging``; one call per name length, whose
        files share a layout). The others are written again one by one, which judges
        their faults.
        NOTE: a page_first page's gather (numpy) and its file calls in Python took about
        as long as the kernel's write of it, holding the GIL between the I/O threads."""
        file_name, written = self._file_name(field), set()
        for todo in _by_name_length(keys, field, chunk):
            layout, names = self._shape(plan, field, todo[0][1], copies.order)
            parts = [(k, layout.offsets[k], copies.pieces(name)) for k, name in enumerate(names)]
            stems = [self._stem(keys[i]) for i, _ in todo]
            files = [(_tmp_path(stem, file_name), f"{stem}.{file_name}", layout.prefix(name), pages[i])
                     for (i, name), stem in zip(todo, stems)]
            status = pageio.write_pages(copies.flat, layout.header_len, layout.total, parts, files, self.fsync,
                                        self._file_mode, self._dir_mode, staging, self.direct_writes)
            if status is None:  # switched off meanwhile (KVTIER_NATIVE=0)
                return written
            for (i, _), stem, s in zip(todo, stems, status):
                if s == 0:
                    written.add(i)
                    if self.capacity_bytes is not None:
                        self._account(stem, file_name, layout.total)
        return written

    def _get_page(self, key: str, plan: PagePlan, sources, copies: _Page, page: int, scratch,
                  gone: tuple[str, ...] = ()) -> bool:
        """Read one page's parts into the pool (checked); False: a miss (faults counted).
        ``gone``: fields of ``sources`` whose files the compiled reader found missing; the
        files other writers wrote are then looked for at once, those not asked again.
        NOTE: a missing page took 62-107 us here before (its parts, buffers and layout
        worked out for an open that fails), against 5-6 us for ``batch_exists``."""
        stem = self._stem(key)
        try:
            read = None if gone else self._read_own(stem, key, plan, sources, copies, page, scratch)
            if read is None:  # a file of sources is missing: other writers' files may hold the page
                read = self._cover(stem, plan, dict.fromkeys(gone, False))
                if read is None or read == sources:
                    return False
                self._read_parts(stem, key, plan, read, copies, page, scratch)
        except FileNotFoundError:
            return False
        except UnexpectedObject as e:
            self._fault("get", e)
            return False
        except CorruptObject as e:
            self._stats.add(corrupt=1, errors=1)
            self._warnings.warn(("corrupt",), "kvtier storage %s: %s; deleting it", self.scheme, e)
            self._unlink(e.path)
            return False
        except OSError as e:
            self._fault("read", e)
            return False
        if self.capacity_bytes is not None:
            self._touch(stem, read)
        return True

    def _read_own(self, stem: str, key: str, plan: PagePlan, sources, copies: _Page, page: int, scratch):
        """``sources`` once read into the pool (``_read_parts``); None where a file of them is missing."""
        try:
            self._read_parts(stem, key, plan, sources, copies, page, scratch)
        except FileNotFoundError:
            return None
        return sources

    def _read_compiled(self, keys, pages, plan: PagePlan, sources, copies: _Page, mode: str | None,
                       head_room: int, counts: list) -> tuple[set[int], dict[int, tuple[str, ...]]]:
        """The pages whose files the compiled reader read into the pool and checked
        (``pageio.read_pages``: parts in place, or through this thread's staging and
        copied out once the file checks out; cold files with O_DIRECT when
        ``direct_io``, each way of reading them as ``mode`` says). The others are for the
        per-file path, which judges them: missing, another object, corrupt, a fault, or
        cold where O_DIRECT fails. Returned with them: per page of the others, the
        fields of ``sources`` whose files it found missing (``MISSING``: ENOENT). Appends
        to ``counts`` each call's files and how many of them it read cold.

        One call per source and name length (a warm file's Python work, paths, opens and
        checks, took longer here than reading its 1.4 MiB from the page cache) on each of
        ``io_threads`` threads, which take the files in turn from a shared claim until
        none is left.
        NOTE: each thread read its share in calls of 128 MiB before. Each call ended with
        its last cold file hashed and no read in flight, and began with its own setup:
        1-1.8 ms of idle disk slot per call against an 8 MiB file's 3.8 ms read, traced on
        an AMD EPYC VM whose disk reads 4.5 GB/s with O_DIRECT. Calls of 8 pages had read
        128 cold pages of 8 MiB at 4.27-4.32 GB/s, calls of 128 MiB at 4.41-4.45 and one
        call per thread's fixed half at 4.44-4.52 (vLLM's fs tier 4.49-4.59). A fixed
        half leaves one thread reading alone at the end when its disk reads ran slower."""
        stems = [self._stem(key) for key in keys]
        calls = []  # (layout, its parts, the files, their pages' indices, a claim shared by the threads)
        for field, wanted in sources:
            file_name = self._file_name(field)
            wanted = {name for name, _ in _file_parts(plan, field, wanted, copies.order)}
            for todo in _by_name_length(keys, field, range(len(keys))):
                layout, names = self._shape(plan, field, todo[0][1], copies.order)
                parts = [(k, layout.offsets[k], copies.pieces(name)) for k, name in enumerate(names) if name in wanted]
                files = [(f"{stems[i]}.{file_name}", layout.prefix(name), pages[i]) for i, name in todo]
                calls.append((field, layout, len(names), parts, files, [i for i, _ in todo], pageio.new_claim()))
        answers: list[list[bytes]] = [[] for _ in calls]

        def read_share(_) -> None:
            scratch = self._scratch(head_room, copies, self._staged_files(copies, mode),
                                    copies.cold_staging_bytes if self.direct_io else None)
            for (_, layout, nsums, parts, files, _, claim), answer in zip(calls, answers):
                status = pageio.read_pages(copies.flat, layout.header_len, layout.total, nsums, parts, files,
                                           self.direct_io, scratch[2], claim)
                if status is None:  # switched off meanwhile (KVTIER_NATIVE=0)
                    return
                answer.append(status)
                counts.append((len(status) - status.count(pageio.ELSEWHERE), status.count(pageio.DIRECT)))

        # io_threads steps of one: each thread (the caller one of them) takes a step and
        # reads until the claims run out; a thread that takes a second step finds none left
        self._run(read_share, self.io_threads, 1)
        read, gone = set(range(len(keys))), {}
        for (field, _, _, _, files, indices, _), answer in zip(calls, answers):
            ok, missing = np.zeros(len(files), dtype=bool), np.zeros(len(files), dtype=bool)
            for status in answer:
                got = np.frombuffer(status, dtype=np.uint8)
                ok |= (got == pageio.READ) | (got == pageio.DIRECT)
                missing |= got == pageio.MISSING
            read.difference_update(i for i, good in zip(indices, ok.tolist()) if not good)
            for i in np.flatnonzero(missing).tolist():
                gone[indices[i]] = gone.get(indices[i], ()) + (field,)
        return read, gone

    def _read_parts(self, stem: str, key: str, plan: PagePlan, sources, copies: _Page, page: int,
                    scratch) -> None:
        """Every part of ``sources`` read and checked, then staged parts copied into the pool.
        Raises what the caller counts (a ``CorruptObject`` carries the file's ``path``).
        ``scratch``: ``(sink, head, staging)`` (see ``_scratch``)."""
        sink, head, staging = scratch
        staged_all = []
        for field, wanted in sources:
            path = f"{stem}.{self._file_name(field)}"
            try:
                try:
                    staged, used = self._read_source(path, key, plan, field, wanted, copies, copies.order, page, sink,
                                                     head, staging)
                except OtherOrder as e:  # written by a pool of another layout: its order's parts, own staging
                    staged, _ = self._read_source(path, key, plan, field, wanted, copies, e.order, page, sink,
                                                  head, None)
                    used = 0
            except CorruptObject as e:
                e.path = path  # the caller deletes it
                raise
            staged_all += staged
            staging = staging[used:]
        for piece, staged in staged_all:  # every part checked before any staged byte reaches the pool
            np.copyto(piece, staged)

    def _read_source(self, path: str, key: str, plan: PagePlan, field: str, wanted, copies: _Page, order: int,
                     page: int, sink, head, staging) -> tuple[list, int]:
        """The parts ``wanted`` (head-order names) of the file at ``path`` read in ``order``
        and checked: in place, or staged (through ``staging``, or new memory where it is
        None) with the ``(piece, staged)`` copies still to make returned, and the bytes
        of ``staging`` used. Raises ``OtherOrder`` for a file of the other order."""
        layout, names = self._layout(key, plan, field, order)
        named = _file_parts(plan, field, wanted, order)
        head = head[:layout.header_len]
        if any(p is None for _, p in named):  # per-component parts with heads this pool does not hold
            sizes = dict(zip(names, layout.sizes))
            whole = {name: _empty(sizes[name]) for name, _ in named}
            self._read_file(path, layout, names, {name: ([buf], []) for name, buf in whole.items()}, sink, head)
            return _component_cuts(plan, copies.pool, field, wanted, whole, page, order), 0
        mine = [name for name, _ in named]
        if order != copies.order or any(name not in copies.parts for name in mine):
            copies, staging = _Page(plan, copies.pool, [p for _, p in named], order), None
        if staging is None:
            staging = _empty(copies.staging_bytes)
        dests, used = copies.buffers(mine, page, staging)
        self._read_file(path, layout, names, dests, sink, head)
        return [pair for _, staged in dests.values() for pair in staged], used

    def _read_file(self, path: str, layout: FileLayout, names: list[str], dests: dict, sink, head) -> None:
        """Parts ``dests`` (part name -> (buffers, staged)) of the file at ``path``, read and
        checked against its header (read into ``head``); the file must be a regular file of
        ``layout.total`` bytes."""
        fd = os.open(path, _READ_FLAGS)
        direct: list = []  # the file's O_DIRECT descriptor, opened when first needed
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotAnObject(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
            if st.st_size != layout.total:
                raise layout.judge(os.pread(fd, min(st.st_size, layout.header_len), 0), st.st_size)
            wanted = [i for i, name in enumerate(names) if name in dests]
            # NOTE: a cold file is read with O_DIRECT (about twice a buffered read's speed
            # from disk here, and it leaves the page cache to the host tier's own copy);
            # buffers that are not aligned for it are read buffered
            cold, have_head = self._is_cold(fd, layout.total, head) if self.direct_io else (False, False)
            cold = cold and self._open_direct(path, st, direct)
            if not cold:  # each part is hashed as it is read, while in the CPU's cache
                parts = [(layout.offsets[i], dests[names[i]][0]) for i in wanted]
                # the header comes in the same call (its own digest, of no use, costs nothing)
                got = pageio.move(fd, parts, write=False) if have_head else \
                    pageio.move(fd, [(0, [head]), *parts], write=False)[1:]
            else:  # in one call per run of consecutive parts: the disk wants large requests
                for run in _runs(wanted):
                    bufs, offset = [], layout.offsets[run[0]]
                    if run[0] == 0 and not have_head:  # the header comes with the first part
                        bufs, offset, have_head = [head], 0, True
                    for i in run:
                        if i != run[0]:
                            bufs.append(sink[:layout.pad_before(i)])
                        bufs += dests[names[i]][0]
                    pageio.io_all(os.preadv, direct[0] if _aligned(bufs, offset) else fd, bufs, offset)
                if not have_head:
                    pageio.io_all(os.preadv, fd, [head], 0)
                got = [_checksum(dests[names[i]][0]) for i in wanted]
        finally:
            os.close(fd)
            for other in direct:
                os.close(other)
        sums = layout.checksums(head)
        for i, digest in zip(wanted, got):
            if digest != sums[i]:
                raise CorruptObject(f"{path.rsplit('/', 1)[1]}: part {names[i]} fails its checksum")

    @staticmethod
    def _is_cold(fd: int, size: int, head) -> tuple[bool, bool]:
        """Whether the file (``size`` bytes) is mostly out of the page cache, and whether
        ``head`` now holds its header. Counted without reading where the kernel can
        (``cachestat``), at the file's start, middle and end: counting a whole 8 MiB file
        walks 2048 page-cache entries (about 40 us once its copy has pushed them out of
        the CPU's caches), and files are written, read and evicted whole. Else the header
        is asked without waiting (read when cached).
        NOTE: a non-blocking read of what is not cached still starts reading it into the
        cache, racing the direct read of the parts: hence only the header is asked."""
        if size <= 3 * _PROBE:
            spans = [(0, size)]
        else:
            spans = [(0, _PROBE), (size // 2 - size // 2 % _PAGE, _PROBE), (size - _PROBE, _PROBE)]
        cached, pages = 0, 0
        for offset, length in spans:
            n = pageio.cached_pages(fd, offset, length)
            if n is None:
                break
            cached += n
            pages += (offset + length - 1) // _PAGE - offset // _PAGE + 1
        else:
            return 2 * cached < pages, False
        try:
            have = os.preadv(fd, [head], 0, _RWF_NOWAIT) == len(head)
        except BlockingIOError:
            have = False
        except OSError as e:
            if e.errno not in _NO_NOWAIT:
                raise
            return False, False  # a file system that cannot be asked without waiting (tmpfs): read as cached
        return not have, have

    def _open_direct(self, path: str, st, direct: list) -> bool:
        """Open ``path`` again with O_DIRECT into ``direct``, if it is still the file ``st``
        describes; an unsupported filesystem turns direct reads off for this store."""
        try:
            dfd = os.open(path, _READ_FLAGS | _O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL:  # e.g. tmpfs
                self.direct_io = False
            return False
        same = os.fstat(dfd)
        if (same.st_dev, same.st_ino) != (st.st_dev, st.st_ino):  # replaced meanwhile: read the one checked
            os.close(dfd)
            return False
        direct.append(dfd)
        return True

    # -- files --------------------------------------------------------------------------------------
    def _mkdir(self, path) -> None:
        """``path`` as a directory of this store's mode (an existing one is left as it is)."""
        try:
            os.mkdir(path, self._dir_mode)
        except FileExistsError:
            if os.path.isdir(path) and not os.path.islink(path):
                return
            raise
        # exactly: the umask may have taken bits the mode wants. NOTE: only then, since a
        # chmod is a journaled metadata write (as costly here as the mkdir itself)
        if stat.S_IMODE(os.lstat(path).st_mode) != self._dir_mode:
            os.chmod(path, self._dir_mode)

    def _write(self, stem: str, name: str, layout: FileLayout, head, parts: list) -> None:
        """Write ``parts`` (``(offset, buffers)`` each) and then the header (into ``head``)
        to a new file, renamed to ``<stem>.<name>`` once whole. Each chunk of a part is hashed just
        before it is written, so the kernel's copy reads it from the CPU's cache; the
        zeros between parts are holes of the file. With ``direct_writes``, a file whose
        parts are aligned and follow the header is hashed first and written with O_DIRECT
        in one call."""
        shard, tmp = stem.rsplit("/", 1)[0], _tmp_path(stem, name)
        direct = (self.direct_writes and _follow(parts, layout.header_len)
                  and all(_aligned(bufs, offset) for offset, bufs in parts))
        fd = self._create(shard, tmp, direct)
        try:
            try:
                if stat.S_IMODE(os.fstat(fd).st_mode) != self._file_mode:  # the umask took bits
                    os.fchmod(fd, self._file_mode)
                pageio.preallocate(fd, layout.total)  # one extent: a cold read is one disk request
                if direct:  # hashed first, then the whole file in one call: the disk wants large requests
                    # (aligned parts follow the header and each other with no zeros between)
                    head[:] = np.frombuffer(layout.header([_checksum(bufs) for _, bufs in parts]), dtype=np.uint8)
                    pageio.io_all(os.pwritev, fd, [head, *(b for _, bufs in parts for b in bufs)], 0)
                else:
                    sums = pageio.move(fd, parts, write=True, chunk=pageio.WRITE_CHUNK)
                    head[:] = np.frombuffer(layout.header(sums), dtype=np.uint8)
                    pageio.io_all(os.pwritev, fd, [head], 0)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, f"{stem}.{name}")
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        if self.capacity_bytes is not None:
            self._account(stem, name, layout.total)

    def _create(self, shard: str, tmp: str, direct: bool) -> int:
        """A new file ``tmp`` open for writing (with O_DIRECT when ``direct``; a filesystem
        that refuses it turns direct writes off for this store)."""
        made = False
        while True:
            try:
                return os.open(tmp, _WRITE_FLAGS | (_O_DIRECT if direct else 0), self._file_mode)
            except FileNotFoundError:  # the shard's first object: make its directory
                if made:
                    raise
                self._mkdir(shard)
                made = True
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                self.direct_writes = direct = False

    @staticmethod
    def _is_object(path) -> bool:
        try:
            return stat.S_ISREG(os.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _has_any(self, keys, leading: bool) -> list[bool]:
        """Per key, whether any file of it is there: asked under each name the store's
        registry holds (``file_names``), else found in a listing of its shard (a store
        written before the registry; each shard listed once a batch). With ``leading``,
        up to the first missing key only."""
        names = file_names.registered(self._root_name)
        listed: dict[str, dict] = {}
        out = []
        for key in keys:
            stem = self._stem(key)
            if names is not None:
                out.append(any(self._is_object(f"{stem}.{name}") for name in names))
            else:
                shard, tail = stem.rsplit("/", 1)
                if shard not in listed:
                    listed[shard] = self._listed(shard)
                out.append(tail in listed[shard])
            if leading and not out[-1]:
                break
        return out

    def _remove_keys(self, keys) -> None:
        # NOTE: out of the LRU before the files go, as an eviction does: a writer of the key
        # between the two then counts its new file in again (before, its entry was popped
        # after that, and its file stayed on disk uncounted, never evicted)
        for key in keys:
            with self._lock:
                self._total -= sum(self._lru.pop(self._stem(key), {}).values())
            for path in self._key_files(key):
                self._unlink(path)

    def _remove_all(self) -> None:
        """Every file and directory under the root goes but the shard directories, which
        are emptied: made again by the next puts, 256 of them (each a metadata write) cost
        the first 512 puts after a clear a fifth of their time."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            entries = []
        for entry in entries:
            if _SHARD_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                with os.scandir(entry.path) as inside:
                    for item in inside:
                        self._unlink(item.path)
            else:
                self._unlink(entry.path)
        self._mkdir(self.root)
        with self._lock:
            self._lru.clear()
            self._total = 0

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except IsADirectoryError:  # not one of ours, but at one of our names: gone with the key
            shutil.rmtree(path, ignore_errors=True)
        except OSError as e:
            self._fault("remove", e)

    # -- capacity ------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Seed the LRU order from the files found, each key as recent as its newest file."""
        keys: dict[str, list] = {}  # stem -> [newest mtime, {name: bytes}]
        with os.scandir(self.root) as shards:
            for shard in shards:
                if _SHARD_NAME.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False):
                    for e, st in self._shard_files(shard.path):
                        tail, _, name = e.name.partition(".")
                        seen = keys.setdefault(f"{shard.path}/{tail}", [st.st_mtime, {}])
                        seen[0] = max(seen[0], st.st_mtime)
                        seen[1][name] = st.st_size
        for stem, (_, files) in sorted(keys.items(), key=lambda kv: kv[1][0]):
            self._lru[stem] = files
            self._total += sum(files.values())
        self._evict()

    @staticmethod
    def _shard_files(shard: str) -> Iterator[tuple[os.DirEntry, os.stat_result]]:
        """``(entry, stat)`` of each object file in directory ``shard`` (temporary files,
        which start with a dot, left out).

        NOTE: another engine sharing the directory may remove a file, or the shard, between
        its listing and its stat: what is gone by then is left out."""
        try:
            with os.scandir(shard) as entries:
                for e in entries:
                    try:
                        if e.name.startswith(".") or not e.is_file(follow_symlinks=False):
                            continue
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    yield e, st
        except (FileNotFoundError, NotADirectoryError):
            return

    def _account(self, stem: str, name: str, nbytes: int) -> None:
        with self._lock:
            files = self._lru.pop(stem, {})
            self._total += nbytes - files.get(name, 0)  # a file written again replaced the old one
            files[name] = nbytes
            self._lru[stem] = files
        self._evict(keep=stem)

    def _touch(self, stem: str, read: list) -> None:
        """Mark the key at ``stem`` used: last in the LRU order, and its files ``read``
        (``(field, parts)`` each) touched, whose mtimes order it at the next open."""
        with self._lock:
            if stem in self._lru:
                self._lru.move_to_end(stem)
        for field, _ in read:
            try:
                # not followed: a link put at the name since the read is not ours to touch
                os.utime(f"{stem}.{self._file_name(field)}", follow_symlinks=False)
            except OSError:
                pass

    def _evict(self, keep: str | None = None) -> None:
        """Drop least recently used keys (never ``keep``) until the total fits the capacity."""
        while True:
            with self._lock:
                victim = next((stem for stem in self._lru if stem != keep), None)
                if self._total <= self.capacity_bytes or victim is None:
                    return
                files = self._lru.pop(victim)
                self._total -= sum(files.values())
            for name in files:
                self._unlink(f"{victim}.{name}")
            self._stats.add(evictions=1)

    def usage_bytes(self) -> int:
        """Bytes held, as tracked for the capacity (0 when no capacity is set)."""
        with self._lock:
            return self._total


@functools.lru_cache(maxsize=64)
def _holders(plan: PagePlan) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Per part ``plan`` reads: the fields of the files a writer of its geometry can write
    that hold it, whole-page writers first (see ``FileStorage._cover``)."""
    fields = [field for field, _ in writer_files(plan)]
    held = {field: {part for part, _ in field_parts(plan, field.rsplit("/", 1)[1]) or ()} for field in fields}
    return tuple((part_name(p), tuple(f for f in fields if part_name(p) in held[f])) for p in plan.read_parts)
