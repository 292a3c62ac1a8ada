"""``kvtier bench transfer``: device <-> host page copies per layout and io backend, as ratios to memcpy."""

from __future__ import annotations

import argparse

from ...layout import LAYOUTS
from ...pools.common import check_device
from ...transfer import IO_BACKENDS
from ..preflight import check_device_memory, check_host_memory
from ..table import json_text, print_table
from ..types import int_list, name_list, positive_int
from .args import JSON_HELP, SMALLER, dims


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--dims", type=dims, default="128,192/128",
                   help="K[/V] head dims, comma separated (default 128,192/128)")
    p.add_argument("--page-size", type=int_list, default="64", help="page size(s), comma separated, e.g. 16,64,256")
    p.add_argument("--device", default="cpu", help="device pool's device: cpu (default) or cuda")
    p.add_argument("--pages", type=positive_int, default=256)
    p.add_argument("--layouts", type=name_list(LAYOUTS), default=",".join(LAYOUTS))
    p.add_argument("--backends", type=name_list(IO_BACKENDS), default="direct,kernel")
    p.add_argument("--repeat", type=positive_int, default=3)
    p.add_argument("--meta-pages", type=positive_int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def command(args: argparse.Namespace) -> int:
    from ...bench import transfer

    device = check_device(args.device)
    sizes = dict(layers=args.layers, heads=args.heads, dims=args.dims, page_sizes=args.page_size, pages=args.pages,
                 meta_pages=args.meta_pages)
    host_bytes, device_bytes = transfer.memory_bytes(**sizes)
    what = f"{args.pages} pages of {max(args.page_size)} tokens"
    if device.type == "cuda":
        check_device_memory(device_bytes, device, what, SMALLER)
    else:
        host_bytes += device_bytes
    check_host_memory(host_bytes, what, SMALLER)
    result = transfer.run(**sizes, layouts=args.layouts, backends=args.backends, repeat=args.repeat, seed=args.seed,
                          device=args.device)
    if args.json:
        print(json_text(result))
        return 0
    cfg = result["config"]
    print(f"{cfg['layers']} layers, {cfg['heads']} KV heads, bf16, page sizes {cfg['page_sizes']}, "
          f"{cfg['pages']} pages (of the largest size) in random order on both sides; device {cfg['device_name']}; "
          f"torch threads {cfg['torch_threads']}; CPU copy path {cfg['copy_path']}")
    for key, gbps in result["memcpy_gbps"].items():
        print(f"best memcpy for {key}: backup (device->host) {gbps['backup']:.2f} GB/s, "
              f"load (host->device) {gbps['load']:.2f} GB/s")
    rows = [[r["spec"], r["page_size"], r["layout"], r["io_backend"], r["direction"], f"{r['gbps']:.2f}",
             f"{r['memcpy_gbps']:.2f}", f"{r['ratio']:.2f}x"] for r in result["transfer"]]
    print_table("transfer (ratio = GB/s / GB/s of a memcpy between the same two pools, same direction, same run)",
                ["spec", "page", "layout", "io_backend", "direction", "GB/s", "memcpy GB/s", "x memcpy"], rows)
    rows = [[r["layout"], r["kind"], r["pages"], r["spans"], f"{r['ms']:.3f}"] for r in result["meta"]]
    print_table("span metadata", ["layout", "kind", "pages", "spans", "ms"], rows)
    return 0
