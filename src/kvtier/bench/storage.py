"""``kvtier bench storage``: put/get GB/s of each backend against its raw client.

For 64-token pages of the reference spec, kvtier's ``batch_set``/``batch_get``
move pages between a host pool and the backend; the raw client moves the same
number of objects of the same payload sizes from/to one contiguous, written buffer:
plain files (one per page, ``os.writev``/``os.readv`` on as many threads as kvtier's
``io_threads``), redis-py pipelined ``SET``/``GET``, Mooncake
``batch_put_from``/``batch_get_into``. Each kvtier figure is reported as
a ratio to the raw figure measured in the same run, their rounds alternated (a
machine whose speed drifts slows both alike): the best rounds' ratio, and the
median rounds' (on a VM, buffered writes of one client can swing severalfold
from round to round while another's hold steady: the best round then shows the
first at its luckiest). Objects are removed between
repetitions (untimed), so every put writes, and for files every dirty page is then
written back (``sync``, untimed), so that no put waits on the last one's writeback.
Files are also read cold: each file's pages are dropped from the page cache before
each repetition (``posix_fadvise``), so the read comes from the disk (kvtier then
reads with O_DIRECT, the raw client buffered, as a plain ``read`` does).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

import numpy as np
import torch

from .. import storage
from .._checks import positive_ints
from ..errors import UsageError
from ..pools import DeviceKVPool, HostKVPool
from ..pools.indices import page_slots
from ..spec import KVSpec
from ..storage.cold_reads import check_mode
from ..storage.objects import PagePlan
from .servers import MooncakeMaster, RedisServer, ServerUnavailable
from .storage_peers import VllmFsTier, vllm_fs_io


@dataclass(frozen=True)
class StorageRow:
    backend: str
    op: str            # "put" or "get"
    objects: int
    gbytes: float
    kvtier_gbps: float  # the best round's
    raw_gbps: float
    ratio: float
    kvtier_median_gbps: float  # the median round's
    raw_median_gbps: float
    median_ratio: float


def _alternated(clients: dict, repeat: int) -> dict[str, list[float]]:
    """Each client's seconds for ``fn`` in each timed round (after ``prepare``, untimed):
    ``clients`` maps a name to ``(fn, prepare)``. The rounds alternate between the
    clients, so a machine whose speed drifts during the run (a shared disk, a busy
    neighbour) slows each of them alike, rather than whichever ran last."""
    times = {name: [] for name in clients}
    for round_ in range(repeat + 1):  # the first round warms up
        for name, (fn, prepare) in clients.items():
            prepare()
            t = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - t)
    return times


class _RawFile:
    """One file per object, written and read whole, the objects split between ``threads``."""

    def __init__(self, root: Path, sizes: list[int], threads: int) -> None:
        self.root, self.sizes, self.threads = root, sizes, threads
        self.buf = np.ones(sum(sizes), dtype=np.uint8)
        offsets = np.cumsum([0, *sizes]).tolist()
        self.views = [memoryview(self.buf)[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)

    def _each(self, fn) -> None:
        share = -(-len(self.sizes) // self.threads)
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(lambda t: [fn(i) for i in range(t * share, min(len(self.sizes), (t + 1) * share))],
                          range(self.threads)))

    def _put_one(self, i: int) -> None:
        fd = os.open(f"{self.root}/{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _whole(os.writev(fd, [self.views[i]]), self.sizes[i], f"write of {self.root}/{i}")
        finally:
            os.close(fd)

    def _get_one(self, i: int) -> None:
        fd = os.open(f"{self.root}/{i}", os.O_RDONLY)
        try:
            _whole(os.readv(fd, [self.views[i]]), self.sizes[i], f"read of {self.root}/{i}")
        finally:
            os.close(fd)

    def put(self) -> None:
        self._each(self._put_one)

    def get(self) -> None:
        self._each(self._get_one)


def _whole(done: int, size: int, what: str) -> None:
    """A raw baseline I/O moved all ``size`` bytes; ``OSError`` otherwise (a benchmark that
    timed less than the work would report a false figure)."""
    if done != size:
        raise OSError(f"raw {what}: {done} of {size} bytes")


class _RawRedis:
    def __init__(self, url: str, sizes: list[int]) -> None:
        import redis

        self.client, self.sizes = redis.Redis.from_url(url), sizes
        self.buf = np.ones(sum(sizes), dtype=np.uint8)

    def clear(self) -> None:
        self.client.flushdb()

    def put(self) -> None:
        pipe, view, off = self.client.pipeline(transaction=False), memoryview(self.buf), 0
        for i, n in enumerate(self.sizes):
            pipe.set(f"raw:{i}", view[off:off + n])
            off += n
        pipe.execute()

    def get(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i in range(len(self.sizes)):
            pipe.get(f"raw:{i}")
        missing = sum(value is None for value in pipe.execute())
        if missing:
            raise OSError(f"raw redis get: {missing} of {len(self.sizes)} objects missing")

    def close(self) -> None:
        self.client.close()


class _RawMooncake:
    def __init__(self, mc_store, sizes: list[int]) -> None:
        self.store, self.sizes = mc_store, sizes
        self.buf = torch.ones(sum(sizes), dtype=torch.uint8)
        rc = self.store.register_buffer(self.buf.data_ptr(), self.buf.numel())
        if rc != 0:
            raise OSError(f"raw mooncake register_buffer of {self.buf.numel()} bytes: code {rc}")
        self.keys = [f"raw/{i}" for i in range(len(sizes))]
        self.ptrs = list(self.buf.data_ptr() + np.cumsum([0] + sizes[:-1]))

    def clear(self) -> None:
        self.store.remove_by_regex("^raw/", True)

    def put(self) -> None:
        rcs = self.store.batch_put_from(self.keys, self.ptrs, self.sizes)
        if any(rc != 0 for rc in rcs):
            raise OSError(f"raw mooncake batch_put_from codes {sorted(set(rcs))}")

    def get(self) -> None:
        rcs = self.store.batch_get_into(self.keys, self.ptrs, self.sizes)
        if any(rc <= 0 for rc in rcs):
            raise OSError(f"raw mooncake batch_get_into codes {sorted(set(rcs))}")


def evict_cached(root: Path) -> int:
    """Drop the page cache's copy of every file under ``root`` (written back first; no
    root rights needed, unlike ``drop_caches``); returns how many files. A page just used
    may stay cached a moment (pages in per-CPU batches are not dropped)."""
    files = [p for p in Path(root).rglob("*") if p.is_file()]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def _measure(name, store, raw, host, idx, keys, payload, objects, repeat, peers=()) -> list[StorageRow]:
    """kvtier against ``raw`` and (files) against each of ``peers`` (``(name, client)``),
    every op's rounds alternated between them (see :func:`_alternated`)."""
    others = {"raw": raw, **dict(peers)}
    # files: the dirty pages of the last round (and of the files just removed) written back
    # before each put, untimed, so that no put waits on another's writeback
    settled = _synced if name == "file" else (lambda clear: clear)
    ops = {"put": (lambda: store.batch_set(keys, host, idx), settled(store.clear),
                   lambda c: (c.put, settled(c.clear))),
           # the objects the last put round left
           "get": (lambda: store.batch_get(keys, host, idx), _nothing, lambda c: (c.get, _nothing))}
    if name == "file":  # and out of the page cache, as after a restart or under memory pressure
        ops["cold get"] = (ops["get"][0], lambda: evict_cached(store.root),
                           lambda c: (c.get, lambda: evict_cached(c.root)))
    rows = []
    for op, (ours, prepare, theirs) in ops.items():
        times = _alternated({"kvtier": (ours, prepare), **{n: theirs(c) for n, c in others.items()}}, repeat)
        mine = times.pop("kvtier")
        rows += [StorageRow(name if other == "raw" else f"{name} vs {other}", op, objects, payload / 1e9,
                            payload / min(mine) / 1e9, payload / min(t) / 1e9, min(t) / min(mine),
                            payload / median(mine) / 1e9, payload / median(t) / 1e9, median(t) / median(mine))
                 for other, t in times.items()]
    order = [name, *(f"{name} vs {other}" for other in others if other != "raw")]
    rows.sort(key=lambda r: order.index(r.backend))  # against the raw client first, then each peer (stable)
    stats = store.stats()
    if stats["errors"] or stats["misses"]:  # a fault is a miss: the figures would time less than the work
        raise OSError(f"{name}: storage errors during the benchmark: {stats}")
    for client in (store, *others.values()):
        client.clear()
    return rows


def write_mode_advice(result: dict) -> str | None:
    """A line for an operator where this run's O_DIRECT puts (vLLM's fs tier's) beat
    kvtier's buffered ones: on such a machine buffered writes are the slow ones (a page
    cache that takes new memory slowly, a disk whose writeback stalls), and
    ``direct_writes`` writes with O_DIRECT too. None elsewhere, and for a run that
    already wrote with it."""
    if result["config"]["direct_writes"]:
        return None
    puts = {r["backend"]: r for r in result["rows"] if r["op"] == "put"}
    direct = puts.get("file vs vllm fs o_direct")
    if direct is None or direct["raw_median_gbps"] <= direct["kvtier_median_gbps"]:
        return None
    return (f"O_DIRECT puts (vLLM's fs tier) ran at {direct['raw_median_gbps']:.2f} GB/s here, kvtier's buffered "
            f"ones at {direct['kvtier_median_gbps']:.2f} (median rounds): buffered writes are the slow ones on this "
            "machine. A file store opened with direct_writes=true (--direct-writes here) writes with O_DIRECT too; "
            "warm gets then read from disk.")


def _nothing() -> None:
    pass


def _synced(clear):
    """``clear``, then every dirty page written back (``sync``)."""
    def prepare() -> None:
        clear()
        os.sync()
    return prepare


def _file_peers(workdir: Path, pages: int, page_bytes: int, threads: int, skipped: dict) -> list:
    """vLLM's fs tier, buffered and O_DIRECT, where vLLM is installed (else noted in ``skipped``)."""
    io = vllm_fs_io()
    if io is None:
        skipped["vllm fs"] = "vLLM (0.32 or later) is not installed in this environment"
        return []
    peers = [("vllm fs buffered", VllmFsTier(io, workdir / "vllm-fs", pages, page_bytes, threads, o_direct=False))]
    root = workdir / "vllm-fs-o_direct"  # its own: the rounds of both alternate
    if VllmFsTier.available(io, root):
        peers.append(("vllm fs o_direct", VllmFsTier(io, root, pages, page_bytes, threads, o_direct=True)))
    else:
        skipped["vllm fs o_direct"] = f"O_DIRECT does not work in {root}"
    return peers


BACKENDS = ("file", "redis", "mooncake")
_MOONCAKE_SEGMENT_EXTRA = 64 << 20


def memory_bytes(*, layers: int = 32, heads: int = 8, head_dim: int = 128, v_head_dim: int | None = None,
                 page_size: int = 64, pages: int = 32, backends=BACKENDS) -> int:
    """Host memory :func:`run` takes at its peak: a device and a host pool, the raw client's
    buffer and kvtier's staging (each about the payload), the file peers' buffers (two,
    where vLLM is installed), and Mooncake's segment."""
    pool = pages * page_size * KVSpec.mha(layers, heads, head_dim, v_head_dim).bytes_per_token
    mooncake = 4 * pool + _MOONCAKE_SEGMENT_EXTRA if "mooncake" in backends else 0
    peers = 2 * pool if "file" in backends else 0
    return 4 * pool + max(mooncake, peers)


def run(*, layers: int = 32, heads: int = 8, head_dim: int = 128, v_head_dim: int | None = None,
        page_size: int = 64, pages: int = 32, layout: str = "page_head", backends=BACKENDS,
        directory: str | None = None, repeat: int = 3, io_threads: int = 2, direct_writes: bool = False,
        cold_reads: str = "auto") -> dict:
    """``cold_reads``: the file store's option (``kvtier.storage.cold_reads``): ``auto``
    learns from its first cold batches, which the cold get's rounds then include;
    ``staged`` or ``in_place`` times one way of reading alone."""
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise UsageError(f"backends {list(backends)!r}: choose from {', '.join(BACKENDS)}")
    positive_ints(("repeat", repeat), ("io_threads", io_threads))
    check_mode(cold_reads)  # before the pools are made and the first page is written
    spec = KVSpec.mha(layers, heads, head_dim, v_head_dim)
    size = pages * page_size
    dev = DeviceKVPool(spec, size, page_size)
    dev.raw.fill_(1)
    host = HostKVPool(spec, size, page_size, layout=layout, pin_memory=False)
    idx = page_slots(torch.randperm(pages, generator=torch.Generator().manual_seed(0)), page_size)
    host.backup_from_device_all_layer(dev, idx, torch.arange(size))
    keys = storage.page_keys(list(range(size)), page_size, namespace="bench")
    plan = PagePlan(spec, page_size)
    sizes = [p.nbytes for _ in range(pages) for p in plan.write_parts]  # one object per part
    page_sizes = [sum(p.nbytes for p in plan.write_parts)] * pages  # files: one object per page
    payload = sum(sizes)
    rows, skipped = [], {}
    workdir = Path(directory or tempfile.mkdtemp(prefix="kvtier-bench-"))
    try:
        for name in backends:
            with contextlib.ExitStack() as stack:
                try:
                    if name == "file":
                        store = storage.open(f"file://{workdir / 'kvtier'}", io_threads=io_threads,
                                             direct_writes=direct_writes, cold_reads=cold_reads)
                        raw = _RawFile(workdir / "raw", page_sizes, io_threads)
                    elif name == "redis":
                        server = stack.enter_context(RedisServer())
                        store = storage.open(server.url, io_threads=io_threads)
                        raw = _RawRedis(server.url, sizes)
                        stack.callback(raw.close)
                    else:
                        master = stack.enter_context(MooncakeMaster())
                        segment = 4 * payload + _MOONCAKE_SEGMENT_EXTRA
                        store = storage.open(f"{master.url}&global_segment_size={segment}")
                        client = store.client()
                        if client is None:  # the master went away after it started
                            store.close()
                            raise ServerUnavailable(f"mooncake_master at {master.url} cannot be reached")
                        raw = _RawMooncake(client, sizes)
                    stack.callback(store.close)
                except ServerUnavailable as e:
                    skipped[name] = str(e)
                    continue
                objects = pages if name == "file" else len(sizes)
                # NOTE: no name holds the raw client or the peers past their backend: their
                # buffers are gone before the next backend's (memory_bytes counts one set)
                rows += _measure(name, store, raw, host, idx, keys, payload, objects, repeat,
                                 _file_peers(workdir, pages, page_sizes[0], io_threads, skipped)
                                 if name == "file" else ())
                del raw
    finally:
        if directory is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return {
        "config": {"spec": spec.fingerprint(), "page_size": page_size, "pages": pages, "layout": layout,
                   "objects_per_page": {"file": 1, "redis": len(plan.write_parts),
                                        "mooncake": len(plan.write_parts)}, "repeat": repeat, "io_threads": io_threads,
                   "direct_writes": direct_writes, "cold_reads": cold_reads,
                   "dir": str(workdir),
                   "filesystem_note": "puts go through the page cache, no fsync (a sync before each, "
                                      "untimed); cold gets read what posix_fadvise dropped from it"},
        "rows": [asdict(r) for r in rows],
        "skipped": skipped,
    }
