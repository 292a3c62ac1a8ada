"""``kvtier inspect``: what each host layout costs for a KV geometry and page size; for a
hybrid geometry, what each layer group costs per token and per window, then each group's
host layouts (an engine keeps one host pool per group)."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from ..hybrid import HybridSpec, KVGroup, layer_ranges
from ..spec import KVSpec
from .layout_report import LayoutReport, layout_reports, memory_bytes
from .preflight import check_host_memory, check_torch_bytes
from .spec import add_spec_arguments, attention_text, spec_from_args
from .table import human_bytes, json_text, print_table
from .types import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_spec_arguments(p)
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--json", action="store_true", help="print the reports as JSON")


def command(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    for s in spec_parts(spec):
        check_torch_bytes(s.bytes_per_token * args.page_size,
                          f"a page of {args.page_size} tokens of {s.fingerprint()}",
                          "use fewer layers, heads or tokens per page")
    check_host_memory(memory_bytes(args.page_size), f"--page-size {args.page_size}", "use a smaller page size")
    if isinstance(spec, HybridSpec):
        return _hybrid(spec, args)
    reports = layout_reports(spec, args.page_size)
    if args.json:
        print(json_text({"spec": spec.fingerprint(), "page_size": args.page_size,
                         "layouts": [asdict(r) for r in reports]}))
        return 0
    print(f"spec {spec.fingerprint()}: {spec.layer_num} layers, {_components(spec)}, "
          f"{human_bytes(spec.bytes_per_token)} per token, page_size {args.page_size}")
    _print_layouts("host layouts", reports)
    print("Bigger spans and load chunks copy faster; split heads lets engines with other "
          "tensor-parallel sizes share pages zero-copy.")
    return 0


def spec_parts(spec: KVSpec | HybridSpec) -> tuple[KVSpec, ...]:
    """The geometries a spec's host pools have: one per group of a hybrid spec."""
    return tuple(g.spec for g in spec.groups) if isinstance(spec, HybridSpec) else (spec,)


def group_fields(g: KVGroup) -> dict:
    """One group's numbers for JSON: attention ``full`` or ``sliding`` (with ``window``),
    ``layers`` as ranges (``0,5,11-13``), components, bytes per token and, for a sliding
    group, ``window_bytes`` (``window`` tokens of it; 0 for a full group)."""
    window = g.attention.window
    return {"name": g.name, "attention": g.attention.kind, "window": window, "layers": layer_ranges(g.layers),
            "spec": g.spec.fingerprint(),
            "components": [{"name": c.name, "heads": c.head_num, "head_dim": c.head_dim} for c in g.spec.components],
            "bytes_per_token": g.bytes_per_token, "window_bytes": (window or 0) * g.bytes_per_token}


def _hybrid(spec: HybridSpec, args: argparse.Namespace) -> int:
    reports = {g.name: layout_reports(g.spec, args.page_size) for g in spec.groups}
    totals = {"full_bytes_per_token": spec.full_bytes_per_token, "window_bytes": spec.window_bytes,
              "uniform_bytes_per_token": spec.uniform_bytes_per_token}
    if args.json:
        groups = [{**group_fields(g), "layouts": [asdict(r) for r in reports[g.name]]} for g in spec.groups]
        print(json_text({"spec": spec.fingerprint(), "page_size": args.page_size, "groups": groups, **totals}))
        return 0
    print(f"hybrid spec, {spec.layer_num} layers in {len(spec.groups)} groups, page_size {args.page_size}")
    rows = []
    for g in spec.groups:
        window = "-" if g.attention.is_full else f"{g.attention.window * g.bytes_per_token:,} B"
        rows.append([g.name, attention_text(g.attention), f"{len(g.layers)}: {layer_ranges(g.layers)}",
                     _components(g.spec), f"{g.bytes_per_token:,} B", window])
    print_table("layer groups", ["group", "attention", "layers", "heads x dim", "bytes / token", "window bytes"],
                rows)
    full = spec.full_bytes_per_token
    print(f"full attention: {full:,} B per token ({human_bytes(full)}), kept for every token")
    print(f"sliding windows: {spec.window_bytes:,} B ({human_bytes(spec.window_bytes)}) per resume point")
    ratio = f": {spec.uniform_bytes_per_token / full:.2f}x the full layers' {full:,} B" if full else ""
    print(f"a window-blind cache (every group keeps every token): {spec.uniform_bytes_per_token:,} B per token{ratio}")
    for g in spec.groups:
        _print_layouts(f"host layouts: group {g.name} ({g.spec.fingerprint()})", reports[g.name])
    print("Bigger spans and load chunks copy faster; split heads lets engines with other "
          "tensor-parallel sizes share pages zero-copy.")
    return 0


def _components(spec: KVSpec) -> str:
    return ", ".join(f"{c.name} {c.head_num}x{c.head_dim}" for c in spec.components)


def _print_layouts(title: str, reports: list[LayoutReport]) -> None:
    rows = []
    for r in reports:
        lo, hi = r.span_bytes
        spans = human_bytes(lo) if lo == hi else f"{human_bytes(lo)}..{human_bytes(hi)}"
        rows.append([r.layout, human_bytes(r.page_bytes), f"{r.spans_per_page} x {spans}",
                     f"yes (up to {r.max_split})" if r.split_heads else "no",
                     f"{r.load_chunks_per_page} x {human_bytes(r.load_chunk_bytes)}", r.page_format])
    print_table(title, ["layout", "page", "zero-copy spans / page", "split heads",
                        "per-layer load chunks / page", "page format"], rows)
