"""``kvtier inspect``: what each host layout costs for a KV geometry and page size."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from .layout_report import layout_reports, memory_bytes
from .preflight import check_host_memory, check_torch_bytes
from .spec import add_spec_arguments, spec_from_args
from .table import human_bytes, json_text, print_table
from .types import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_spec_arguments(p)
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--json", action="store_true", help="print the reports as JSON")


def command(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    check_torch_bytes(spec.bytes_per_token * args.page_size,
                      f"a page of {args.page_size} tokens of {spec.fingerprint()}",
                      "use fewer layers, heads or tokens per page")
    check_host_memory(memory_bytes(args.page_size), f"--page-size {args.page_size}", "use a smaller page size")
    reports = layout_reports(spec, args.page_size)
    if args.json:
        print(json_text({"spec": spec.fingerprint(), "page_size": args.page_size,
                         "layouts": [asdict(r) for r in reports]}))
        return 0
    comps = ", ".join(f"{c.name} {c.head_num}x{c.head_dim}" for c in spec.components)
    print(f"spec {spec.fingerprint()}: {spec.layer_num} layers, {comps}, "
          f"{human_bytes(spec.bytes_per_token)} per token, page_size {args.page_size}")
    rows = []
    for r in reports:
        lo, hi = r.span_bytes
        spans = human_bytes(lo) if lo == hi else f"{human_bytes(lo)}..{human_bytes(hi)}"
        rows.append([r.layout, human_bytes(r.page_bytes), f"{r.spans_per_page} x {spans}",
                     f"yes (up to {r.max_split})" if r.split_heads else "no",
                     f"{r.load_chunks_per_page} x {human_bytes(r.load_chunk_bytes)}", r.page_format])
    print_table("host layouts", ["layout", "page", "zero-copy spans / page", "split heads",
                                 "per-layer load chunks / page", "page format"], rows)
    print("Bigger spans and load chunks copy faster; split heads lets engines with other "
          "tensor-parallel sizes share pages zero-copy.")
    return 0
