"""``kvtier bench meta``: span metadata of ``pages`` random pages, p50 and p90 of
``repeat`` calls, each against a floor timed right beside it (same repetition).

Floors: the least any implementation does: read every index slot once (``max()``
over them; validation must look at each), then build the result from ready values:
for a list form, ``.tolist()`` of as many pointer-sized int64s as spans (the Python
ints the list must hold); for an array form, a copy of a ready ``(2, spans)`` int64
array (writing the two result arrays). With ``load``, that many CPU-bound processes (a Python busy loop
each) run during the timing, as other work on a serving machine would.
"""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from .._checks import int_at_least
from ..layout import LAYOUTS
from ..pools import HostKVPool
from ..pools.indices import page_slots
from ..spec import KVSpec

FLOORS = {"list": "max() over the index slots + .tolist() of as many ready int64s as spans",
          "array": "max() over the index slots + a copy of a ready (2, spans) int64 array"}
SPLIT_FACTORS = (2, 4, 8)
_BUSY_LOOP = "import sys; sys.stdout.write('r'); sys.stdout.flush()\nwhile True: pass"


@dataclass(frozen=True)
class MetaRow:
    spec: str
    layout: str
    kind: str  # "page" or "split_heads/<factor>"
    form: str  # "list" (ptr_list, size_list) or "array" (two int64 numpy arrays)
    pages: int
    spans: int
    p50_ms: float
    p90_ms: float
    floor_p50_ms: float
    floor_p90_ms: float  # a high floor p90 too: the machine, not the call, was slow
    ratio: float  # p50_ms / floor_p50_ms


def sample(fn: Callable[[], object], floor: Callable[[], object], repeat: int) -> tuple[np.ndarray, np.ndarray]:
    """``(fn ms, floor ms)``, ``(repeat,)`` each, alternating the two so both see the
    same machine. A result is freed after its timer stops, as a caller keeping it would."""
    fn(), floor()  # warm up: first touches, lazily built tables
    times = np.empty((2, repeat))
    for i in range(repeat):
        for j, f in enumerate((fn, floor)):
            t = time.perf_counter()
            result = f()
            times[j, i] = time.perf_counter() - t
            del result
    return times[0] * 1e3, times[1] * 1e3


def floors(idx: torch.Tensor, spans: int) -> dict[str, Callable[[], object]]:
    """The floor of each form for ``idx`` and ``spans`` spans (see the module docstring)."""
    slots = idx.numpy()
    values = np.arange(spans, dtype=np.int64) + (1 << 46)  # as wide as a user-space pointer
    both = np.stack([values, values])
    return {"list": lambda: (slots.max(), values.tolist()), "array": lambda: (slots.max(), both.copy())}


def calls(host: HostKVPool, idx: torch.Tensor, heads: int) -> dict[tuple[str, str], Callable[[], object]]:
    """``(kind, form) -> call`` for every metadata call ``host`` supports."""
    out = {("page", "list"): lambda: host.get_page_buffer_meta(idx),
           ("page", "array"): lambda: host.get_page_buffer_meta_array(idx)}
    if host.supports_split_heads:
        for f in (f for f in SPLIT_FACTORS if heads % f == 0):
            out[(f"split_heads/{f}", "list")] = lambda f=f: host.get_split_heads_page_buffer_meta(idx, f)
            out[(f"split_heads/{f}", "array")] = lambda f=f: host.get_split_heads_page_buffer_meta_array(idx, f)
    return out


@contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """``processes`` busy-looping Python processes, running (each has said so) until exit."""
    procs = []
    try:
        for _ in range(processes):
            procs.append(subprocess.Popen([sys.executable, "-c", _BUSY_LOOP], stdout=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL))
        for p in procs:
            p.stdout.read(1)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
            p.stdout.close()


@contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """torch's intra-op thread count set to ``threads`` (``None``: left as it is), restored after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def bench_spec(spec: KVSpec, *, page_size: int, pages: int, layouts, repeat: int, seed: int) -> list[MetaRow]:
    """Rows for one spec. Pools live on the ``meta`` device: no memory, real arithmetic
    (addresses start at 0, still as wide as pointers for any sizeable pool)."""
    idx = page_slots(torch.randperm(pages, generator=torch.Generator().manual_seed(seed)), page_size)
    rows = []
    for layout in layouts:
        host = HostKVPool(spec, pages * page_size, page_size, layout=layout, device="meta")
        for (kind, form), fn in calls(host, idx, spec.components[0].head_num).items():
            spans = len(fn()[0])
            ms, floor_ms = sample(fn, floors(idx, spans)[form], repeat)
            p50, floor_p50 = float(np.median(ms)), float(np.median(floor_ms))
            rows.append(MetaRow(spec.fingerprint(), layout, kind, form, pages, spans, p50, float(np.percentile(ms, 90)),
                                floor_p50, float(np.percentile(floor_ms, 90)), p50 / floor_p50))
    return rows


def memory_bytes(*, pages: int, page_size: int, layers: int, heads: int, dims=((192, 128),)) -> int:
    """Host bytes :func:`run` takes at its peak: the index tensor and its checks (a few
    int64s per slot), and per span of the largest call (``layer_first``: a span per
    layer and component) its Python int, list slots, arrays and floors (~128 bytes)."""
    spans = pages * max(layers * 2, SPLIT_FACTORS[-1] * 2)
    return pages * page_size * 8 * 4 + spans * 128


def check_config(*, pages: int, page_size: int, repeat: int, load: int, threads: int | None) -> None:
    """``ValueError`` naming the first bad argument."""
    for name, value, least in (("pages", pages, 1), ("page_size", page_size, 1), ("repeat", repeat, 1),
                               ("load", load, 0), ("threads", 1 if threads is None else threads, 1)):
        int_at_least(name, value, least)


def run(*, layers: int = 32, heads: int = 8, dims=((192, 128),), page_size: int = 64, pages: int = 4096,
        layouts=tuple(LAYOUTS), repeat: int = 50, load: int = 0, threads: int | None = None, seed: int = 0) -> dict:
    """The whole benchmark as a JSON-ready dict."""
    check_config(pages=pages, page_size=page_size, repeat=repeat, load=load, threads=threads)
    started = time.time()
    rows = []
    with torch_threads(threads) as used, cpu_load(load):
        for k_dim, v_dim in dims:
            rows += bench_spec(KVSpec.mha(layers, heads, k_dim, v_dim), page_size=page_size, pages=pages,
                               layouts=layouts, repeat=repeat, seed=seed)
    return {
        "config": {"layers": layers, "heads": heads, "dims": [list(d) for d in dims], "page_size": page_size,
                   "pages": pages, "repeat": repeat, "load": load, "torch_threads": used, "floors": FLOORS},
        "rows": [asdict(r) for r in rows],
        "seconds": round(time.time() - started, 1),
    }
