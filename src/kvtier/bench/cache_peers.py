"""sglang's radix tree beside kvtier's for ``kvtier bench cache``, where sglang is
installed: 0.5.23's ``UnifiedRadixCache`` with its Rust tree core, built as sglang's
own test kit builds it (a one-layer ``MHATokenToKVPool`` on the CPU,
``tree_components=(ComponentType.FULL,)``, ``tree_core_backend="rust"``) but over the
``PagedTokenToKVPoolAllocator`` its server uses for pages over one token (the kit's
allocates by the token). Both trees hold the same prompts (:class:`Prompts`,
:func:`_build`: sglang's gets each prompt as kvtier's does, with slots of its own
allocator), and a full hit of the last one is timed, one torch thread:

- sglang: a ``RadixKey`` over the prompt's ``array('q')``, ``match_prefix``, then the
  device slots read off the path (``path_device_indices(last_device_node)``, what its
  ``prefix_device_indices`` does: 0.5.23's match returns node ids and lengths only);
- kvtier: ``match_prefix`` of the prompt as a list and as an ``array('q')``.

Each call is checked first and last: all of the prompt hit, and the device slots are
the ones that side was given when the prompt's pages were inserted.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import statistics
import warnings
from array import array
from contextlib import contextmanager
from typing import NamedTuple

import torch

from ..errors import IntegrityError, UsageError
from ._torchvision_standin import torchvision_standin
from .cache import Prompts, _build, check_config, round_times

SGLANG_VERSION = "0.5.23"
#: Host bytes per cached token with both trees built (measured: about 32), with room
_BYTES_PER_TOKEN = 80
_IMPORT_BYTES = 512 << 20  # sglang's modules, imported (measured: about 450 MiB)
ROUNDS = 31
BACK_TO_BACK = 20  # calls a round in the back-to-back figures
RUST_CORE = "RustUnifiedTreeCore"


class Sglang(NamedTuple):
    """What the comparison uses of sglang's 0.5.23 API."""

    version: str
    standin: bool  # torchvision was absent: its imports got a stand-in (see torchvision_standin)
    kv_pool: type
    allocator: type
    req_pool: type
    init_params: type
    cache: type
    full: object  # ComponentType.FULL
    key: type
    insert_params: type
    match_params: type


def installed() -> bool:
    """Whether an ``sglang`` package is there to try (:func:`load_sglang` says whether it works)."""
    try:
        return importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):  # a stub without a spec, a parent that fails to import
        return False


def memory_bytes(page_sizes, tree_pages: int) -> int:
    """Host bytes :func:`run` takes at its peak: sglang's modules and the two trees of the
    largest page size."""
    return _IMPORT_BYTES + tree_pages * max(page_sizes) * _BYTES_PER_TOKEN


def load_sglang() -> tuple[Sglang | None, str]:
    """sglang's classes, or ``None`` and why not (one line): not installed, a failed
    import, an API that is not 0.5.23's (a small tree built, a prompt inserted and hit),
    or no Rust tree core (sglang then falls back to its Python one)."""
    if not installed():
        return None, "sglang is not installed in this environment"
    try:
        version = getattr(importlib.import_module("sglang"), "__version__", "?")
    except Exception as e:  # a broken install: anything may raise
        return None, f"sglang does not import here: {_one_line(e)}"
    try:
        api = _import(version)
        tree = SglangTree(api, page_size=16, size=64)
        if tree.core != RUST_CORE:
            return None, f"sglang {version} has no Rust tree core here ({tree.fallback_reason()}); it uses {tree.core}"
        tree.probe()
    except Exception as e:
        return None, f"sglang {version} (the comparison follows {SGLANG_VERSION}'s API): {_one_line(e)}"
    return api, ""


def _one_line(e: Exception) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _import(version: str) -> Sglang:
    with warnings.catch_warnings(), torchvision_standin() as standin:
        warnings.simplefilter("ignore")  # its quantization modules warn, at import, that the CPU lacks them
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    return Sglang(version, standin, MHATokenToKVPool, PagedTokenToKVPoolAllocator, ReqToTokenPool, CacheInitParams,
                  UnifiedRadixCache, ComponentType.FULL, RadixKey, InsertParams, MatchPrefixParams)


class SglangTree:
    """A ``UnifiedRadixCache`` over ``size`` device slots (see the module's docstring)."""

    def __init__(self, api: Sglang, page_size: int, size: int) -> None:
        self.api, self.page_size, self.size = api, page_size, size
        pool = api.kv_pool(size=size, page_size=page_size, dtype=torch.float16, head_num=1, head_dim=1, layer_num=1,
                           device="cpu", enable_memory_saver=False)
        self.allocator = api.allocator(size=size, page_size=page_size, dtype=torch.float16, device="cpu",
                                       kvcache=pool, need_sort=False)
        req = api.req_pool(size=1, max_context_len=8, device="cpu", enable_memory_saver=False)
        self.params = api.init_params(disable=False, req_to_token_pool=req, token_to_kv_pool_allocator=self.allocator,
                                      page_size=page_size, tree_components=(api.full,), tree_core_backend="rust")
        self.cache = api.cache(params=self.params)
        self.core = type(self.cache.tree_core).__name__

    def fallback_reason(self) -> str:
        """Why sglang chose its Python tree core (its own words)."""
        from sglang.srt.mem_cache.unified_cache import tree_core_registry

        return tree_core_registry._rust_fallback_reason(self.params) or "no reason given"

    def insert(self, tokens) -> tuple[torch.Tensor, int]:
        """Cache ``tokens`` (an ``array('q')``, whole pages) in new slots; ``(slots
        given, tokens cached already)``.

        NOTE: sglang's insert frees the slots of the tokens it found cached itself (those
        from ``prev_prefix_len`` on, 0 here), where kvtier's leaves them to the caller:
        freed again here, its allocator would hand each of those pages out twice."""
        slots = self.allocator.alloc(len(tokens))
        if slots is None:
            raise UsageError(f"sglang's allocator has {self.allocator.available_size()} of {self.size} slots free, "
                             f"not {len(tokens)}")
        return slots, self.cache.insert(self.api.insert_params(key=self.api.key(tokens), value=slots)).prefix_len

    def probe(self) -> None:
        """Insert and hit a prompt of two pages: ``IntegrityError`` unless the hit is
        the whole prompt in the slots it was given."""
        tokens = array("q", range(2 * self.page_size))
        slots, _ = self.insert(tokens)
        check_hit("sglang", self.hit(tokens), slots)

    def hit(self, tokens) -> tuple[int, torch.Tensor]:
        """``(device hit length, its device slots)``: the timed call."""
        match = self.cache.match_prefix(self.api.match_params(key=self.api.key(tokens)))
        return match.device_prefix_len, self.cache.path_device_indices(match.last_device_node)

    def match_only(self, tokens) -> int:
        return self.cache.match_prefix(self.api.match_params(key=self.api.key(tokens))).device_prefix_len

    def pages(self) -> int:
        return (self.size - self.allocator.available_size()) // self.page_size


class _Inserted:
    """The slots each side gave the first prompt and the last one (``on_insert`` of
    :func:`_build`, which also caches each prompt in sglang's tree)."""

    def __init__(self, tree: SglangTree) -> None:
        self.tree, self.first, self.last, self.prompts = tree, None, None, 0

    def __call__(self, prompt, slots, already) -> None:
        sides = {"kvtier": (slots, already), "sglang": self.tree.insert(prompt)}
        if self.first is None:
            self.first = sides
        self.last, self.prompts = sides, self.prompts + 1

    def expected(self, side: str) -> torch.Tensor:
        """The last prompt's slots as inserted: the first prompt's for the pages it found
        cached (the shared prefix, which the first prompt brought), then its own."""
        slots, already = self.last[side]
        return torch.cat((self.first[side][0][:already], slots[already:]))


def check_hit(name: str, hit: tuple[int, torch.Tensor], expected: torch.Tensor) -> None:
    """``IntegrityError`` unless ``hit`` (length, slots) is all of ``expected``, slot for slot."""
    length, slots = hit
    if length != len(expected) or not torch.equal(slots.to(torch.int64), expected.to(torch.int64)):
        wrong = (slots[:len(expected)] != expected[:len(slots)]).nonzero()
        at = f", first at token {int(wrong[0])}" if len(wrong) else ""
        raise IntegrityError(f"{name}: a hit of {length} tokens with {len(slots)} slots{at}; inserted: "
                             f"{len(expected)} slots")


def medians_us(fns: dict, rounds: int, calls: int) -> dict:
    """Median µs a call of each of ``fns`` (name -> function) over ``rounds`` rounds of
    ``calls`` calls back to back, alternated (:func:`round_times`)."""
    return {name: statistics.median(ts) * 1e6 for name, ts in round_times(fns, rounds, calls).items()}


def compare(api: Sglang, page_size: int, prompt_tokens: int, tree_pages: int, seed: int) -> dict:
    """Both trees of ``tree_pages`` pages from the same prompts, and the full hit's µs
    on each (medians of :data:`ROUNDS` single calls, and back to back)."""
    check_config((page_size,), prompt_tokens, tree_pages)
    size = tree_pages * page_size
    gc.collect()  # the trees built before go first: two at the peak, not four
    with _one_torch_thread():  # sglang reads its slots with torch calls
        inserted = _Inserted(SglangTree(api, page_size, size))
        cache, tokens, _ = _build(page_size, size, Prompts(prompt_tokens, seed), "write_back", 0, on_insert=inserted)
        try:
            if not inserted.prompts:
                raise UsageError(f"{tree_pages} pages of {page_size} tokens hold no {prompt_tokens}-token prompt")
            pages = (size - cache.device_pool.available_size()) // page_size
            if inserted.tree.pages() != pages:
                raise IntegrityError(f"sglang's tree holds {inserted.tree.pages()} pages of the same prompts, "
                                     f"kvtier's {pages}")
            times = _timed_hits(inserted, cache, tokens)
        finally:
            cache.close()
    return {"page_size": page_size, "prompt_tokens": prompt_tokens, "tree_pages": pages, "prompts": inserted.prompts,
            "tree_core": inserted.tree.core, **times,
            "kvtier_list_x_sglang": times["kvtier_list_us"] / times["sglang_us"],
            "kvtier_array_x_sglang": times["kvtier_array_us"] / times["sglang_us"]}


def _timed_hits(inserted: _Inserted, cache, tokens) -> dict:
    """The three full hits, checked before and after: medians of single calls
    (``{name}_us``) and of calls back to back (``{name}_back_to_back_us``, with
    sglang's match alone beside them)."""
    sglang, listed = inserted.tree, tokens.tolist()
    calls = {"sglang": lambda: sglang.hit(tokens),
             "kvtier_list": lambda: _hit(cache.match_prefix(listed)),
             "kvtier_array": lambda: _hit(cache.match_prefix(tokens))}
    expected = {name: inserted.expected(name.partition("_")[0]) for name in calls}
    for name, call in calls.items():
        check_hit(name, call(), expected[name])
    single = medians_us(calls, ROUNDS, 1)
    in_a_row = medians_us({**calls, "sglang_match": lambda: sglang.match_only(tokens)}, ROUNDS, BACK_TO_BACK)
    for name, call in calls.items():
        check_hit(name, call(), expected[name])
    return {**{f"{name}_us": us for name, us in single.items()},
            **{f"{name}_back_to_back_us": us for name, us in in_a_row.items()}}


@contextmanager
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _hit(match) -> tuple[int, torch.Tensor]:
    return match.device_len, match.device_indices


def run(page_sizes, prompt_tokens: int, tree_pages: int, seed: int) -> dict:
    """``{"sglang": {...}}`` with a row per page size, or ``{"skipped": {"sglang": why}}``."""
    api, why = load_sglang()
    if api is None:
        return {"skipped": {"sglang": why}}
    return {"sglang": {"version": api.version, "torchvision_standin": api.standin,
                       "rounds": ROUNDS, "back_to_back_calls": BACK_TO_BACK, "torch_threads": 1,
                       "rows": [compare(api, ps, prompt_tokens, tree_pages, seed) for ps in page_sizes]},
            "skipped": {}}
