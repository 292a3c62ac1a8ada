"""The ``kvtier`` command line: ``demo``, ``inspect``, ``selfcheck``, ``bench transfer|storage|cache``."""

from __future__ import annotations

import argparse
import json
import sys

from .spec import add_spec_arguments, spec_from_args
from .table import human_bytes, print_table


def _inspect(args: argparse.Namespace) -> int:
    from .layout_report import layout_reports

    spec = spec_from_args(args)
    reports = layout_reports(spec, args.page_size)
    if args.json:
        from dataclasses import asdict

        print(json.dumps({"spec": spec.fingerprint(), "page_size": args.page_size,
                          "layouts": [asdict(r) for r in reports]}, indent=2))
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


def _bench_transfer(args: argparse.Namespace) -> int:
    from ..bench import transfer

    dims = []
    for item in args.dims.split(","):
        k, _, v = item.partition("/")
        dims.append((int(k), int(v or k)))
    result = transfer.run(layers=args.layers, heads=args.heads, dims=tuple(dims),
                          page_sizes=tuple(int(p) for p in str(args.page_size).split(",")),
                          pages=args.pages, layouts=tuple(args.layouts.split(",")),
                          backends=tuple(args.backends.split(",")), repeat=args.repeat,
                          meta_pages=args.meta_pages, seed=args.seed, device=args.device)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    cfg = result["config"]
    print(f"{cfg['layers']} layers, {cfg['heads']} KV heads, bf16, page sizes {cfg['page_sizes']}, "
          f"{cfg['pages']} pages (of the largest size) in random order on both sides; device {cfg['device_name']}; "
          f"torch threads {cfg['torch_threads']}")
    for key, gbps in result["memcpy_gbps"].items():
        print(f"memcpy limit for {key}: backup (device->host) {gbps['backup']:.2f} GB/s, "
              f"load (host->device) {gbps['load']:.2f} GB/s")
    rows = [[r["spec"], r["page_size"], r["layout"], r["io_backend"], r["direction"], f"{r['gbps']:.2f}",
             f"{r['ratio']:.2f}x"] for r in result["transfer"]]
    print_table("transfer (ratio = GB/s / same-direction memcpy GB/s, same run)",
                ["spec", "page", "layout", "io_backend", "direction", "GB/s", "x memcpy"], rows)
    rows = [[r["layout"], r["kind"], r["pages"], r["spans"], f"{r['ms']:.3f}"] for r in result["meta"]]
    print_table("span metadata", ["layout", "kind", "pages", "spans", "ms"], rows)
    return 0


def _selfcheck(args: argparse.Namespace) -> int:
    from . import selfcheck

    spec = spec_from_args(args) if any(getattr(args, k) for k in ("spec", "mha", "mla", "k_only", "components")) \
        else selfcheck_default_spec()
    print(f"round trip device -> host -> flat page -> other layout -> device, spec {spec.fingerprint()}")
    rows = selfcheck.run(spec, page_size=args.page_size, pages=args.pages, seed=args.seed)
    print_table("self-check (bytes compared bit for bit)", ["layouts", "io_backend", "result", "ms"],
                [[r["layout"], r["io_backend"], "identical" if r["ok"] else "MISMATCH", f"{r['ms']:.1f}"]
                 for r in rows])
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed} of {len(rows)} round trips identical")
    return 1 if failed else 0


def selfcheck_default_spec():
    from ..spec import KVSpec

    return KVSpec.mha(8, 4, 192, v_head_dim=128)  # MiMo-V2-Flash-like K/V dims, few layers


def _bench_storage(args: argparse.Namespace) -> int:
    from ..bench import storage

    result = storage.run(layers=args.layers, heads=args.heads, head_dim=args.head_dim, v_head_dim=args.v_head_dim,
                         page_size=args.page_size, pages=args.pages, layout=args.layout,
                         backends=tuple(args.backends.split(",")), directory=args.dir, repeat=args.repeat)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    cfg = result["config"]
    print(f"{cfg['spec']}, page_size {cfg['page_size']}, {cfg['pages']} pages ({cfg['objects_per_page']} objects "
          f"each), layout {cfg['layout']}; raw = the backend's own client moving the same objects")
    rows = [[r["backend"], r["op"], r["objects"], f"{r['gbytes']:.3f}", f"{r['kvtier_gbps']:.2f}",
             f"{r['raw_gbps']:.2f}", f"{r['ratio']:.2f}x"] for r in result["rows"]]
    print_table("storage (ratio = kvtier GB/s / raw client GB/s, same run)",
                ["backend", "op", "objects", "GB", "kvtier GB/s", "raw GB/s", "x raw"], rows)
    for name, why in result["skipped"].items():
        print(f"skipped {name}: {why}")
    return 0


def _bench_cache(args: argparse.Namespace) -> int:
    from ..bench import cache

    result = cache.run(page_sizes=tuple(int(x) for x in args.page_sizes.split(",")), prompt_tokens=args.prompt_tokens,
                       tree_pages=args.tree_pages, seed=args.seed)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rows = [[r["page_size"], r["tree_pages"], f"{r['match_hit_us']:.1f}", f"{r['match_new_us']:.1f}",
             f"{r['insert_us']:.1f}", f"{r['list_copy_us']:.1f}", f"{r['match_hit_x_floor']:.1f}x"]
            for r in result["rows"]]
    print_table(f"cache metadata, {result['rows'][0]['prompt_tokens']}-token prompts "
                "(x floor = / copying the prompt's token list, same run)",
                ["page_size", "tree pages", "match hit us", "match new us", "insert us", "list copy us",
                 "match x floor"], rows)
    return 0


def _demo(args: argparse.Namespace) -> int:
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from .. import demo

    total = args.sessions * args.turns
    print(f"kvtier demo: tiny {args.model} (random weights), {args.sessions} sessions x {args.turns} turns, "
          f"device {args.device_tokens} / host {args.host_tokens} tokens, storage "
          f"{args.storage or 'file (temporary directory)'}; every request is run again without kvtier")
    try:
        from rich.progress import Progress
    except ImportError:  # pragma: no cover
        Progress = None
    if Progress is not None:
        with Progress(transient=True) as bar:
            task = bar.add_task("requests", total=total)
            rows, summary = demo.run(**_demo_kwargs(args), progress=lambda: bar.advance(task))
    else:
        rows, summary = demo.run(**_demo_kwargs(args))
    print_table("per request (tokens; prefill ms with and without kvtier)",
                ["session", "turn", "prompt", "device", "host", "storage", "prefilled", "ms kvtier", "ms without",
                 "output"],
                [[r.session, r.turn, r.prompt, r.device, r.host, r.storage, r.prefilled, f"{r.prefill_ms:.1f}",
                  f"{r.baseline_ms:.1f}", "identical" if r.identical else "DIFFERENT"] for r in rows])
    s = summary
    reused = sum(s["reused"].values())
    print(f"prompt tokens {s['prompt_tokens']}: reused {reused} ({reused / s['prompt_tokens']:.0%}) = device "
          f"{s['reused']['device']} + host {s['reused']['host']} + storage {s['reused']['storage']}; "
          f"prefilled {s['prefilled_tokens']}")
    print(f"prefill time {s['prefill_ms']:.0f} ms with kvtier vs {s['baseline_prefill_ms']:.0f} ms without "
          f"({s['baseline_prefill_ms'] / max(s['prefill_ms'], 1e-9):.1f}x less); outputs identical in "
          f"{s['identical']} of {s['requests']} requests")
    if args.plot:
        demo.plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": demo.rows_json(rows), "summary": summary}, f, indent=2)
    if s["identical"] != s["requests"]:
        print("FAILED: kvtier changed generated tokens", file=sys.stderr)
        return 1
    return 0


def _demo_kwargs(args: argparse.Namespace) -> dict:
    return {"model": args.model, "sessions": args.sessions, "turns": args.turns, "storage": args.storage,
            "layout": args.layout, "device_tokens": args.device_tokens, "host_tokens": args.host_tokens,
            "page_size": args.page_size, "seed": args.seed}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Hierarchical KV cache tools")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="compare host layouts for a KV geometry")
    add_spec_arguments(p)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("demo", help="multi-turn chat on a tiny Hugging Face model through all three tiers")
    p.add_argument("--model", default="mimo", choices=["mimo", "llama", "deepseek"])
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--storage", default=None, help="storage URL (default: file:// in a temporary directory)")
    p.add_argument("--layout", default="page_first")
    p.add_argument("--device-tokens", type=int, default=448)
    p.add_argument("--host-tokens", type=int, default=768)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--json", default=None, help="write the rows and summary as JSON here")
    p.set_defaults(run=_demo)

    from . import simulate as sim_cli

    p = sub.add_parser("simulate", help="replay a request trace through the cache policy (capacity planning)")
    sim_cli.add_arguments(p)
    p.set_defaults(run=sim_cli.run)

    p = sub.add_parser("selfcheck", help="round-trip random KV through every layout and backend")
    add_spec_arguments(p)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pages", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_selfcheck)

    bench = sub.add_parser("bench", help="benchmarks, each figure a ratio to a limit measured in the same run")
    bsub = bench.add_subparsers(dest="bench", required=True)
    p = bsub.add_parser("transfer", help="device<->host page copies per layout and io backend")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dims", default="128,192/128", help="K[/V] head dims, comma separated (default 128,192/128)")
    p.add_argument("--page-size", default="64", help="page size(s), comma separated, e.g. 16,64,256")
    p.add_argument("--device", default="cpu", help="device pool's device: cpu (default) or cuda")
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--layouts", default="layer_first,page_first,page_first_direct,page_head")
    p.add_argument("--backends", default="direct,kernel")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--meta-pages", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench_transfer)

    p = bsub.add_parser("storage", help="put/get GB/s per storage backend vs its raw client")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--v-head-dim", type=int, default=None)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pages", type=int, default=32)
    p.add_argument("--layout", default="page_head")
    p.add_argument("--backends", default="file,redis,mooncake")
    p.add_argument("--dir", default=None, help="directory for the file backend (default: a temporary one)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench_storage)

    p = bsub.add_parser("cache", help="match_prefix / insert speed over a large tree")
    p.add_argument("--page-sizes", default="16,64")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--tree-pages", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
