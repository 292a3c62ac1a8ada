"""``kvtier bench meta``: span metadata p50/p90 against a floor timed beside each call, optionally under load."""

from __future__ import annotations

import argparse
import os

from ...errors import UsageError
from ...layout import LAYOUTS
from ..preflight import check_host_memory
from ..table import json_text, print_table
from ..types import name_list, positive_int, seed
from .args import JSON_HELP, count, dims


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--heads", type=positive_int, default=8, help="KV heads; split-heads runs the factors 2, 4, 8 "
                   "that divide it (default 8)")
    p.add_argument("--dims", type=dims, default="192/128", help="K[/V] head dims, comma separated (default 192/128)")
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--pages", type=positive_int, default=4096)
    p.add_argument("--layouts", type=name_list(LAYOUTS), default=",".join(LAYOUTS))
    p.add_argument("--repeat", type=positive_int, default=50, help="timed calls per row (default 50)")
    p.add_argument("--load", type=count, default=0,
                   help="CPU-bound processes (a Python busy loop each) running during the timing (default 0)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def command(args: argparse.Namespace) -> int:
    from ...bench import meta

    cpus = os.cpu_count() or 1
    if args.load > 4 * cpus:
        raise UsageError(f"--load {args.load}: more than 4 busy processes per CPU ({4 * cpus} here)")
    what = f"{args.pages} pages of {args.page_size} tokens"
    check_host_memory(meta.memory_bytes(pages=args.pages, page_size=args.page_size, layers=args.layers,
                                        heads=args.heads, dims=args.dims), what, "use fewer pages or layers")
    result = meta.run(layers=args.layers, heads=args.heads, dims=args.dims, page_size=args.page_size,
                      pages=args.pages, layouts=args.layouts, repeat=args.repeat, load=args.load,
                      threads=args.threads, seed=args.seed)
    if args.json:
        print(json_text(result))
        return 0
    cfg = result["config"]
    print(f"{cfg['pages']} random pages of {cfg['page_size']} tokens, {cfg['layers']} layers, {cfg['heads']} KV heads; "
          f"torch threads {cfg['torch_threads']}; {cfg['load']} competing CPU-bound processes; "
          f"{cfg['repeat']} calls per row")
    print("floor (timed beside each call): " + "; ".join(f"{form}: {text}" for form, text in cfg["floors"].items()))
    specs = len(cfg["dims"]) > 1  # one spec: named in the title, not on every row
    rows = [[*([r["spec"]] if specs else []), r["layout"], r["kind"], r["form"], r["spans"], f"{r['p50_ms']:.3f}",
             f"{r['p90_ms']:.3f}", f"{r['floor_p50_ms']:.3f}", f"{r['floor_p90_ms']:.3f}", f"{r['ratio']:.2f}x"]
            for r in result["rows"]]
    title = "span metadata" if specs or not result["rows"] else f"span metadata, {result['rows'][0]['spec']}"
    print_table(f"{title} (x floor = p50 / floor p50, same run)",
                [*(["spec"] if specs else []), "layout", "kind", "form", "spans", "p50 ms", "p90 ms", "floor p50",
                 "floor p90", "x floor"], rows)
    return 0
