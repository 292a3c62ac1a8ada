"""The host tier's memory: one file per worker rank that the worker and the scheduler both map.

vLLM runs its scheduler (the offloading manager) and its workers in separate
processes by default, and passes between them only the load/store specs of the jobs
it schedules and their completions. kvtier's page table lives with the scheduler;
the pages themselves must be where both sides reach them. The worker copies vLLM's
blocks in and out of them; the scheduler's I/O threads copy them to and from storage,
because a block read from storage must be verified before the manager may answer
HIT (vLLM asserts that every load it starts succeeds), and only the side holding the
page table can then make it readable. (vLLM's own tiering spec shares its CPU tier
between the two the same way.)

So each worker rank creates ``<dir>/kvtier-<engine>-r<rank>.pool`` (``dir`` is
``/dev/shm``: memory, not disk) holding a header and its host pool, and the scheduler
maps the same files. A hybrid model's KV cache groups each have their own pool and
file: ``-r<rank>-g<position>.pool`` for groups after the first. One layout per file::

    [0, HEADER_BYTES)   b"KVTIERPOOL" + u32 version + u32 length + JSON (what the pool holds)
    [HEADER_BYTES, ..)  each component's buffer in the pool's layout order, page-aligned

The scheduler unlinks a file once it has mapped it (the mapping stays valid), so the
memory goes when the last process holding it exits, however it exits; a worker that
dies before the scheduler attached leaves a file that the next creator sweeps away.
Nothing in a file is trusted: regular files of this user only, sizes checked against
the header and the header against what the attaching side expects.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..._checks import is_int
from ...errors import RegionError, UsageError
from ...layout import get_layout
from ...pools import HostKVPool
from ...pools.common import layout_shapes
from .blocks import BlockFormat, format_from_json, format_to_json

MAGIC = b"KVTIERPOOL"
VERSION = 1
HEADER_BYTES = 1 << 16
_ALIGN = 1 << 21  # buffers start on 2 MiB: huge-page and cache-line friendly
_HEAD = struct.Struct(f"<{len(MAGIC)}sII")
DEFAULT_DIR = "/dev/shm"
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14


def _safe_name(engine_id: str) -> str:
    """``engine_id`` as a file-name part that cannot leave the directory."""
    if re.fullmatch(r"[A-Za-z0-9_.-]{1,80}", engine_id) and not engine_id.startswith("."):
        return engine_id
    import hashlib

    return "h" + hashlib.sha256(engine_id.encode()).hexdigest()[:32]


def region_path(directory: str | os.PathLike, engine_id: str, rank: int, group: int = 0) -> Path:
    suffix = f"-g{group}" if group else ""
    return Path(directory) / f"kvtier-{_safe_name(engine_id)}-r{rank}{suffix}.pool"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class RegionInfo:
    """What a pool file holds (its header)."""

    engine_id: str
    rank: int
    world_size: int
    pid: int
    format: BlockFormat
    layout: str
    num_pages: int
    group: int = 0  # position of the KV cache group among the engine's groups

    def buffers(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """``(component, offset, shape)`` of each component's buffer in the file, the
        shape in the layout's axis order (as a host pool allocates it)."""
        spec = self.format.spec
        shapes = layout_shapes(spec, get_layout(self.layout), self.num_pages, self.format.page_size)
        out, offset = [], HEADER_BYTES
        for c in spec.components:
            out.append((c.name, offset, shapes[c.name]))
            offset = _round_up(offset + math.prod(shapes[c.name]) * spec.element_size, _ALIGN)
        return out

    @property
    def file_bytes(self) -> int:
        name, offset, shape = self.buffers()[-1]
        return offset + math.prod(shape) * self.format.spec.element_size

    def to_json(self) -> bytes:
        return json.dumps({"engine_id": self.engine_id, "rank": self.rank, "world_size": self.world_size,
                           "pid": self.pid, "format": format_to_json(self.format), "layout": self.layout,
                           "num_pages": self.num_pages, "group": self.group}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "RegionInfo":
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise UsageError("header is not an object")
        fields = {"engine_id": str, "rank": int, "world_size": int, "pid": int, "layout": str, "num_pages": int}
        for name, kind in fields.items():
            value = d.get(name)
            if not (is_int(value) if kind is int else isinstance(value, kind)):
                raise UsageError(f"header field {name!r} is {value!r}")
        if d["num_pages"] <= 0 or not 0 <= d["rank"] < d["world_size"]:
            raise UsageError(f"header has {d['num_pages']} pages, rank {d['rank']} of {d['world_size']}")
        group = d.get("group", 0)
        if not is_int(group) or group < 0:
            raise UsageError(f"header field 'group' is {group!r}")
        get_layout(d["layout"])
        return cls(d["engine_id"], d["rank"], d["world_size"], d["pid"], format_from_json(d["format"]),
                   d["layout"], d["num_pages"], group)


class Region:
    """A mapped pool file and the :class:`~kvtier.pools.HostKVPool` over its memory.

    ``create`` (the worker) makes the file and its header; ``attach`` (the scheduler)
    maps an existing one. Both see the same bytes: a page the worker stores is what
    the scheduler writes to storage."""

    def __init__(self, path: Path, info: RegionInfo, mm: mmap.mmap, owner: bool) -> None:
        self.path, self.info, self._mmap, self.owner = path, info, mm, owner
        _populate(mm)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        fmt = info.format
        buffers = {}
        for name, offset, shape in info.buffers():
            nbytes = math.prod(shape) * fmt.spec.element_size
            buffers[name] = base[offset:offset + nbytes].view(fmt.spec.dtype).view(shape)
        self.pool = HostKVPool.from_buffers(fmt.spec, buffers, fmt.page_size, layout=info.layout)

    # -- the worker's side ------------------------------------------------------------------
    @classmethod
    def create(cls, directory: str | os.PathLike, info: RegionInfo) -> "Region":
        """Create the pool file of ``info`` (mode 0600) and map it. ``RegionError`` when a
        live process already holds that name or the directory lacks the space."""
        directory = Path(directory)
        if not directory.is_dir():
            raise RegionError(f"kvtier: host_dir {directory} is not a directory; give host_dir, a directory on a "
                              "memory file system (tmpfs) that the engine core's process can read too")
        path = region_path(directory, info.engine_id, info.rank, info.group)
        sweep_stale(directory)
        need = info.file_bytes
        free = _free_bytes(directory)
        if free is not None and need > free:
            raise RegionError(f"kvtier: the host tier needs {need} bytes in {directory} for rank {info.rank}, "
                              f"which has {free} free; lower host_bytes or enlarge {directory} "
                              "(docker: --shm-size)")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileExistsError:
            raise RegionError(f"kvtier: {path} exists and belongs to a live engine; give each engine its own "
                              "kv_transfer_config engine_id") from None
        try:
            os.ftruncate(fd, need)
            mm = mmap.mmap(fd, need, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        raw = info.to_json()
        if _HEAD.size + len(raw) > HEADER_BYTES:
            mm.close()
            path.unlink(missing_ok=True)
            raise RegionError(f"kvtier: pool header of {len(raw)} bytes exceeds {HEADER_BYTES}")
        mm[_HEAD.size:_HEAD.size + len(raw)] = raw
        # NOTE: the magic goes last, so a reader never sees a complete-looking header
        # over bytes still being written.
        mm[:_HEAD.size] = _HEAD.pack(MAGIC, VERSION, len(raw))
        return cls(path, info, mm, owner=True)

    # -- the scheduler's side -----------------------------------------------------------------
    @classmethod
    def attach(cls, directory: str | os.PathLike, engine_id: str, rank: int, group: int = 0) -> "Region | None":
        """Map rank ``rank``'s pool file of ``engine_id`` (of its group ``group``); ``None``
        if it does not exist (yet). ``RegionError`` for a file that is not a pool kvtier
        wrote for this engine."""
        path = region_path(directory, engine_id, rank, group)
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RegionError(f"kvtier: cannot open {path}: {e}") from e
        try:
            info = _read_header(fd, path)
            if info is None:
                return None
            if (info.engine_id, info.rank, info.group) != (engine_id, rank, group):
                raise RegionError(f"kvtier: {path} holds rank {info.rank} (group {info.group}) of engine "
                                  f"{info.engine_id!r}")
            mm = mmap.mmap(fd, info.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, info, mm, owner=False)

    def span(self) -> tuple[int, int]:
        """``(address, bytes)`` of this mapping's pool buffers (header excluded)."""
        first = min(b.data_ptr() for b in self.pool.buffers.values())
        last = max(b.data_ptr() + b.numel() * b.element_size() for b in self.pool.buffers.values())
        return first, last - first

    def unlink(self) -> None:
        """Remove the file (the mapping stays valid for whoever holds it)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Drop this process's mapping once nothing views it (torch tensors over it may
        outlive this object; the memory is freed when the last view goes)."""
        if self.owner:
            self.unlink()


def _populate(mm: mmap.mmap) -> None:
    """Map every page of ``mm`` now (allocating it in the file when new), keeping its
    bytes: at start, not in the first requests' copies.

    NOTE: first touches cost more than the copies they are part of (a storage read into
    fresh pages is several times slower than into mapped ones: the storage rows of
    scripts/vllm_ttft.py show it), and each process's mapping faults on its own."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):  # an older kernel: touch a byte of each page, unchanged
        import numpy as np

        view = np.frombuffer(mm, dtype=np.uint8)
        view[::mmap.PAGESIZE] |= 0
        del view


def _read_header(fd: int, path: Path) -> RegionInfo | None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise RegionError(f"kvtier: {path} is not a regular file of this user")
    if st.st_size < HEADER_BYTES:
        return None  # still being created
    head = os.pread(fd, _HEAD.size, 0)
    magic, version, length = _HEAD.unpack(head)
    if magic != MAGIC:
        return None if magic == b"\0" * len(MAGIC) else _bad(path, "no kvtier pool magic")
    if version != VERSION or length > HEADER_BYTES - _HEAD.size:
        _bad(path, f"version {version}, header of {length} bytes")
    try:
        info = RegionInfo.from_json(os.pread(fd, length, _HEAD.size))
    except (ValueError, TypeError, KeyError) as e:
        _bad(path, f"unreadable header ({e})")
    if st.st_size != info.file_bytes:
        _bad(path, f"{st.st_size} bytes, its header says {info.file_bytes}")
    return info


def _bad(path: Path, why: str):
    raise RegionError(f"kvtier: {path} is not a valid host pool file: {why}")


def _free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: Path) -> list[Path]:
    """Remove pool files of this user whose creating process is gone (a worker that
    died before its scheduler attached); returns what was removed."""
    gone = []
    try:
        candidates = list(directory.glob("kvtier-*.pool"))
    except OSError:
        return gone
    for path in candidates:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            info = _read_header(fd, path)
        except RegionError:
            continue
        finally:
            os.close(fd)
        if info is not None and not _alive(info.pid):
            path.unlink(missing_ok=True)
            gone.append(path)
    return gone


__all__ = ["DEFAULT_DIR", "Region", "RegionError", "RegionInfo", "region_path", "sweep_stale"]
