"""``kvtier bench storage``: put/get GB/s per storage backend against its own raw client."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...errors import UsageError
from ...layout import LAYOUTS
from ..preflight import check_host_memory
from ..table import json_text, print_table
from ..types import name_list, positive_int
from .args import JSON_HELP, SMALLER


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ...bench.storage import BACKENDS
    from ...storage.cold_reads import CHOICES as COLD_CHOICES

    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--v-head-dim", type=positive_int, default=None)
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--pages", type=positive_int, default=32)
    p.add_argument("--layout", default="page_head", choices=list(LAYOUTS))
    p.add_argument("--backends", type=name_list(BACKENDS), default=",".join(BACKENDS),
                   help=f"comma separated, from {', '.join(BACKENDS)} (default all)")
    p.add_argument("--dir", default=None, help="existing directory for the file backend (default: a temporary one)")
    p.add_argument("--repeat", type=positive_int, default=3)
    p.add_argument("--io-threads", type=positive_int, default=2,
                   help="kvtier's io_threads for file and Redis (default 2, the storage default); raw files use "
                        "as many threads, raw Redis one pipeline")
    p.add_argument("--direct-writes", action="store_true",
                   help="open the file store with direct_writes (O_DIRECT puts where aligned)")
    p.add_argument("--cold-reads", default="auto", choices=list(COLD_CHOICES),
                   help="the file store's cold_reads: auto (default) learns from its first cold batches, which the "
                        "cold get's rounds include; staged or in_place times one way alone")
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def command(args: argparse.Namespace) -> int:
    from ...bench import storage

    if args.dir is not None and not Path(args.dir).is_dir():
        raise UsageError(f"--dir {args.dir}: not an existing directory")
    sizes = dict(layers=args.layers, heads=args.heads, head_dim=args.head_dim, v_head_dim=args.v_head_dim,
                 page_size=args.page_size, pages=args.pages)
    check_host_memory(storage.memory_bytes(**sizes, backends=args.backends),
                      f"{args.pages} pages of {args.page_size} tokens", SMALLER)
    result = storage.run(**sizes, layout=args.layout, backends=args.backends, directory=args.dir, repeat=args.repeat,
                         io_threads=args.io_threads, direct_writes=args.direct_writes, cold_reads=args.cold_reads)
    if args.json:
        print(json_text(result))
        return 0
    cfg = result["config"]
    per_page = ", ".join(f"{n} {b}" for b, n in cfg["objects_per_page"].items())
    print(f"{cfg['spec']}, page_size {cfg['page_size']}, {cfg['pages']} pages (objects per page: {per_page}), "
          f"layout {cfg['layout']}, io_threads {cfg['io_threads']}, cold_reads {cfg['cold_reads']}; raw = the "
          f"backend's own client moving the same objects")
    rows = [[r["backend"], r["op"], r["objects"], f"{r['gbytes']:.3f}", f"{r['kvtier_gbps']:.2f}",
             f"{r['raw_gbps']:.2f}", f"{r['ratio']:.2f}x", f"{r['median_ratio']:.2f}x"] for r in result["rows"]]
    print_table("storage (ratio = kvtier GB/s / raw client's or peer's GB/s, same run; GB/s of the best rounds, "
                "and the ratio of the median ones)",
                ["backend", "op", "objects", "GB", "kvtier GB/s", "raw/peer GB/s", "x raw/peer", "x median"], rows)
    for name, why in result["skipped"].items():
        print(f"skipped {name}: {why}")
    advice = storage.write_mode_advice(result)
    if advice:
        print(advice)
    return 0
