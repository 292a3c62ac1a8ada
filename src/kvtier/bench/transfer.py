"""``kvtier bench transfer``: device <-> host page copies per layout and io backend.

Backup copies every layer of ``pages`` pages in one call; load copies the same
pages one layer per call, for every layer. Page order is randomly permuted on
both sides, so no two pages coalesce. Each GB/s figure is reported as a ratio to
the limit: the fastest contiguous copy of the same number of bytes seen in the same
process (:func:`~kvtier.bench.timing.limit_copies`: torch's ``copy_`` and kvtier's
compiled copy, between the same two pools and between a fresh written pair), timed in
the same rounds as the rows (:func:`time_layout`). Every buffer is written before it is
timed (never-written memory reads as the shared zero page, nearly free).

A hybrid spec's copies (one pool per layer group, one resume point) are in
:mod:`kvtier.bench.transfer_hybrid`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from .._checks import positive_ints
from ..cache.mover import layer_runs
from ..layout import LAYOUTS
from ..pools import DeviceKVPool, HostKVPool
from ..pools.common import check_device
from ..pools.hybrid import HybridHostPool
from ..pools.indices import page_slots
from ..spec import DTYPE_NAMES, KVSpec
from ..transfer import native
from .timing import alternated, best_seconds, limit_copies


@dataclass(frozen=True)
class TransferRow:
    spec: str
    page_size: int
    layout: str
    io_backend: str
    direction: str  # "backup" (device->host, all layers), "load" (host->device, a layer a call) or
    # "load runs" (host->device, the cache's runs of layers: kvtier.cache.mover.layer_runs)
    gbytes: float
    gbps: float
    memcpy_gbps: float  # the limit: the fastest contiguous copy of the bytes this run saw (time_layout)
    ratio: float  # gbps / memcpy_gbps


@dataclass(frozen=True)
class MetaRow:
    layout: str
    kind: str  # "page" or "split_heads/<factor>"
    pages: int
    spans: int
    ms: float


def _permuted_slots(pages: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    return page_slots(torch.randperm(pages, generator=gen), page_size)


#: The copies every row times, in order (:func:`copies`' tuple)
DIRECTIONS = ("backup", "load", "load runs")


def copies(host, dev, host_idx, dev_idx, layers: int, backend: str):
    """``(backup, load, load runs)`` between a host and a device pool (plain or hybrid):
    every layer of the pages device -> host in one call; host -> device one layer per
    call, ``layers`` calls; host -> device in the runs of layers the cache's loads copy
    off a CUDA stream (``mover.layer_runs``: layer 0 alone, then longer runs; a hybrid
    pool's weighed by each layer's bytes, as the cache's), a call a run."""
    def backup():
        host.backup_from_device_all_layer(dev, host_idx, dev_idx, backend)

    def load():
        for layer in range(layers):
            host.load_to_device_per_layer(dev, host_idx, dev_idx, layer, backend)

    weights = host.layer_bytes(host_idx) if isinstance(host, HybridHostPool) else None

    def load_runs():
        for run in layer_runs(layers, weights=weights):
            host.load_to_device_layers(dev, host_idx, dev_idx, run, backend)

    return backup, load, load_runs


#: Untimed runs of each row's copy before its rounds: every copy plan has then finished
#: trying its loop orders (``native.Blocks``), so a row times the order a server keeps
ROW_WARMUP = 1 + native.TRIALS * native.MAX_ORDERS


Parts = list[tuple[int, list]]  # per part of a copy: its bytes, and timing.limit_copies of them


def time_layout(limits: dict[str, Parts], rows: dict, repeat: int, cuda: bool) -> tuple[dict, dict]:
    """One layout's rows and its limits, timed in the same rounds (:func:`alternated`), the
    limit's copies also in rounds of their own before and after them: ``(limit GB/s per
    direction, best seconds per row key)``.

    ``limits[direction]`` lists the parts of the copy a row makes (one for a plain spec,
    one per layer group for a hybrid one): each part's bytes, moved at the best GB/s of
    its candidate copies. A direction's limit moves every part, one after the other."""
    candidates = [(d, i, n, fn) for d, parts in limits.items() for i, (_, copies) in enumerate(parts)
                  for n, fn in copies]
    limit_fns = [fn for *_, fn in candidates]
    before = alternated(limit_fns, repeat, 1, cuda)
    best = alternated(limit_fns + list(rows.values()), repeat, [0] * len(candidates) + [ROW_WARMUP] * len(rows), cuda)
    # NOTE: the limit's copies also run on their own before the rows' rounds and after them,
    # the fastest of all kept: a VM's fast spells can be shorter than a round, and a limit
    # that missed them all would make rows look faster than a plain copy (a 2-core AMD EPYC
    # VM, 2026-12-07: backups at 1.44-1.73x of a limit timed in the rounds alone)
    after = alternated(limit_fns, repeat, 0, cuda)
    rate: dict[tuple[str, int], float] = {}
    for (d, i, n, _), *seconds in zip(candidates, before, best, after):
        rate[d, i] = max(rate.get((d, i), 0.0), n / min(seconds) / 1e9)
    gbps = {d: sum(n for n, _ in parts) / sum(n / rate[d, i] for i, (n, _) in enumerate(parts))
            for d, parts in limits.items()}
    gbps["load runs"] = gbps["load"]  # the same bytes the same way
    return gbps, dict(zip(rows, best[len(candidates):]))


def bench_spec(spec: KVSpec, *, page_size: int, pages: int, layouts, backends, repeat: int,
               seed: int, device: str = "cpu") -> tuple[list[TransferRow], dict[str, float]]:
    """Transfer rows for one spec, and the best memcpy GB/s per direction seen meanwhile
    (backup = device -> host, load = host -> device).

    Each row's limit is a memcpy between the same two pools (each layout has its own
    host pool) or a fresh pair: on a VM, one allocation can copy at almost twice the
    speed of another (different backing of the same guest memory). The limit's copies
    and the rows are timed in the same rounds (:func:`time_layout`)."""
    gen = torch.Generator().manual_seed(seed)
    size = pages * page_size
    dev = DeviceKVPool(spec, size, page_size, device=device)
    dev.raw.fill_(1)  # fault the device pages in before anything is timed
    nbytes = size * spec.bytes_per_token
    host_idx, dev_idx = _permuted_slots(pages, page_size, gen), _permuted_slots(pages, page_size, gen)
    dev_idx = dev_idx.to(dev.index_device)
    cuda = dev.device.type == "cuda"
    timed, limit = [], dict.fromkeys(DIRECTIONS, 0.0)
    for layout in layouts:
        host = HostKVPool(spec, size, page_size, layout=layout, pin_memory=cuda)
        host.raw.fill_(0)
        limits = {"backup": [(nbytes, limit_copies(host.raw, dev.raw, nbytes))],
                  "load": [(nbytes, limit_copies(dev.raw, host.raw, nbytes))]}
        rows = {(backend, d): fn for backend in backends
                for d, fn in zip(DIRECTIONS, copies(host, dev, host_idx, dev_idx, spec.layer_num, backend))}
        own, times = time_layout(limits, rows, repeat, cuda)
        limit = {d: max(limit[d], own[d]) for d in limit}
        timed += [(layout, backend, d, t, own[d]) for (backend, d), t in times.items()]
        # NOTE: the copies and the limit's buffers close over ``host``: dropped here, they
        # free the layout's pool before the next one is allocated
        del host, limits, rows
    fp = spec.fingerprint()
    rows = [TransferRow(fp, page_size, lay, be, direction, nbytes / 1e9, nbytes / t / 1e9, memcpy,
                        nbytes / t / 1e9 / memcpy)
            for lay, be, direction, t, memcpy in timed]
    return rows, limit


def bench_meta(spec: KVSpec, *, page_size: int, pages: int, repeat: int, seed: int) -> list[MetaRow]:
    """Time span metadata for ``pages`` random pages. The pool lives on the ``meta``
    device: addresses start at 0 but the arithmetic is the real one, with no memory."""
    gen = torch.Generator().manual_seed(seed)
    idx = _permuted_slots(pages, page_size, gen)
    rows = []
    for name in LAYOUTS:
        host = HostKVPool(spec, pages * page_size, page_size, layout=name, device="meta")
        calls = [("page", lambda: host.get_page_buffer_meta(idx))]
        if host.supports_split_heads:  # factors 2 and the fewest heads, where they split every component's heads
            for f in (2, min(c.head_num for c in spec.components)):
                if f < 2 or any(c.head_num % f for c in spec.components):
                    continue
                calls.append((f"split_heads/{f}", lambda f=f: host.get_split_heads_page_buffer_meta(idx, f)))
        for kind, fn in calls:
            spans = len(fn()[0])
            rows.append(MetaRow(name, kind, pages, spans, best_seconds(fn, repeat) * 1e3))
    return rows


DIMS = ((128, 128), (192, 128))


def mha_specs(layers: int = 32, heads: int = 8, dims=DIMS) -> tuple[KVSpec, ...]:
    """The default geometries: one bf16 MHA spec per ``(K, V)`` head dims."""
    return tuple(KVSpec.mha(layers, heads, k, v) for k, v in dims)


def memory_bytes(*, layers: int = 32, heads: int = 8, dims=DIMS, page_sizes=(64,), pages: int = 256,
                 meta_pages: int = 4096) -> tuple[int, int]:
    """``(host, device)`` bytes :func:`run` takes at its peak."""
    return uniform_memory_bytes(mha_specs(layers, heads, dims), page_sizes=page_sizes, pages=pages,
                                meta_pages=meta_pages)


def uniform_memory_bytes(specs, *, page_sizes=(64,), pages: int = 256, meta_pages: int = 4096) -> tuple[int, int]:
    """``(host, device)`` bytes :func:`run_uniform` takes at its peak: one device and one
    host pool of the largest spec, and the span metadata's indices and Python lists."""
    pool = max(pages * max(page_sizes) // ps * ps * spec.bytes_per_token for ps in page_sizes for spec in specs)
    last = specs[-1]  # (ptr, size) per layer and component
    meta = meta_pages * (4 * 8 * page_sizes[0] + 2 * len(last.components) * last.layer_num * 64)
    return pool + meta, pool


def run_fields(specs, *, repeat: int, device: str) -> dict:
    """The config fields every run reports about how it ran: repeats, threads, dtype(s),
    device, CPU copy path and its streaming stores' bytes."""
    return {"repeat": repeat, "torch_threads": torch.get_num_threads(),
            "dtype": ",".join(sorted({DTYPE_NAMES[s.dtype] for s in specs})), "device": device,
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "copy_path": native.path_name(), "store_bytes": native.store_bytes()}


def run(*, layers: int = 32, heads: int = 8, dims=DIMS, page_sizes=(64,), pages: int = 256,
        layouts=tuple(LAYOUTS), backends=("direct", "kernel"), repeat: int = 3, meta_pages: int = 4096,
        seed: int = 0, device: str = "cpu") -> dict:
    """The whole benchmark over :func:`mha_specs` as a JSON-ready dict (see :func:`run_uniform`)."""
    return run_uniform(mha_specs(layers, heads, dims), {"layers": layers, "heads": heads,
                                                        "dims": [list(d) for d in dims]},
                       page_sizes=page_sizes, pages=pages, layouts=layouts, backends=backends, repeat=repeat,
                       meta_pages=meta_pages, seed=seed, device=device)


def run_uniform(specs, geometry: dict, *, page_sizes=(64,), pages: int = 256, layouts=tuple(LAYOUTS),
                backends=("direct", "kernel"), repeat: int = 3, meta_pages: int = 4096, seed: int = 0,
                device: str = "cpu") -> dict:
    """The benchmark over each of ``specs`` (plain ``KVSpec``s) as a JSON-ready dict whose
    config starts with ``geometry``. ``pages`` is for the largest page size; smaller pages
    keep the same bytes (more pages). Span metadata is timed for the last spec."""
    check_device(device)
    positive_ints(("pages", pages), ("repeat", repeat), ("meta_pages", meta_pages),
                  *(("page_size", p) for p in page_sizes))
    started = time.time()
    rows, limits = [], {}
    for page_size in page_sizes:
        n_pages = pages * max(page_sizes) // page_size
        for spec in specs:
            spec_rows, limit = bench_spec(spec, page_size=page_size, pages=n_pages, layouts=layouts,
                                          backends=backends, repeat=repeat, seed=seed, device=device)
            limits[f"{spec.fingerprint()}/p{page_size}"] = limit
            rows += spec_rows
    meta = bench_meta(specs[-1], page_size=page_sizes[0], pages=meta_pages, repeat=max(repeat, 5), seed=seed)
    return {
        "config": {**geometry, "page_sizes": list(page_sizes), "pages": pages,
                   **run_fields(specs, repeat=repeat, device=device)},
        "memcpy_gbps": limits,
        "transfer": [asdict(r) for r in rows],
        "meta": [asdict(r) for r in meta],
        "seconds": round(time.time() - started, 1),
    }
