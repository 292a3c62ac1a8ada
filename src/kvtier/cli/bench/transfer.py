"""``kvtier bench transfer``: device <-> host page copies per layout and io backend, as ratios to the
machine's fastest contiguous copy of the same bytes in the same run.

The default geometries are bf16 MHA specs (``--layers``, ``--heads``, ``--dims``); a
geometry option (``--spec``, ``--mha``, ...) names one instead. A hybrid spec
(``--spec mimo-v2-flash``, ``hybrid:...``) runs the group-aware bench of
:mod:`kvtier.bench.transfer_hybrid`: one resume point, sliding groups moving one window.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Callable, NamedTuple

from ...errors import UsageError
from ...hybrid import Attention, HybridSpec
from ...layout import LAYOUTS
from ...pools.common import check_device
from ...spec import DTYPE_NAMES, KVSpec, parse_dtype
from ...transfer import IO_BACKENDS
from ..preflight import check_device_memory, check_host_memory
from ..spec import add_spec_arguments, attention_text, has_spec, spec_from_args
from ..table import json_text, print_table
from ..types import int_list, name_list, positive_int, seed
from .args import JSON_HELP, SMALLER, dims

DEFAULTS = {"layers": 32, "heads": 8, "dims": ((128, 128), (192, 128)), "meta_pages": 4096}
_GEOMETRY_FLAGS = {"layers": "--layers", "heads": "--heads", "dims": "--dims"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_spec_arguments(p)
    p.add_argument("--layers", type=positive_int, default=None,
                   help=f"layers of the default geometries (default {DEFAULTS['layers']})")
    p.add_argument("--heads", type=positive_int, default=None,
                   help=f"KV heads of the default geometries (default {DEFAULTS['heads']})")
    p.add_argument("--dims", type=dims, default=None,
                   help="K[/V] head dims of the default geometries, comma separated (default 128,192/128)")
    p.add_argument("--page-size", type=int_list, default="64", help="page size(s), comma separated, e.g. 16,64,256")
    p.add_argument("--device", default="cpu", help="device pool's device: cpu (default) or cuda")
    p.add_argument("--pages", type=positive_int, default=256,
                   help="pages (of the largest page size) per pool; a hybrid spec resumes after that many "
                        "(default 256)")
    p.add_argument("--layouts", type=name_list(LAYOUTS), default=",".join(LAYOUTS))
    p.add_argument("--backends", type=name_list(IO_BACKENDS), default="direct,kernel")
    p.add_argument("--repeat", type=positive_int, default=3)
    p.add_argument("--meta-pages", type=positive_int, default=None,
                   help=f"pages of span metadata timed (default {DEFAULTS['meta_pages']}; not for a hybrid spec)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def geometry(args: argparse.Namespace) -> KVSpec | HybridSpec | None:
    """The spec a geometry option names, or ``None`` for the default geometries. A
    combination that would leave an option unused is a ``UsageError``."""
    given = [flag for key, flag in _GEOMETRY_FLAGS.items() if getattr(args, key) is not None]
    if not has_spec(args):
        if DTYPE_NAMES.get(parse_dtype(args.dtype)) != "bf16":
            raise UsageError(f"--dtype {args.dtype} applies to --spec, --mha, --mla, --k-only or --components; "
                             "the default geometries (--layers, --heads, --dims) are bf16")
        return None
    if given:
        raise UsageError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for the default geometries; a "
                         "--spec, --mha, --mla, --k-only or --components geometry has its own sizes: give one or the "
                         "other")
    spec = spec_from_args(args)
    if isinstance(spec, HybridSpec) and args.meta_pages is not None:
        raise UsageError("--meta-pages times span metadata of the default or a uniform geometry; a hybrid spec's "
                         "run times its transfers only: drop --meta-pages")
    return spec


class _Plan(NamedTuple):
    """One run, sized before it starts: its peak memory, how to start it and how to print it."""

    host_bytes: int
    device_bytes: int
    what: str  # the sizes, for a refusal
    hint: str
    start: Callable[[], dict]
    report: Callable[[dict, bool], int]


def command(args: argparse.Namespace) -> int:
    device = check_device(args.device)
    spec = geometry(args)
    plan = (_hybrid_plan if isinstance(spec, HybridSpec) else _uniform_plan)(spec, args)
    host_bytes = plan.host_bytes
    if device.type == "cuda":
        check_device_memory(plan.device_bytes, device, plan.what, plan.hint)
    else:
        host_bytes += plan.device_bytes
    check_host_memory(host_bytes, plan.what, plan.hint)
    return plan.report(plan.start(), args.json)


def _options(args: argparse.Namespace) -> dict:
    return dict(page_sizes=args.page_size, pages=args.pages, layouts=args.layouts, backends=args.backends,
                repeat=args.repeat, seed=args.seed, device=args.device)


def _uniform_plan(spec: KVSpec | None, args: argparse.Namespace) -> _Plan:
    """The default geometries (``spec`` ``None``) or one plain spec."""
    from ...bench import transfer

    sizes = dict(page_sizes=args.page_size, pages=args.pages, meta_pages=args.meta_pages or DEFAULTS["meta_pages"])
    what = f"{args.pages} pages of {max(args.page_size)} tokens"
    if spec is None:
        mha = {key: DEFAULTS[key] if getattr(args, key) is None else getattr(args, key) for key in _GEOMETRY_FLAGS}
        memory = transfer.memory_bytes(**mha, **sizes)
        start = partial(transfer.run, **mha, **_options(args), meta_pages=sizes["meta_pages"])
    else:
        memory = transfer.uniform_memory_bytes((spec,), **sizes)
        what += f" of {spec.fingerprint()}"
        start = partial(transfer.run_uniform, (spec,), {"spec": spec.fingerprint()}, **_options(args),
                        meta_pages=sizes["meta_pages"])
    return _Plan(*memory, what, SMALLER, start, _uniform)


def _hybrid_plan(spec: HybridSpec, args: argparse.Namespace) -> _Plan:
    from ...bench import transfer_hybrid

    sizes = dict(page_sizes=args.page_size, pages=args.pages)
    tokens = transfer_hybrid.check_hybrid(spec, **sizes)
    return _Plan(*transfer_hybrid.hybrid_memory_bytes(spec, **sizes),
                 f"a prefix of {tokens:,} tokens ({args.pages} pages of {max(args.page_size)}) in every layer group",
                 "use fewer or smaller pages", partial(transfer_hybrid.run_hybrid, spec, **_options(args)), _hybrid)


def _path(cfg: dict) -> str:
    stores = cfg.get("store_bytes")
    return f"{cfg['copy_path']} ({stores}-byte streaming stores)" if stores else cfg["copy_path"]


def _uniform(result: dict, as_json: bool) -> int:
    if as_json:
        print(json_text(result))
        return 0
    cfg = result["config"]
    what = f"spec {cfg['spec']}" if "spec" in cfg else f"{cfg['layers']} layers, {cfg['heads']} KV heads"
    print(f"{what}, {cfg['dtype']}, page sizes {cfg['page_sizes']}, "
          f"{cfg['pages']} pages (of the largest size) in random order on both sides; device {cfg['device_name']}; "
          f"torch threads {cfg['torch_threads']}; CPU copy path {_path(cfg)}")
    for key, gbps in result["memcpy_gbps"].items():
        print(f"best memcpy for {key}: backup (device->host) {gbps['backup']:.2f} GB/s, "
              f"load (host->device) {gbps['load']:.2f} GB/s")
    rows = [[r["spec"], r["page_size"], r["layout"], r["io_backend"], r["direction"], f"{r['gbps']:.2f}",
             f"{r['memcpy_gbps']:.2f}", f"{r['ratio']:.2f}x"] for r in result["transfer"]]
    print_table("transfer (ratio = GB/s / the limit: the fastest contiguous copy of the same bytes this run saw, "
                "torch's copy_ or kvtier's compiled one, between the row's two pools or a fresh written pair)",
                ["spec", "page", "layout", "io_backend", "direction", "GB/s", "limit GB/s", "x limit"], rows)
    rows = [[r["layout"], r["kind"], r["pages"], r["spans"], f"{r['ms']:.3f}"] for r in result["meta"]]
    print_table("span metadata", ["layout", "kind", "pages", "spans", "ms"], rows)
    return 0


def _hybrid(result: dict, as_json: bool) -> int:
    """Print a hybrid run; 1 when the bytes its copies wrote differ from ``HybridSpec.bytes_for``."""
    failed = 0 if result["bytes"]["copied_equal"] else 1
    if as_json:
        print(json_text(result))
        return failed
    cfg, b = result["config"], result["bytes"]
    groups = ", ".join(f"{g['name']} ({attention_text(_attention(g))}, layers {g['layers']}: "
                       f"{g['bytes_per_token']:,} B per token)" for g in cfg["groups"])
    print(f"hybrid spec: {groups}; {cfg['dtype']}; page sizes {cfg['page_sizes']}; one resume point after "
          f"{cfg['prefix_tokens']:,} tokens ({cfg['pages']} pages of the largest size): full groups move every page, "
          f"sliding groups the pages of one window, in random order on both sides; device {cfg['device_name']}; "
          f"torch threads {cfg['torch_threads']}; CPU copy path {_path(cfg)}")
    for key, pages in result["pages_moved"].items():
        gbps = result["memcpy_gbps"][key]
        print(f"{key}: pages moved {', '.join(f'{n} {p}' for n, p in pages.items())}; best memcpy backup "
              f"(device->host) {gbps['backup']:.2f} GB/s, load (host->device) {gbps['load']:.2f} GB/s")
    rows = [[r["page_size"], r["layout"], r["io_backend"], r["direction"], f"{r['gbps']:.2f}",
             f"{r['memcpy_gbps']:.2f}", f"{r['ratio']:.2f}x"] for r in result["transfer"]]
    print_table("transfer per resume point (ratio = GB/s / the limit: the fastest contiguous copy of each group's "
                "bytes this run saw, between its two pools or a fresh written pair, same direction)",
                ["page", "layout", "io_backend", "direction", "GB/s", "limit GB/s", "x limit"], rows)
    tokens = b["tokens"]
    print(f"bytes: {b['full_bytes_per_token']:,} B per cached token (full groups) + {b['window_bytes']:,} B per "
          f"resume point (sliding windows); at {tokens:,} tokens a hybrid-aware transfer moves {b['hybrid_bytes']:,} B "
          f"({b['hybrid_bytes_per_token']:,.0f} B per token), a window-blind one {b['window_blind_bytes']:,} B "
          f"({b['window_blind_bytes_per_token']:,} B per token), {b['window_blind_ratio']:.2f}x as many")
    copied = "; ".join(f"{key} backup {c['backup']:,} B, load {c['load']:,} B, load runs {c['load runs']:,} B"
                       for key, c in b["copied"].items())
    verdict = "equal" if not failed else "MISMATCH: not equal"
    print(f"bytes copied (counted in the pools): {copied}; {verdict} to HybridSpec.bytes_for({tokens}, 1) = "
          f"{b['hybrid_bytes']:,} B")
    return failed


def _attention(group: dict) -> Attention:
    return Attention(group["attention"], group["window"])
