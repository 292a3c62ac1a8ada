"""``kvtier bench transfer --spec HYBRID``: what a hybrid-aware cache moves for one resume point.

Each layer group has its own device and host pool (:mod:`kvtier.pools.hybrid`). For a
prefix of ``tokens`` tokens, a full group moves every page of it and a sliding group
only the pages of its window before the resume point (docs/hybrid.md), each group's pages
in random order on both sides. Backup copies every group in one call; load copies one
model layer per call, across groups, for every layer; ``load runs`` copies the runs of
layers the cache's own loads take off a CUDA stream. Each GB/s figure is a ratio to a
memcpy of each group's bytes between that group's two pools, same direction, same run.

The bench checks itself: the bytes its copies wrote, counted in the pools, must equal
``HybridSpec.bytes_for(tokens, 1)``; and it sets them beside what a window-blind cache
(every sliding page too) would move.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from .._checks import positive_int, positive_ints
from ..errors import UsageError
from ..hybrid import HybridSpec, layer_ranges
from ..layout import LAYOUTS
from ..pools.common import check_device
from ..pools.hybrid import HybridDevicePool, HybridHostPool
from ..pools.indices import page_slots
from .timing import limit_copies
from .transfer import DIRECTIONS, TransferRow, copies, run_fields, time_layout


@dataclass(frozen=True)
class ResumeBytes:
    """Bytes of one resume point after ``tokens`` tokens, by the spec's own arithmetic: a
    hybrid-aware cache's (``HybridSpec.bytes_for(tokens, 1)``) against a window-blind
    cache's (``uniform_bytes_per_token * tokens``: every sliding page too)."""

    tokens: int
    full_bytes_per_token: int  # the full groups', for every cached token
    window_bytes: int  # the sliding groups' windows, per resume point
    hybrid_bytes: int
    hybrid_bytes_per_token: float
    window_blind_bytes: int
    window_blind_bytes_per_token: int
    window_blind_ratio: float  # window_blind_bytes / hybrid_bytes

    @classmethod
    def of(cls, spec: HybridSpec, tokens: int) -> "ResumeBytes":
        hybrid, blind = spec.bytes_for(tokens, 1), spec.uniform_bytes_per_token * tokens
        return cls(tokens, spec.full_bytes_per_token, spec.window_bytes, hybrid, hybrid / tokens, blind,
                   spec.uniform_bytes_per_token, blind / hybrid)


def resume_pages(spec: HybridSpec, tokens: int, page_size: int) -> dict[str, range]:
    """Per group, the prefix pages a request resuming after ``tokens`` tokens needs: every
    page for a full group, the pages of the window before ``tokens`` for a sliding one."""
    return {g.name: g.attention.needed_pages(tokens, page_size) for g in spec.groups}


def check_hybrid(spec: HybridSpec, *, page_sizes, pages: int) -> int:
    """The prefix :func:`run_hybrid` resumes after: ``pages`` pages of the largest page size,
    in tokens. Every page size must cut the prefix and each sliding window into whole
    pages: otherwise whole pages move more of a window than ``bytes_for`` counts, and the
    bench's check of its own bytes would fail. ``ValueError`` says what to use instead."""
    positive_ints(("pages", pages), *(("page_size", p) for p in page_sizes))
    tokens = pages * max(page_sizes)
    for ps in page_sizes:
        if tokens % ps:
            raise UsageError(f"page size {ps}: the prefix of {tokens:,} tokens ({pages} x {max(page_sizes)}) "
                             f"is not a whole number of {ps}-token pages; use page sizes dividing {max(page_sizes)}")
        for g in spec.groups:
            window = g.attention.window
            if window is not None and window % ps:
                raise UsageError(f"page size {ps} does not divide the {window}-token window of group {g.name!r}: "
                                 f"whole pages would move {-(-window // ps) * ps} of its tokens per resume point, not "
                                 f"the {window} HybridSpec.bytes_for counts; use a page size dividing {window}")
    return tokens


def hybrid_memory_bytes(spec: HybridSpec, *, page_sizes=(64,), pages: int = 256) -> tuple[int, int]:
    """``(host, device)`` bytes :func:`run_hybrid` takes at its peak: every group's device
    pool and one layout's host pools, each holding the prefix's tokens."""
    pool = pages * max(page_sizes) * spec.uniform_bytes_per_token
    return pool, pool


def _prefix_slots(pool_pages: int, pages: range, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Token slots of prefix pages ``pages``, prefix page ``i`` sitting at pool page ``perm[i]``
    of a random permutation of the pool's pages."""
    return page_slots(torch.randperm(pool_pages, generator=gen)[pages.start:pages.stop], page_size)


def _limit_parts(host: HybridHostPool, dev: HybridDevicePool, nbytes: dict[str, int]) -> dict:
    """Per direction, each group's ``nbytes[group]`` and the copies of them between that
    group's two pools (:func:`limit_copies`): the limit moves each group's bytes at its
    best copy's GB/s, one group after the other (``transfer.time_layout``)."""
    def parts(to_host: bool) -> list:
        return [(n, limit_copies(*((host[g].raw, dev[g].raw) if to_host else (dev[g].raw, host[g].raw)), n))
                for g, n in nbytes.items()]

    return {"backup": parts(True), "load": parts(False)}


def _nonzero(pools) -> int:
    return sum(int(pool.raw.count_nonzero()) for _, pool in pools)


def _copied_bytes(dev: HybridDevicePool, host: HybridHostPool, fns, cuda: bool) -> dict[str, int]:
    """The bytes one run of each of ``fns`` (:func:`copies`: a backup, then the loads)
    wrote, counted in the pools themselves.

    NOTE: needs the device pools all ones (bytes 0x01) and the host pools all zeros: the
    backup's writes are then the host's nonzero bytes; the device is zeroed before each
    load, which reads the backed-up pages, so its writes are the device's nonzero bytes."""
    backup, *loads = fns
    backup()
    if cuda:
        torch.cuda.synchronize()
    written = {DIRECTIONS[0]: _nonzero(host)}
    for direction, fn in zip(DIRECTIONS[1:], loads):
        for _, pool in dev:
            pool.raw.zero_()
        fn()
        if cuda:
            torch.cuda.synchronize()
        written[direction] = _nonzero(dev)
    return written


def bench_hybrid(spec: HybridSpec, *, tokens: int, page_size: int, layouts, backends, repeat: int, seed: int,
                 device: str = "cpu") -> tuple[list[TransferRow], dict[str, float], dict[str, int]]:
    """Rows of one resume point after ``tokens`` tokens, the best memcpy GB/s per direction,
    and the bytes one backup, one load and one load in runs wrote (counted once, in the
    first layout).

    Every group's pools hold the prefix's tokens, each group's prefix pages at random pool
    pages on both sides; only :func:`resume_pages` move. Backup copies every group in one
    call; load copies one model layer per call, every layer; ``load runs`` copies the runs
    of layers the cache's loads take off a CUDA stream (a copy per group in each run). A
    row's limit is a memcpy of each group's bytes between that group's two pools, timed
    in the rows' rounds."""
    gen = torch.Generator().manual_seed(seed)
    dev = HybridDevicePool(spec, tokens, page_size, device=device)
    for _, pool in dev:
        pool.raw.fill_(1)  # every byte written before anything is timed (first touches fault pages in)
    moved = resume_pages(spec, tokens, page_size)
    host_idx = {n: _prefix_slots(tokens // page_size, p, page_size, gen) for n, p in moved.items()}
    dev_idx = {n: _prefix_slots(tokens // page_size, p, page_size, gen).to(dev[n].index_device)
               for n, p in moved.items()}
    nbytes = {n: len(p) * page_size * spec.group(n).bytes_per_token for n, p in moved.items()}
    total = sum(nbytes.values())
    cuda = dev[spec.names[0]].device.type == "cuda"
    timed, limit, copied = [], dict.fromkeys(DIRECTIONS, 0.0), None
    for layout in layouts:
        host = HybridHostPool(spec, tokens, page_size, layout=layout, pin_memory=cuda)
        for _, pool in host:
            pool.raw.fill_(0)
        if copied is None:  # before the memcpys below write into the pools
            copied = _copied_bytes(dev, host, copies(host, dev, host_idx, dev_idx, spec.layer_num, backends[0]), cuda)
        rows = {(backend, d): fn for backend in backends
                for d, fn in zip(DIRECTIONS, copies(host, dev, host_idx, dev_idx, spec.layer_num, backend))}
        own, times = time_layout(_limit_parts(host, dev, nbytes), rows, repeat, cuda)
        limit = {d: max(limit[d], own[d]) for d in limit}
        timed += [(layout, backend, d, t, own[d]) for (backend, d), t in times.items()]
        del host, rows  # free this layout's pools before the next ones are allocated
    fp = spec.fingerprint()
    rows = [TransferRow(fp, page_size, lay, be, d, total / 1e9, total / t / 1e9, memcpy, total / t / 1e9 / memcpy)
            for lay, be, d, t, memcpy in timed]
    return rows, limit, copied


def run_hybrid(spec: HybridSpec, *, page_sizes=(64,), pages: int = 256, layouts=tuple(LAYOUTS),
               backends=("direct", "kernel"), repeat: int = 3, seed: int = 0, device: str = "cpu") -> dict:
    """:func:`bench_hybrid` per page size as a JSON-ready dict, resuming after
    :func:`check_hybrid`'s prefix. ``bytes`` holds :class:`ResumeBytes`, the bytes each page
    size's copies wrote (``copied``) and whether each equals ``HybridSpec.bytes_for``
    (``copied_equal``: the bench's check of itself)."""
    check_device(device)
    positive_int("repeat", repeat)
    tokens = check_hybrid(spec, page_sizes=page_sizes, pages=pages)
    started = time.time()
    rows, limits, copied, moved = [], {}, {}, {}
    for page_size in page_sizes:
        key = f"p{page_size}"
        ps_rows, limits[key], copied[key] = bench_hybrid(spec, tokens=tokens, page_size=page_size, layouts=layouts,
                                                         backends=backends, repeat=repeat, seed=seed, device=device)
        moved[key] = {n: len(p) for n, p in resume_pages(spec, tokens, page_size).items()}
        rows += ps_rows
    resume = ResumeBytes.of(spec, tokens)
    groups = [{"name": g.name, "attention": g.attention.kind, "window": g.attention.window,
               "layers": layer_ranges(g.layers), "spec": g.spec.fingerprint(), "bytes_per_token": g.bytes_per_token}
              for g in spec.groups]
    return {
        "config": {"spec": spec.fingerprint(), "groups": groups, "page_sizes": list(page_sizes), "pages": pages,
                   "prefix_tokens": tokens, "resume_points": 1,
                   **run_fields([g.spec for g in spec.groups], repeat=repeat, device=device)},
        "pages_moved": moved,
        "memcpy_gbps": limits,
        "transfer": [asdict(r) for r in rows],
        "bytes": {**asdict(resume), "copied": copied,
                  "copied_equal": all(n == resume.hybrid_bytes for c in copied.values() for n in c.values())},
        "seconds": round(time.time() - started, 1),
    }
