"""``kvtier selfcheck``: move random KV through every layout and io backend and compare bytes.

For a geometry (default: MiMo-V2-Flash-like, K 192 / V 128), each layout x backend:
device -> host (all layers) -> flat page -> a host pool of the *next* layout -> device
(per layer), then the device pages must equal the originals bit for bit.
"""

from __future__ import annotations

import time

import torch

from ..layout import LAYOUTS
from ..pools import DeviceKVPool, HostKVPool
from ..spec import KVSpec
from ..transfer import IO_BACKENDS
from ..transfer.copy import int_view as _bits


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
