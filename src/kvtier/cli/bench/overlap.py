"""``kvtier bench overlap``: how much of load_back's per-layer load hides behind compute."""

from __future__ import annotations

import argparse

from ...layout import LAYOUTS
from ...pools.common import check_device
from ...transfer import IO_BACKENDS
from ..preflight import check_device_memory, check_host_memory
from ..table import json_text, print_table
from ..types import int_list, positive_int
from .args import JSON_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ...bench.overlap import DEFAULT_TOKENS

    defaults = "; ".join(f"{kind}: {','.join(map(str, t))}" for kind, t in DEFAULT_TOKENS.items())
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--heads", type=positive_int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--query-heads", type=positive_int, default=None,
                   help="query heads of the compute stand-in (default: --heads; e.g. 32 for GQA 32/8)")
    p.add_argument("--tokens", type=int_list, default=None,
                   help=f"prompt length(s), comma separated, multiples of --page-size (default {defaults})")
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--device", default="cpu", help="device pool's and compute's device: cpu (default), cuda, cuda:N")
    p.add_argument("--layout", default="page_first", choices=list(LAYOUTS), help="host pool layout")
    p.add_argument("--io-backend", default="direct", choices=list(IO_BACKENDS))
    p.add_argument("--repeat", type=positive_int, default=3)
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def command(args: argparse.Namespace) -> int:
    from ...bench import overlap

    device = check_device(args.device)
    tokens = args.tokens or overlap.DEFAULT_TOKENS[device.type]
    overlap.check_tokens(tokens, args.page_size)
    query_heads = args.query_heads or args.heads
    host_bytes, device_bytes = overlap.memory_bytes(layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                                                    query_heads=query_heads, tokens=tokens)
    what = f"a {max(tokens)}-token prompt"
    hint = "use fewer tokens, layers or heads"
    if device.type == "cuda":
        check_device_memory(device_bytes, device, what, hint)
    else:
        host_bytes += device_bytes
    check_host_memory(host_bytes, what, hint)
    result = overlap.run(layers=args.layers, heads=args.heads, head_dim=args.head_dim, query_heads=query_heads,
                         tokens=tokens, page_size=args.page_size, device=args.device, layout=args.layout,
                         io_backend=args.io_backend, repeat=args.repeat)
    if args.json:
        print(json_text(result))
        return 0
    cfg = result["config"]
    print(f"{cfg['spec']}, {cfg['query_heads']} query heads, page_size {cfg['page_size']}, host layout "
          f"{cfg['layout']}, io_backend {cfg['io_backend']}; device {cfg['device_name']}; torch threads "
          f"{cfg['torch_threads']}; {cfg['repeat']} repetitions")
    rows = [[r["tokens"], r["stat"], f"{r['load_ms']:.2f}", f"{r['load_gbps']:.2f}", f"{r['compute_ms']:.2f}",
             f"{r['both_ms']:.2f}", f"{r['hidden']:.0%}", "yes" if r["load_shorter"] else "no"]
            for r in result["rows"]]
    print("hidden = (load + compute - both) / min(load, compute): 100% = the shorter one fully hidden, 0% = none, "
          "below 0 = running both slowed each")
    print_table("overlap of load_back (per-layer waits) with a stand-in attention per layer",
                ["tokens", "stat", "load ms", "load GB/s", "compute ms", "both ms", "hidden", "load < compute"], rows)
    return 0
