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


#: Host bytes per cached token (its id in the tree, the 2-byte pool slot, the allocator and
#: ownership entries of its page, the prompts held to build the tree), measured at
#: about 13 and doubled.
_BYTES_PER_TOKEN = 32


def check_config(page_sizes, prompt_tokens: int, tree_pages: int) -> None:
    """``ValueError`` unless every prompt is whole pages of every page size, at least 2 tokens long."""
    if not page_sizes:
        raise ValueError("give at least one page size")
    for name, value in (("prompt_tokens", prompt_tokens), ("tree_pages", tree_pages),
                        *(("page_size", p) for p in page_sizes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    bad = [p for p in page_sizes if prompt_tokens % p]
    if prompt_tokens < 2 or bad:
        raise ValueError(f"prompt_tokens {prompt_tokens} must be at least 2 and a multiple of every page size "
                         f"({', '.join(map(str, page_sizes))})")


def memory_bytes(page_sizes, prompt_tokens: int, tree_pages: int) -> int:
    """Host bytes :func:`run` takes at its peak (the page sizes run one after another)."""
    return max(tree_pages * p + 24 * prompt_tokens for p in page_sizes) * _BYTES_PER_TOKEN


def bench_page_size(page_size: int, prompt_tokens: int, tree_pages: int, seed: int) -> dict:
    check_config((page_size,), prompt_tokens, tree_pages)
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
    check_config(page_sizes, prompt_tokens, tree_pages)
    return {"rows": [bench_page_size(ps, prompt_tokens, tree_pages, seed) for ps in page_sizes]}
