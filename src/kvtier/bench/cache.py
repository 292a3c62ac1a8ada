"""``kvtier bench cache``: ``match_prefix`` and ``insert`` speed for 8K-token prompts over a
tree of 10^5 pages.

The tree holds prompts that share a system prefix (a quarter of the prompt) and then
diverge, as chat traffic does. Timed: matching a cached prompt (full hit), matching a
new prompt (hit ends after the shared prefix), inserting a new prompt. Each figure is
also given as a ratio to copying the prompt's token list (``list(tokens)``) measured
in the same run: the floor of any call that takes the prompt.
"""

from __future__ import annotations

import random
import time

import torch

from ..cache import HierarchicalCache
from ..pools import DeviceKVPool, HostKVPool
from ..spec import KVSpec


def _per_call_us(fn, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def bench_page_size(page_size: int, prompt_tokens: int, tree_pages: int, seed: int) -> dict:
    rng = random.Random(seed)
    spec = KVSpec.k_only(1, 1, 1, dtype=torch.float16)  # metadata is what is timed: 2 bytes a token
    prompts_needed = tree_pages * page_size // (prompt_tokens * 3 // 4) + 2
    timed_inserts = 20
    size = tree_pages * page_size + (timed_inserts + 2) * prompt_tokens
    device = DeviceKVPool(spec, size, page_size)
    host = HostKVPool(spec, page_size * 4, page_size)
    cache = HierarchicalCache(device, host, write_policy="write_back")
    system = [rng.randrange(1 << 30) for _ in range(prompt_tokens // 4)]

    def new_prompt() -> list[int]:
        return system + [rng.randrange(1 << 30) for _ in range(prompt_tokens - len(system))]

    cached = None
    t0 = time.perf_counter()
    for _ in range(prompts_needed):
        cached = new_prompt()
        cache.insert(cached, cache.alloc_device(prompt_tokens))
        if device.available_size() < (timed_inserts + 1) * prompt_tokens:  # room for the timed inserts
            break
    build_s = time.perf_counter() - t0
    pages = (size - device.available_size()) // page_size
    floor = _per_call_us(lambda: list(cached), 200)
    hit = _per_call_us(lambda: cache.match_prefix(cached), 200)
    fresh = new_prompt()
    miss = _per_call_us(lambda: cache.match_prefix(fresh), 200)
    inserts = [new_prompt() for _ in range(timed_inserts)]
    slots = [cache.alloc_device(prompt_tokens) for _ in inserts]
    t = time.perf_counter()
    for p, s in zip(inserts, slots):
        cache.insert(p, s)
    insert_us = (time.perf_counter() - t) / len(inserts) * 1e6
    match = cache.match_prefix(cached)
    assert match.device_len == prompt_tokens, "the benchmark prompt must hit in full"
    cache.close()
    return {"page_size": page_size, "prompt_tokens": prompt_tokens, "tree_pages": pages,
            "build_s": round(build_s, 2), "list_copy_us": floor, "match_hit_us": hit, "match_new_us": miss,
            "insert_us": insert_us, "match_hit_x_floor": hit / floor, "insert_x_floor": insert_us / floor}


def run(page_sizes=(16, 64), prompt_tokens: int = 8192, tree_pages: int = 100_000, seed: int = 0) -> dict:
    return {"rows": [bench_page_size(ps, prompt_tokens, tree_pages, seed) for ps in page_sizes]}
