"""``kvtier bench overlap``: how much of a host -> device load hides behind compute.

An engine that reuses a prompt's host hit calls ``HierarchicalCache.load_back`` and runs
layer ``i`` once ``handle.wait_layer(i)`` returns, while later layers are still copying.
The compute stand-in for one layer is its prefill attention as two matmuls over
``(head, token, dim)``: ``(q @ k^T) @ v`` for the whole prompt, softmax left out.

Each repetition times three things: the load alone (``load_back`` + ``wait``), the
compute alone (every layer) and the engine loop (per layer: ``wait_layer(i)``, then
layer ``i``'s compute). ``hidden = (load + compute - both) / min(load, compute)``: 1 when
the shorter of the two hides entirely behind the longer, 0 when they run one after the
other, below 0 when running both at once slows each down (on a CPU the copy thread and
the matmuls share cores and memory bandwidth).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..cache import HierarchicalCache
from .._checks import positive_ints
from ..errors import IntegrityError, UsageError
from ..pools import DeviceKVPool, HostKVPool
from ..pools.common import check_device
from ..spec import KVSpec

DTYPE = torch.bfloat16
#: Prompt lengths when none are given, per device type: attention grows as tokens^2 and the
#: copy as tokens, so compute outlasts the copy on a GPU only for long prompts; a CPU would
#: take minutes on those.
DEFAULT_TOKENS = {"cpu": (512, 1024), "cuda": (4096, 16384)}


@dataclass(frozen=True)
class OverlapRow:
    tokens: int
    stat: str          # "median" or "best" of the repetitions, taken per phase
    load_ms: float     # load_back + wait, every layer of every page
    compute_ms: float  # the stand-in attention of every layer
    both_ms: float     # the engine loop: wait_layer(i), then layer i's compute
    hidden: float      # (load + compute - both) / min(load, compute)
    load_gbps: float
    load_shorter: bool  # the target (>= 0.8 hidden) is for this case


def hidden_fraction(load_s: float, compute_s: float, both_s: float) -> float:
    """Share of the shorter phase that ran while the longer one did."""
    return (load_s + compute_s - both_s) / min(load_s, compute_s)


def check_tokens(tokens, page_size: int) -> None:
    """Every prompt length is whole pages; ``ValueError`` naming the first that is not."""
    for t in tokens:
        if t % page_size:
            raise UsageError(f"--tokens {t} is not a multiple of --page-size {page_size}")


def memory_bytes(*, layers: int, heads: int, head_dim: int, query_heads: int, tokens) -> tuple[int, int]:
    """``(host, device)`` bytes at the peak: a host and a device pool of the longest prompt,
    and on the device the stand-in's q, k, v, scores and output."""
    longest = max(tokens)
    pool = longest * KVSpec.mha(layers, heads, head_dim).bytes_per_token
    item = torch.finfo(DTYPE).bits // 8
    compute = (4 * query_heads * longest * head_dim + query_heads * longest * longest) * item
    return pool, pool + compute


class _Attention:
    """One layer's prefill attention as matmuls, into preallocated outputs.
    Shapes: q, k, v and out ``(head, token, dim)``; scores ``(head, token, token)``."""

    def __init__(self, query_heads: int, tokens: int, head_dim: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(query_heads, tokens, head_dim, generator=gen) / head_dim ** 0.5 for _ in range(3))
        self.q, self.k_t, self.v = q.to(device, DTYPE), k.to(device, DTYPE).transpose(1, 2), v.to(device, DTYPE)
        self.scores = torch.empty(query_heads, tokens, tokens, dtype=DTYPE, device=device)
        self.out = torch.empty_like(self.q)

    def __call__(self) -> None:
        torch.bmm(self.q, self.k_t, out=self.scores)
        torch.bmm(self.scores, self.v, out=self.out)

    @staticmethod
    def flops(query_heads: int, tokens: int, head_dim: int) -> int:
        return 4 * query_heads * tokens * tokens * head_dim


class _Bench:
    """A cache whose whole prompt sits on the host, ready to be loaded again and again."""

    def __init__(self, spec: KVSpec, tokens: int, page_size: int, device: torch.device, layout: str,
                 io_backend: str) -> None:
        dev = DeviceKVPool(spec, tokens, page_size, device=device)
        host = HostKVPool(spec, tokens, page_size, layout=layout)  # pinned where CUDA is available
        dev.raw.fill_(1)  # fault both pools in before anything is timed
        host.raw.fill_(0)
        self.cache = HierarchicalCache(dev, host, io_backend=io_backend)
        self.prompt = list(range(tokens))
        self.layers, self.cuda = spec.layer_num, device.type == "cuda"
        self.device = device
        self.cache.insert(self.prompt, self.cache.alloc_device(tokens))
        self.cache.flush()  # write_through: the host copies land

    def _host_hit(self):
        """Demote the prompt to the host and lock its match: ``(match, lease)``."""
        self.cache.evict_device(len(self.prompt))
        match = self.cache.match_prefix(self.prompt)
        if match.host_len != len(self.prompt):
            raise IntegrityError(f"after evict_device the host hit is {match.host_len} of {len(self.prompt)} tokens")
        return match, self.cache.lock(match)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def load(self, compute=None) -> float:
        """Seconds of a load of the whole prompt; with ``compute``, of the engine loop."""
        match, lease = self._host_hit()
        try:
            self._sync()
            t = time.perf_counter()
            handle = self.cache.load_back(match)
            for layer in range(self.layers):
                handle.wait_layer(layer)
                if compute is not None:
                    compute()
            self._sync()
            seconds = time.perf_counter() - t
            if handle.error is not None:
                raise RuntimeError(f"load_back failed: {handle.error}")
            return seconds
        finally:
            self.cache.unlock(lease)

    def compute(self, attention: _Attention) -> float:
        self._sync()
        t = time.perf_counter()
        for _ in range(self.layers):
            attention()
        self._sync()
        return time.perf_counter() - t

    def close(self) -> None:
        self.cache.close()


def bench_tokens(spec: KVSpec, *, tokens: int, page_size: int, query_heads: int, device: torch.device, layout: str,
                 io_backend: str, repeat: int) -> list[OverlapRow]:
    """A median and a best row for a prompt of ``tokens``; the three phases take turns in
    every repetition, after one untimed round, so drift in the machine touches each alike."""
    bench = _Bench(spec, tokens, page_size, device, layout, io_backend)
    attention = _Attention(query_heads, tokens, spec.components[0].head_dim, device)
    try:
        times = {"load": [], "compute": [], "both": []}
        for i in range(repeat + 1):
            got = {"load": bench.load(), "compute": bench.compute(attention), "both": bench.load(attention)}
            if i:
                for phase, seconds in got.items():
                    times[phase].append(seconds)
    finally:
        bench.close()
    nbytes = tokens * spec.bytes_per_token
    rows = []
    for stat, pick in (("median", statistics.median), ("best", min)):
        load, compute, both = (pick(times[p]) for p in ("load", "compute", "both"))
        rows.append(OverlapRow(tokens, stat, load * 1e3, compute * 1e3, both * 1e3,
                               hidden_fraction(load, compute, both), nbytes / load / 1e9, load < compute))
    return rows


def run(*, layers: int = 32, heads: int = 8, head_dim: int = 128, query_heads: int | None = None,
        tokens=None, page_size: int = 64, device: str = "cpu", layout: str = "page_first",
        io_backend: str = "direct", repeat: int = 3) -> dict:
    """The whole benchmark as a JSON-ready dict: rows per prompt length in ``tokens``
    (each a multiple of ``page_size``; default :data:`DEFAULT_TOKENS` for the device)."""
    dev = check_device(device)
    tokens = DEFAULT_TOKENS[dev.type] if tokens is None else tuple(tokens)
    query_heads = heads if query_heads is None else query_heads
    positive_ints(("layers", layers), ("heads", heads), ("head_dim", head_dim), ("query_heads", query_heads),
                  ("page_size", page_size), ("repeat", repeat), *(("tokens", t) for t in tokens))
    check_tokens(tokens, page_size)
    spec = KVSpec.mha(layers, heads, head_dim)
    started = time.time()
    rows = []
    for t in tokens:
        rows += bench_tokens(spec, tokens=t, page_size=page_size, query_heads=query_heads, device=dev,
                             layout=layout, io_backend=io_backend, repeat=repeat)
    return {
        "config": {"spec": spec.fingerprint(), "layers": layers, "heads": heads, "head_dim": head_dim,
                   "query_heads": query_heads, "tokens": list(tokens), "page_size": page_size, "layout": layout,
                   "io_backend": io_backend, "repeat": repeat, "device": str(dev),
                   "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                   "torch_threads": torch.get_num_threads(),
                   "load_bytes": {t: t * spec.bytes_per_token for t in tokens},
                   "compute_flops_per_layer": {t: _Attention.flops(query_heads, t, head_dim) for t in tokens}},
        "rows": [asdict(r) for r in rows],
        "seconds": round(time.time() - started, 1),
    }
