"""``kvtier bench cache``: match_prefix and insert over a large tree, against copying the prompt's list."""

from __future__ import annotations

import argparse

from ..preflight import check_host_memory
from ..table import json_text, print_table
from ..types import int_list, positive_int
from .args import JSON_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-sizes", type=int_list, default="16,64")
    p.add_argument("--prompt-tokens", type=positive_int, default=8192,
                   help="tokens per prompt, a multiple of every page size (default 8192)")
    p.add_argument("--tree-pages", type=positive_int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def command(args: argparse.Namespace) -> int:
    from ...bench import cache

    cache.check_config(args.page_sizes, args.prompt_tokens, args.tree_pages)
    check_host_memory(cache.memory_bytes(args.page_sizes, args.prompt_tokens, args.tree_pages),
                      f"--tree-pages {args.tree_pages}", "use fewer tree pages or smaller pages")
    result = cache.run(page_sizes=args.page_sizes, prompt_tokens=args.prompt_tokens, tree_pages=args.tree_pages,
                       seed=args.seed)
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
    return 0
