"""``kvtier selfcheck``: move random KV through every layout and io backend and compare bytes.

For a geometry (default: MiMo-V2-Flash-like, K 192 / V 128), each layout x backend:
device -> host (all layers) -> flat page -> a host pool of the *next* layout -> device
(per layer), then the device pages must equal the originals bit for bit.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..layout import LAYOUTS
from ..pools import DeviceKVPool, HostKVPool
from ..spec import KVSpec
from ..transfer import IO_BACKENDS
from ..transfer.copy import int_view as _bits
from .preflight import check_host_memory
from .spec import add_spec_arguments, has_spec, uniform_spec_from_args
from .table import print_table
from .types import positive_int, seed

#: Pools alive at once: the source, and the previous and the next round's host, other and
#: destination pools (a pool is freed only when its name is rebound).
_POOLS_AT_PEAK = 7


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_spec_arguments(p)
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--pages", type=positive_int, default=8)
    p.add_argument("--seed", type=seed, default=0)


def default_spec() -> KVSpec:
    return KVSpec.mha(8, 4, 192, v_head_dim=128)  # MiMo-V2-Flash-like K/V dims, few layers


def command(args: argparse.Namespace) -> int:
    spec = uniform_spec_from_args(args, "selfcheck") if has_spec(args) else default_spec()
    check_host_memory(memory_bytes(spec, args.page_size, args.pages),
                      f"{args.pages} pages of {args.page_size} tokens of {spec.fingerprint()}",
                      "use fewer or smaller pages")
    print(f"round trip device -> host -> flat page -> other layout -> device, spec {spec.fingerprint()}")
    rows = run(spec, page_size=args.page_size, pages=args.pages, seed=args.seed)
    print_table("self-check (bytes compared bit for bit)", ["layouts", "io_backend", "result", "ms"],
                [[r["layout"], r["io_backend"], "identical" if r["ok"] else "MISMATCH", f"{r['ms']:.1f}"]
                 for r in rows])
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed} of {len(rows)} round trips identical")
    return 1 if failed else 0


def memory_bytes(spec: KVSpec, page_size: int, pages: int) -> int:
    """Host memory :func:`run` takes at its peak."""
    return _POOLS_AT_PEAK * pages * page_size * spec.bytes_per_token


def run(spec: KVSpec, page_size: int = 16, pages: int = 8, seed: int = 0) -> list[dict]:
    """One result row per layout x backend: ``{"layout", "io_backend", "ok", "ms"}``."""
    gen = torch.Generator().manual_seed(seed)
    size = pages * page_size
    src = DeviceKVPool(spec, size, page_size)
    for name in spec.names:
        for layer in range(spec.layer_num):
            b = _bits(src.buffer(name, layer))
            b.copy_(torch.randint(-100, 100, b.shape, generator=gen).to(b.dtype))
    names = list(LAYOUTS)
    rows = []
    for i, layout in enumerate(names):
        for backend in IO_BACKENDS:
            t0 = time.perf_counter()
            host = HostKVPool(spec, size, page_size, layout=layout, pin_memory=False)
            other = HostKVPool(spec, size, page_size, layout=names[(i + 1) % len(names)], pin_memory=False)
            host_idx = host.alloc(size)
            dev_idx = torch.randperm(pages, generator=gen)[:, None] * page_size + torch.arange(page_size)
            dev_idx = dev_idx.reshape(-1)
            host.backup_from_device_all_layer(src, host_idx, dev_idx, io_backend=backend)
            for p in range(0, size, page_size):
                other.set_from_flat_data_page(p, host.get_data_page(p))
            dst = DeviceKVPool(spec, size, page_size)
            for layer in range(spec.layer_num):
                other.load_to_device_per_layer(dst, host_idx, dev_idx, layer, io_backend=backend)
            ok = all(torch.equal(_bits(dst.buffer(n, l)), _bits(src.buffer(n, l)))
                     for n in spec.names for l in range(spec.layer_num))
            rows.append({"layout": f"{layout} -> {other.layout}", "io_backend": backend, "ok": ok,
                         "ms": (time.perf_counter() - t0) * 1e3})
    return rows
