"""``kvtier bench transfer|storage|cache|overlap|replay``: each figure a ratio to a limit measured in the same run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..layout import LAYOUTS
from ..pools.common import check_device
from ..transfer import IO_BACKENDS
from .preflight import check_device_memory, check_host_memory
from .table import json_text, print_table
from .types import int_list, name_list, positive_int

_JSON_HELP = "print the results as JSON (strict: a non-finite number is null)"
_SMALLER = "use fewer or smaller pages, layers or heads"


def _dims(text: str) -> tuple[tuple[int, int], ...]:
    """``"128,192/128"`` -> ``((128, 128), (192, 128))``: K[/V] head dims."""
    dims = []
    for item in text.split(","):
        k, _, v = item.partition("/")
        try:
            k_dim, v_dim = int(k), int(v or k)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: expected K or K/V head dims") from None
        if k_dim <= 0 or v_dim <= 0:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: head dims must be positive")
        dims.append((k_dim, v_dim))
    return tuple(dims)


def add_transfer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--dims", type=_dims, default="128,192/128",
                   help="K[/V] head dims, comma separated (default 128,192/128)")
    p.add_argument("--page-size", type=int_list, default="64", help="page size(s), comma separated, e.g. 16,64,256")
    p.add_argument("--device", default="cpu", help="device pool's device: cpu (default) or cuda")
    p.add_argument("--pages", type=positive_int, default=256)
    p.add_argument("--layouts", type=name_list(LAYOUTS), default=",".join(LAYOUTS))
    p.add_argument("--backends", type=name_list(IO_BACKENDS), default="direct,kernel")
    p.add_argument("--repeat", type=positive_int, default=3)
    p.add_argument("--meta-pages", type=positive_int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help=_JSON_HELP)


def transfer_command(args: argparse.Namespace) -> int:
    from ..bench import transfer

    device = check_device(args.device)
    sizes = dict(layers=args.layers, heads=args.heads, dims=args.dims, page_sizes=args.page_size, pages=args.pages,
                 meta_pages=args.meta_pages)
    host_bytes, device_bytes = transfer.memory_bytes(**sizes)
    what = f"{args.pages} pages of {max(args.page_size)} tokens"
    if device.type == "cuda":
        check_device_memory(device_bytes, device, what, _SMALLER)
    else:
        host_bytes += device_bytes
    check_host_memory(host_bytes, what, _SMALLER)
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
        print(f"memcpy limit for {key}: backup (device->host) {gbps['backup']:.2f} GB/s, "
              f"load (host->device) {gbps['load']:.2f} GB/s")
    rows = [[r["spec"], r["page_size"], r["layout"], r["io_backend"], r["direction"], f"{r['gbps']:.2f}",
             f"{r['ratio']:.2f}x"] for r in result["transfer"]]
    print_table("transfer (ratio = GB/s / same-direction memcpy GB/s, same run)",
                ["spec", "page", "layout", "io_backend", "direction", "GB/s", "x memcpy"], rows)
    rows = [[r["layout"], r["kind"], r["pages"], r["spans"], f"{r['ms']:.3f}"] for r in result["meta"]]
    print_table("span metadata", ["layout", "kind", "pages", "spans", "ms"], rows)
    return 0


def _count(text: str) -> int:
    """A non-negative integer (``--load 0`` is no load)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def add_meta_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--heads", type=positive_int, default=8, help="KV heads; split-heads runs the factors 2, 4, 8 "
                   "that divide it (default 8)")
    p.add_argument("--dims", type=_dims, default="192/128", help="K[/V] head dims, comma separated (default 192/128)")
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--pages", type=positive_int, default=4096)
    p.add_argument("--layouts", type=name_list(LAYOUTS), default=",".join(LAYOUTS))
    p.add_argument("--repeat", type=positive_int, default=50, help="timed calls per row (default 50)")
    p.add_argument("--load", type=_count, default=0,
                   help="CPU-bound processes (a Python busy loop each) running during the timing (default 0)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help=_JSON_HELP)


def meta_command(args: argparse.Namespace) -> int:
    from ..bench import meta

    cpus = os.cpu_count() or 1
    if args.load > 4 * cpus:
        raise ValueError(f"--load {args.load}: more than 4 busy processes per CPU ({4 * cpus} here)")
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


def add_storage_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.storage import BACKENDS

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
                   help="kvtier's io_threads for file and Redis (default 2, the storage default); raw uses one")
    p.add_argument("--json", action="store_true", help=_JSON_HELP)


def storage_command(args: argparse.Namespace) -> int:
    from ..bench import storage

    if args.dir is not None and not Path(args.dir).is_dir():
        raise ValueError(f"--dir {args.dir}: not an existing directory")
    sizes = dict(layers=args.layers, heads=args.heads, head_dim=args.head_dim, v_head_dim=args.v_head_dim,
                 page_size=args.page_size, pages=args.pages)
    check_host_memory(storage.memory_bytes(**sizes, backends=args.backends),
                      f"{args.pages} pages of {args.page_size} tokens", _SMALLER)
    result = storage.run(**sizes, layout=args.layout, backends=args.backends, directory=args.dir, repeat=args.repeat,
                         io_threads=args.io_threads)
    if args.json:
        print(json_text(result))
        return 0
    cfg = result["config"]
    print(f"{cfg['spec']}, page_size {cfg['page_size']}, {cfg['pages']} pages ({cfg['objects_per_page']} objects "
          f"each), layout {cfg['layout']}, io_threads {cfg['io_threads']}; raw = the backend's own client moving "
          f"the same objects")
    rows = [[r["backend"], r["op"], r["objects"], f"{r['gbytes']:.3f}", f"{r['kvtier_gbps']:.2f}",
             f"{r['raw_gbps']:.2f}", f"{r['ratio']:.2f}x"] for r in result["rows"]]
    print_table("storage (ratio = kvtier GB/s / raw client GB/s, same run)",
                ["backend", "op", "objects", "GB", "kvtier GB/s", "raw GB/s", "x raw"], rows)
    for name, why in result["skipped"].items():
        print(f"skipped {name}: {why}")
    return 0


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-sizes", type=int_list, default="16,64")
    p.add_argument("--prompt-tokens", type=positive_int, default=8192,
                   help="tokens per prompt, a multiple of every page size (default 8192)")
    p.add_argument("--tree-pages", type=positive_int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help=_JSON_HELP)


def cache_command(args: argparse.Namespace) -> int:
    from ..bench import cache

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


def add_overlap_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.overlap import DEFAULT_TOKENS

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
    p.add_argument("--json", action="store_true", help=_JSON_HELP)


def overlap_command(args: argparse.Namespace) -> int:
    from ..bench import overlap

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


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.replay import DEFAULT_TRACE

    p.add_argument("trace", nargs="?", default=None,
                   help=f"Mooncake-format jsonl (default {DEFAULT_TRACE}, where it exists)")
    p.add_argument("--times", type=positive_int, default=3,
                   help="copies of the trace replayed one after another, ids remapped (default 3: ~12k requests)")
    p.add_argument("--policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--repeat", type=positive_int, default=3, help="replays timed, best kept (default 3)")
    p.add_argument("--json", action="store_true", help=_JSON_HELP)


def replay_command(args: argparse.Namespace) -> int:
    from ..bench import replay
    from .preflight import check_input_file

    trace = args.trace
    if trace is None:
        if not replay.DEFAULT_TRACE.is_file():
            raise ValueError(f"no trace given and {replay.DEFAULT_TRACE} does not exist here; pass a Mooncake-format "
                             "jsonl trace")
        trace = str(replay.DEFAULT_TRACE)
    check_input_file(trace, "trace")
    try:
        result = replay.run(trace, times=args.times, policy=args.policy, repeat_runs=args.repeat)
    except OSError as e:
        raise ValueError(f"trace {trace}: {e.strerror or e}") from None
    if args.json:
        print(json_text(result))
        return 0
    cfg, hits = result["config"], result["hits"]
    print(f"{cfg['trace']} x{cfg['times']}: {cfg['requests']:,} requests, {cfg['blocks']:,} blocks of "
          f"{cfg['block_tokens']} tokens; device {cfg['device_tokens']:,.0f}, host {cfg['host_tokens']:,.0f}, storage "
          f"{cfg['storage_tokens']:,.0f} tokens, {cfg['policy']}; read in {result['read_s']:.2f} s")
    print("floor = one Python pass looking every full block of every prompt up in a dict (adding the missing ones)")
    rows = [[f"{result['replay_s']:.2f}", f"{result['requests_per_s']:,.0f}", f"{result['floor_s']:.3f}",
             f"{result['x_floor']:.0f}x", result["digest"] or "differs between runs"]]
    print_table(f"replay (best of {cfg['repeat']}; x floor = replay s / floor s, same run)",
                ["replay s", "requests/s", "floor s", "x floor", "digest"], rows)
    print(f"hits (tokens): device {hits['device_hit']:,}, host {hits['host_hit']:,}, storage {hits['storage_hit']:,}; "
          f"infinite bound {hits['bound']:,}")
    return 0 if result["identical"] else 1


#: name -> (help, add_arguments, command)
SUBCOMMANDS = {
    "transfer": ("device<->host page copies per layout and io backend", add_transfer_arguments, transfer_command),
    "meta": ("span metadata (page buffer and split-heads) p50/p90 vs a floor, optionally under CPU load",
             add_meta_arguments, meta_command),
    "storage": ("put/get GB/s per storage backend vs its raw client", add_storage_arguments, storage_command),
    "cache": ("match_prefix / insert speed over a large tree", add_cache_arguments, cache_command),
    "overlap": ("how much of load_back's per-layer host->device load hides behind compute", add_overlap_arguments,
                overlap_command),
    "replay": ("kvtier simulate's replay speed on a 12k-request trace", add_replay_arguments, replay_command),
}
