"""``kvtier bench cache --spec SPEC``: a hybrid spec's match and commit against a
uniform spec's, on trees of the same prompts and tokens, in the same run.

A hybrid cache does more per call: a match also checks each sliding group's window
before the hit, and a commit keeps only the sliding pages some resume point's
window needs (and frees the rest). The ratio to the uniform cache is what that
costs. The pools hold one slot per layer group (``k_only`` of one layer, 2 bytes)
with the spec's group structure and windows: metadata is what is timed.
"""

from __future__ import annotations

import time

import torch

from ..cache import HierarchicalCache
from ..hybrid import HybridSpec, KVGroup
from ..pools import DeviceKVPool, HostKVPool, HybridDevicePool, HybridHostPool
from ..spec import KVSpec
from .cache import Prompts, per_call_us_each

_TINY = KVSpec.k_only(1, 1, 1, dtype=torch.float16)
_COMMITS = 100  # timed acquire/commit/release cycles per cache
_ROUNDS = 5     # ... in rounds of a fifth of them


def _tiny(spec: HybridSpec) -> HybridSpec:
    """``spec``'s groups and attention, one tiny layer each."""
    return HybridSpec(tuple(KVGroup(g.name, (i,), _TINY, g.attention) for i, g in enumerate(spec.groups)))


def _caches(spec: HybridSpec, page_size: int, size: int, sliding: int) -> tuple:
    uniform = HierarchicalCache(DeviceKVPool(_TINY, size, page_size), HostKVPool(_TINY, page_size * 4, page_size),
                                write_policy="write_back")
    tiny = _tiny(spec)
    sizes = {g.name: size if g.attention.is_full else sliding for g in tiny.groups}
    hybrid = HierarchicalCache(HybridDevicePool(tiny, sizes, page_size),
                               HybridHostPool(tiny, {g: page_size * 4 for g in sizes}, page_size),
                               write_policy="write_back")
    return uniform, hybrid


def _serve(cache: HierarchicalCache, tokens, sliding: tuple[str, ...]) -> None:
    """One request: acquire, compute the rest (slots only), commit every page, release."""
    got = cache.acquire(tokens)
    n = len(tokens) - got.device_indices.numel()
    slots = cache.alloc_device(n)
    groups = {g: cache.alloc_device(n, group=g) for g in sliding} if sliding else None
    done = cache.commit(got, tokens, slots, groups=groups)
    cache.release(done.acquired)


def run(spec: HybridSpec, page_size: int = 64, prompt_tokens: int = 8192, tree_pages: int = 20_000,
        seed: int = 0) -> dict:
    """Match (a cached prompt, as a list; again once its path crosses a node per page)
    and request (acquire, commit, release of a new prompt sharing the system prefix)
    times of both caches, and their ratios."""
    prompts = Prompts(prompt_tokens, seed)
    spare = (_COMMITS + 8) * prompt_tokens
    size = tree_pages * page_size + spare
    # NOTE: the sliding pools have the full pool's room: every request hands over all its
    # sliding pages (the cache keeps the windows), as the uniform one does its full pages
    uniform, hybrid = _caches(spec, page_size, size, size)
    names = tuple(g.name for g in spec.groups if not g.attention.is_full)
    try:
        t0 = time.perf_counter()
        cached = None
        while uniform.device_pool.available_size() - prompt_tokens >= spare:
            cached = prompts.array()
            _serve(uniform, cached, ())
            _serve(hybrid, cached, names)
        build_s = time.perf_counter() - t0
        as_list = cached.tolist()
        for cache in (uniform, hybrid):
            if cache.match_prefix(as_list).device_len != prompt_tokens:
                raise AssertionError("the cached prompt must hit in full")
        out = {"spec": spec.fingerprint(), "page_size": page_size, "prompt_tokens": prompt_tokens,
               "tree_prompts": (size - spare) // prompt_tokens, "build_s": round(build_s, 2)}
        matches = per_call_us_each({"uniform": lambda: uniform.match_prefix(as_list),
                                    "hybrid": lambda: hybrid.match_prefix(as_list)}, 200)  # rounds alternated
        for name, cache, groups in (("uniform", uniform, ()), ("hybrid", hybrid, names)):
            out[f"{name}_match_us"] = matches[name]
            best = float("inf")
            for _ in range(_ROUNDS):  # the fastest round's mean, as for the matches: a shared machine is noisy
                fresh = [prompts.array().tolist() for _ in range(_COMMITS // _ROUNDS)]
                t = time.perf_counter()
                for p in fresh:
                    _serve(cache, p, groups)
                best = min(best, (time.perf_counter() - t) / len(fresh))
            out[f"{name}_request_us"] = best * 1e6
        # the same prompt once every one of its pages has a diverging sibling: its path
        # crosses a node per page
        for i in range(1, prompt_tokens // page_size):
            branch = cached[:i * page_size] + prompts.random(page_size)
            _serve(uniform, branch, ())
            _serve(hybrid, branch, names)
        nodes = {len(cache.match_prefix(as_list).path) for cache in (uniform, hybrid)}
        if nodes != {prompt_tokens // page_size}:
            raise AssertionError(f"the fragmented path crosses {nodes} nodes, not one per page")
        frag = per_call_us_each({"uniform": lambda: uniform.match_prefix(as_list),
                                 "hybrid": lambda: hybrid.match_prefix(as_list)}, 50)
        out.update({"fragmented_nodes": prompt_tokens // page_size, "uniform_fragmented_us": frag["uniform"],
                    "hybrid_fragmented_us": frag["hybrid"]})
        out["match_x_uniform"] = out["hybrid_match_us"] / out["uniform_match_us"]
        out["fragmented_x_uniform"] = out["hybrid_fragmented_us"] / out["uniform_fragmented_us"]
        out["request_x_uniform"] = out["hybrid_request_us"] / out["uniform_request_us"]
        return out
    finally:
        uniform.close()
        hybrid.close()
