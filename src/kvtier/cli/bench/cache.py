"""``kvtier bench cache``: match_prefix and insert over a large tree, against copying the prompt's list;
the full hit beside sglang's radix tree where sglang is installed."""

from __future__ import annotations

import argparse

from ...errors import UsageError
from ...hybrid import HybridSpec
from ..preflight import check_host_memory
from ..spec import add_spec_arguments, has_spec, spec_from_args
from ..table import json_text, print_table
from ..types import int_list, positive_int, seed
from .args import JSON_HELP

#: Tree pages of the hybrid comparison at most (two caches are built per page size).
HYBRID_TREE_PAGES = 20_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-sizes", type=int_list, default="16,64")
    p.add_argument("--prompt-tokens", type=positive_int, default=8192,
                   help="tokens per prompt, a multiple of every page size (default 8192)")
    p.add_argument("--tree-pages", type=positive_int, default=100_000)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    add_spec_arguments(p)


def _hybrid_spec(args: argparse.Namespace) -> HybridSpec | None:
    """The hybrid spec to compare against a uniform cache, or ``None`` (no geometry
    given); ``UsageError`` for a uniform one (the tree benchmark is geometry-free)."""
    if not has_spec(args):
        return None
    spec = spec_from_args(args)
    if not isinstance(spec, HybridSpec) or spec.is_uniform:
        raise UsageError("bench cache --spec takes a hybrid (sliding-window) spec, to compare its match and "
                         "commit with a uniform cache's; the tree benchmark itself holds no KV bytes")
    if all(g.attention.is_full for g in spec.groups):
        raise UsageError("bench cache --spec: this hybrid spec has no sliding-window group")
    return spec


def command(args: argparse.Namespace) -> int:
    from ...bench import cache, cache_hybrid, cache_peers

    hybrid = _hybrid_spec(args)
    cache.check_config(args.page_sizes, args.prompt_tokens, args.tree_pages)
    peak = cache.memory_bytes(args.page_sizes, args.prompt_tokens, args.tree_pages)
    if cache_peers.installed():
        peak = max(peak, cache_peers.memory_bytes(args.page_sizes, args.tree_pages))
    check_host_memory(peak, f"--tree-pages {args.tree_pages}", "use fewer tree pages or smaller pages")
    result = cache.run(page_sizes=args.page_sizes, prompt_tokens=args.prompt_tokens, tree_pages=args.tree_pages,
                       seed=args.seed)
    if hybrid is not None:
        result["hybrid"] = [cache_hybrid.run(hybrid, ps, args.prompt_tokens, min(args.tree_pages, HYBRID_TREE_PAGES),
                                             args.seed) for ps in args.page_sizes]
    result.update(cache_peers.run(args.page_sizes, args.prompt_tokens, args.tree_pages, args.seed))
    if args.json:
        print(json_text(result))
        return 0
    print(f"{args.prompt_tokens}-token prompts sharing a {args.prompt_tokens // 4}-token prefix; floor = copying the "
          "prompt's token list (list(tokens)), same run; inserts with the garbage collector on")
    rows = [[r["page_size"], r["tree_pages"], f"{r['match_hit_list_us']:.1f}", f"{r['match_hit_array_us']:.1f}",
             f"{r['match_hit_numpy_us']:.1f}", f"{r['match_hit_tensor_us']:.1f}", f"{r['match_new_us']:.1f}",
             f"{r['list_copy_us']:.1f}", f"{r['match_hit_array_x_floor']:.1f}x"] for r in result["rows"]]
    print_table("match_prefix, µs (full hit by input type; new prompt as a list)",
                ["page", "tree pages", "list", "array('q')", "numpy", "tensor", "new prompt", "floor",
                 "array x floor"], rows)
    rows = [[r["page_size"], r["fragmented_nodes"], f"{r['match_fragmented_array_us']:.1f}",
             f"{r['match_fragmented_list_us']:.1f}", f"{r['tree_bytes_per_page']:.0f}",
             f"{r['tree_bytes_per_page_x_ids']:.2f}x"] for r in result["rows"]]
    print_table("fragmented path (one node per page), tree memory",
                ["page", "path nodes", "match array µs", "match list µs", "tree bytes/page", "x token ids"], rows)
    def faults(value):
        return "-" if value is None else f"{value:.1f}"

    rows = [[r["page_size"], kind, *(f"{r[f'{tree}insert_{stat}_us_{kind}']:.0f}" for tree in ("", "steady_")
                                     for stat in ("p50", "p99", "max")),
             faults(r[f"faults_per_insert_{kind}"]), faults(r[f"steady_faults_per_insert_{kind}"]),
             "/".join(map(str, r[f"gc_runs_{kind}"])), "/".join(map(str, r[f"steady_gc_runs_{kind}"])),
             f"{r[f'steady_alloc_p50_us_{kind}']:.0f}/{r[f'steady_alloc_p99_us_{kind}']:.0f}"]
            for r in result["rows"] for kind in ("list", "array")]
    print_table("insert of fresh prompts, µs: growing (the tree takes new memory) | steady (a full pool: "
                "alloc_device evicts first, untimed)",
                ["page", "input", "p50", "p99", "max", "steady p50", "p99", "max", "page faults", "steady",
                 "gc gen0/1/2", "steady", "alloc p50/p99"], rows)
    print("page faults: minor faults per insert, each the first touch of 4 KiB of new memory")
    noise = [(r[f"{tree}noise_p50_us_{kind}"], r[f"{tree}noise_p99_us_{kind}"]) for r in result["rows"]
             for kind in ("list", "array") for tree in ("", "steady_")]
    extra = [p99 - p50 for p50, p99 in noise]
    print(f"machine noise: a fixed {cache.NOISE_US} µs computation timed after each insert took p50 "
          f"{min(p for p, _ in noise):.0f}-{max(p for p, _ in noise):.0f} µs and p99 {min(extra):.0f}-{max(extra):.0f} "
          "µs more: what the machine itself adds to a p99")
    if hybrid is not None:
        rows = [_cells(r, ("{}", "page_size tree_prompts"), (_US, "uniform_match_us hybrid_match_us"),
                       (_X, "match_x_uniform"), (_US, "uniform_fragmented_us hybrid_fragmented_us"),
                       (_X, "fragmented_x_uniform"), ("{:.0f}", "uniform_request_us hybrid_request_us"),
                       (_X, "request_x_uniform")) for r in result["hybrid"]]
        print_table(f"hybrid {hybrid.fingerprint()[:60]}... against a uniform cache, same prompts and tree: "
                    "full-hit match (list; fragmented: a node per page), and a request (acquire, commit every "
                    "page, release), µs",
                    ["page", "tree prompts", "uniform match", "hybrid match", "x uniform", "uniform fragmented",
                     "hybrid fragmented", "x uniform", "uniform request", "hybrid request", "x uniform"], rows)
    _print_peers(result)
    return 0


_US, _X = "{:.1f}", "{:.2f}x"


def _cells(row: dict, *groups: tuple[str, str]) -> list[str]:
    """``row``'s cells for a table: per group ``(format, "key key ...")``, its keys' values
    in that format."""
    return [fmt.format(row[key]) for fmt, keys in groups for key in keys.split()]


def _print_peers(result: dict) -> None:
    """sglang's full hit beside kvtier's, or the line saying why it was skipped."""
    peer = result.get("sglang")
    if peer is not None:
        rows = [_cells(r, ("{}", "page_size tree_pages"), (_US, "sglang_us kvtier_list_us kvtier_array_us"),
                       (_X, "kvtier_list_x_sglang kvtier_array_x_sglang"),
                       (_US, "sglang_back_to_back_us sglang_match_back_to_back_us kvtier_list_back_to_back_us "
                             "kvtier_array_back_to_back_us")) for r in peer["rows"]]
        cores = sorted({r["tree_core"] for r in peer["rows"]})
        print_table(f"full hit beside sglang {peer['version']}'s UnifiedRadixCache ({', '.join(cores)}), same prompts, "
                    f"µs: medians of {peer['rounds']} single calls, the three alternated (back to back: "
                    f"{peer['back_to_back_calls']} calls a round)",
                    ["page", "tree pages", "sglang rust", "kvtier list", "kvtier array('q')", "list x sglang",
                     "array x sglang", "back to back: sglang", "sglang match alone", "kvtier list",
                     "kvtier array('q')"], rows)
        print("sglang's call: RadixKey over the array('q'), match_prefix, path_device_indices (its match returns "
              "node ids only); one torch thread; every hit checked: the whole prompt, the slots each side inserted")
        if peer["torchvision_standin"]:
            print("torchvision is not installed: sglang's imports of it got a stand-in (its multimodal configs "
                  "import it; the radix tree does not use it)")
    for name, why in result["skipped"].items():
        print(f"skipped {name}: {why}")
