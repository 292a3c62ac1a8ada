"""``kvtier bench cache``: the cache's metadata work for 8K-token prompts over a tree of
10^5 (or more) pages.

The tree holds prompts that share a system prefix (a quarter of the prompt) and then
diverge, as chat traffic does. Timed, per page size:

- ``match_prefix`` of a cached prompt (full hit), given as a list, an ``array('q')``,
  a numpy array and a tensor; of a new prompt (the hit ends after the shared prefix);
- a full hit whose path crosses one node per page (``prompt_tokens / page_size``
  nodes: a fragmented tree where every page of the prompt has a diverging sibling);
- ``insert`` of new prompts one by one (fresh ones, not in the CPU's caches), given as
  lists and as ``array('q')``, with Python's garbage collector on, as a server runs:
  p50, p99 and the worst call, and the collections that ran meanwhile.

Each time is also given as a ratio to a floor measured in the same run (its rounds
alternated with the matches'): copying the prompt's token list (``list(tokens)``),
the least any call that takes the prompt does.
The tree's memory per cached page is ``HierarchicalCache.memory_bytes()`` (nodes, keys,
device page arrays, LRU entries and the device-page ownership map; not the KV pools).
Inserts are also timed into a full pool, each prompt's slots from ``alloc_device``
(which evicts first).

A tail is only the insert's where the machine's own is shorter: after each insert the
same loop times a fixed computation of about an insert's length (``NOISE_US``, pure
Python, calibrated in the run), whose p99 is the machine's for that much work (a
shared VM stops a thread for tens of µs hundreds of times a second).
"""

from __future__ import annotations

import gc
import sys
import time
from array import array

try:
    import resource
except ImportError:  # not on Windows: page faults are not counted there
    resource = None

import numpy as np
import torch

from ..cache import HierarchicalCache
from .._checks import positive_ints
from ..errors import UsageError
from ..pools import DeviceKVPool, HostKVPool
from ..spec import KVSpec

#: Host bytes per cached token at the peak (id in the tree, the pool's allocator, prompts
#: held to build the tree): measured at about 16 (1.0 GB for 10^6 pages of 64), with room.
_BYTES_PER_TOKEN = 40
_INSERTS = 200  # timed inserts per input type
#: The computation timed between inserts, µs: about an 8K-token insert's p50 here
NOISE_US = 50
_spin_units: list[int] = []  # calibrated once per process (see _spin)


def _spin() -> None:
    """A computation of about ``NOISE_US`` (summing a range: no memory beyond the CPU's
    caches, no allocation that grows)."""
    if not _spin_units:
        trial = 10_000
        times = []
        for _ in range(21):
            t = time.perf_counter()
            sum(range(trial))
            times.append(time.perf_counter() - t)
        _spin_units.append(max(1, round(trial * NOISE_US * 1e-6 / sorted(times)[10])))
    sum(range(_spin_units[0]))


def per_call_us(fn, calls: int) -> float:
    """Fastest mean over 5 rounds of ``calls`` calls, after one untimed call."""
    return per_call_us_each({"fn": fn}, calls)["fn"]


def per_call_us_each(fns: dict, calls: int) -> dict:
    """:func:`per_call_us` of each of ``fns`` (name -> function), their rounds alternated
    (:func:`round_times`)."""
    for fn in fns.values():
        fn()
    return {name: min(ts) * 1e6 for name, ts in round_times(fns, 5, calls).items()}


def round_times(fns: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    """Seconds a call of each of ``fns`` (name -> function) took in each of ``rounds``
    rounds of ``calls`` calls back to back, the functions alternated in each round:
    figures that are compared (a ratio, a floor) then see the same machine, even when
    its speed drifts during the run."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls)
    return times


def check_config(page_sizes, prompt_tokens: int, tree_pages: int) -> None:
    """``ValueError`` unless every prompt is whole pages of every page size, at least 2 tokens long."""
    if not page_sizes:
        raise UsageError("give at least one page size")
    positive_ints(("prompt_tokens", prompt_tokens), ("tree_pages", tree_pages), *(("page_size", p) for p in page_sizes))
    bad = [p for p in page_sizes if prompt_tokens % p]
    if prompt_tokens < 2 or bad:
        raise UsageError(f"prompt_tokens {prompt_tokens} must be at least 2 and a multiple of every page size "
                         f"({', '.join(map(str, page_sizes))})")


def memory_bytes(page_sizes, prompt_tokens: int, tree_pages: int) -> int:
    """Host bytes :func:`run` takes at its peak (the page sizes run one after another)."""
    return max(tree_pages * p + (3 * _INSERTS + 8) * prompt_tokens for p in page_sizes) * _BYTES_PER_TOKEN


class Prompts:
    """Seeded 8K-token prompts that start with one shared system prefix."""

    def __init__(self, prompt_tokens: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n = prompt_tokens
        self.system = self.rng.integers(0, 1 << 30, prompt_tokens // 4, dtype=np.int64)

    def array(self) -> array:
        tail = self.rng.integers(0, 1 << 30, self.n - self.system.size, dtype=np.int64)
        return array("q", np.concatenate((self.system, tail)).tobytes())

    def random(self, n: int) -> array:
        return array("q", self.rng.integers(0, 1 << 30, n, dtype=np.int64).tobytes())


def _fragment(cache: HierarchicalCache, prompts: Prompts, page_size: int) -> array:
    """Cache a new prompt so that its path crosses one node per page: after it, prompts
    that share its first ``i`` pages and then differ are inserted, for every ``i``."""
    target = prompts.random(prompts.n)
    cache.insert(target, cache.alloc_device(prompts.n))
    for i in range(1, prompts.n // page_size):
        branch = target[:i * page_size] + prompts.random(page_size)
        slots = cache.alloc_device(len(branch))
        already = cache.insert(branch, slots)
        cache.free_device(slots[:already])  # the shared pages were cached already
    return target


def _minor_faults() -> int:
    """This process's minor page faults so far (first touches of new memory); 0 where
    the platform does not count them (no ``resource``: Windows)."""
    return 0 if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _percentiles(times: list[float], name: str) -> dict:
    times = sorted(times)
    return {f"{name}_p50_us": times[len(times) // 2], f"{name}_p99_us": times[len(times) * 99 // 100],
            f"{name}_max_us": times[-1]}


def _insert_times(cache: HierarchicalCache, prompts: list, slots) -> dict:
    """``insert`` each prompt with the collector on: per-call µs, page faults per call and
    collections seen. ``slots(i)`` gives prompt ``i``'s device slots (untimed)."""
    runs = {0: 0, 1: 0, 2: 0}

    def seen(phase, info):
        if phase == "start":
            runs[info["generation"]] += 1

    times, alloc_times, noise, faults = [], [], [], 0
    _spin()  # calibrated before the timing
    gc.callbacks.append(seen)
    try:
        for i, p in enumerate(prompts):
            t = time.perf_counter()
            s = slots(i)
            alloc_times.append((time.perf_counter() - t) * 1e6)
            before = _minor_faults()
            t = time.perf_counter()
            cache.insert(p, s)
            times.append((time.perf_counter() - t) * 1e6)
            faults += _minor_faults() - before
            t = time.perf_counter()
            _spin()
            noise.append((time.perf_counter() - t) * 1e6)
    finally:
        gc.callbacks.remove(seen)
    return {**_percentiles(times, "insert"), **_percentiles(alloc_times, "alloc"), **_percentiles(noise, "noise"),
            "faults_per_insert": None if resource is None else faults / len(prompts),
            "gc_runs": [runs[0], runs[1], runs[2]]}


def _timed_inserts(cache: HierarchicalCache, prompts: Prompts, slots, prefix: str) -> dict:
    """:func:`_insert_times` of fresh prompts as lists and as ``array('q')``, keyed
    ``{prefix}{figure}_{input}``."""
    out = {}
    for kind in ("list", "array"):  # fresh prompts, as a server inserts them: not in the CPU's caches
        new = [prompts.array() for _ in range(_INSERTS)]
        if kind == "list":
            new = [p.tolist() for p in new]
        # NOTE: made just now, the prompt lists are young objects: a young-generation
        # collection during the timing would walk all 200 x 8K ids (~6 ms, the
        # benchmark's own data); collected first, they are old and a collection skips them
        gc.collect()
        # NOTE: the collector's full pass just walked every object: the first insert after
        # it finds the tree and the code out of the CPU's caches, as no insert of a running
        # server does. It runs untimed (an extra prompt)
        warm = prompts.array()
        cache.insert(warm.tolist() if kind == "list" else warm, slots(-1))
        out.update({f"{prefix}{key}_{kind}": value for key, value in _insert_times(cache, new, slots).items()})
    return out


def _build(page_size: int, size: int, prompts: Prompts, write_policy: str, room: int, on_insert=None):
    """A cache over a device pool of ``size`` slots filled with prompts until ``room``
    slots are left; ``(cache, last prompt cached, seconds)``. ``on_insert(prompt, slots,
    already)``, where given, sees each prompt cached: its device slots, and how many of
    its leading tokens were cached already (their slots were freed)."""
    spec = KVSpec.k_only(1, 1, 1, dtype=torch.float16)  # metadata is what is timed: 2 bytes a token
    device = DeviceKVPool(spec, size, page_size)
    cache = HierarchicalCache(device, HostKVPool(spec, page_size * 4, page_size), write_policy=write_policy)
    t0 = time.perf_counter()
    cached = prompts.array()
    while device.available_size() - prompts.n >= room:
        cached = prompts.array()
        slots = cache.alloc_device(prompts.n)
        already = cache.insert(cached, slots)
        cache.free_device(slots[:already])  # the shared prefix was cached already
        if on_insert is not None:
            on_insert(cached, slots, already)
    return cache, cached, time.perf_counter() - t0


def steady_inserts(page_size: int, prompt_tokens: int, tree_pages: int, seed: int) -> dict:
    """Inserts into a full tree, as a server runs once its pool has filled: each prompt's
    slots come from ``alloc_device``, which evicts least recently used pages first, so
    the tree's memory is reused rather than new (timed apart: ``alloc``)."""
    gc.collect()  # a tree built before (its nodes and parents are cycles) goes first: one tree at the peak
    prompts = Prompts(prompt_tokens, seed + 1)
    # NOTE: write_through_selective: evicted pages that were never reused just go (write_back
    # would first copy each to the host, which is not what is timed here)
    cache, _, _ = _build(page_size, tree_pages * page_size, prompts, "write_through_selective", 0)
    try:
        return _timed_inserts(cache, prompts, lambda i: cache.alloc_device(prompt_tokens), "steady_")
    finally:
        cache.close()


def bench_page_size(page_size: int, prompt_tokens: int, tree_pages: int, seed: int) -> dict:
    check_config((page_size,), prompt_tokens, tree_pages)
    prompts = Prompts(prompt_tokens, seed)
    spare = (3 * _INSERTS + 8) * prompt_tokens  # the fragmented path and the timed inserts
    size = tree_pages * page_size + spare
    cache, cached, build_s = _build(page_size, size, prompts, "write_back", spare)
    device = cache.device_pool
    pages = (size - device.available_size()) // page_size
    memory = cache.memory_bytes()
    fragmented = _fragment(cache, prompts, page_size)
    nodes_crossed = len(cache.match_prefix(fragmented).path)

    as_list = cached.tolist()
    inputs = {"list": as_list, "array": cached, "numpy": np.frombuffer(cached, dtype=np.int64).copy(),
              "tensor": torch.frombuffer(bytearray(cached), dtype=torch.int64)}
    fresh = prompts.array().tolist()
    timed = per_call_us_each({"floor": lambda: list(as_list), "miss": lambda: cache.match_prefix(fresh),
                              **{kind: lambda x=x: cache.match_prefix(x) for kind, x in inputs.items()}}, 200)
    floor, miss = timed.pop("floor"), timed.pop("miss")
    hit = timed
    frag_list = fragmented.tolist()
    frag = {"array": per_call_us(lambda: cache.match_prefix(fragmented), 50),
            "list": per_call_us(lambda: cache.match_prefix(frag_list), 50)}
    for kind, x in (*inputs.items(), ("fragmented", fragmented)):
        if cache.match_prefix(x).device_len != prompt_tokens:
            raise AssertionError(f"the {kind} prompt must hit in full")

    # the tree grows into spare room: the timed inserts and one untimed first insert per input type
    slots = [cache.alloc_device(prompt_tokens) for _ in range(2 * _INSERTS + 2)]
    inserts = _timed_inserts(cache, prompts, lambda i: slots.pop(), "")
    cache.close()
    return {"page_size": page_size, "prompt_tokens": prompt_tokens, "tree_pages": pages,
            "build_s": round(build_s, 2), "list_copy_us": floor,
            **{f"match_hit_{kind}_us": us for kind, us in hit.items()}, "match_new_us": miss,
            "fragmented_nodes": nodes_crossed, "match_fragmented_array_us": frag["array"],
            "match_fragmented_list_us": frag["list"], **inserts,
            "tree_bytes_per_page": memory / pages, "tree_bytes_per_page_x_ids": memory / pages / (8 * page_size),
            "match_hit_list_x_floor": hit["list"] / floor, "match_hit_array_x_floor": hit["array"] / floor,
            "insert_p99_array_x_floor": inserts["insert_p99_us_array"] / floor}


def run(page_sizes=(16, 64), prompt_tokens: int = 8192, tree_pages: int = 100_000, seed: int = 0) -> dict:
    check_config(page_sizes, prompt_tokens, tree_pages)
    return {"config": {"python": sys.version.split()[0], "gc_threshold": list(gc.get_threshold())},
            "rows": [{**bench_page_size(ps, prompt_tokens, tree_pages, seed),
                      **steady_inserts(ps, prompt_tokens, tree_pages, seed)} for ps in page_sizes]}
