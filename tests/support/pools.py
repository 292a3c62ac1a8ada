"""Shared test data: the geometries every test runs over, and byte-exact helpers."""

from __future__ import annotations

import torch

from kvtier import Attention, Component, DeviceKVPool, HybridSpec, KVGroup, KVSpec

SPECS = {
    "mha": KVSpec.mha(3, 2, 8),
    "mqa": KVSpec.mha(2, 1, 16, dtype=torch.float16),
    "asym": KVSpec.mha(3, 4, 12, v_head_dim=8),  # head_dim != v_head_dim, 3:2 like 192/128
    "mla": KVSpec.mla(2, kv_lora_rank=16, qk_rope_head_dim=4),
    "k_only": KVSpec.k_only(2, 2, 8, dtype=torch.float32),
    "three": KVSpec(2, (Component("k", 2, 8), Component("v", 2, 4), Component("idx", 1, 6)), torch.float32),
}

def _hybrid(full_layers, swa_layers, full_spec, swa_spec, window):
    groups = [KVGroup("swa", tuple(swa_layers), swa_spec, Attention.sliding(window))]
    if full_layers:
        groups.insert(0, KVGroup("full", tuple(full_layers), full_spec))
    return HybridSpec(tuple(groups))


#: Small hybrid geometries (layer group x attention), restated from the real models'
#: patterns: MiMo-V2-Flash (full 0 and 5 of 6, twice the heads on sliding layers, K != V),
#: gpt-oss (alternating), an all-sliding model (Mistral), and windows that are smaller
#: than a page, not a multiple of it, or several pages long (for page sizes 1..8).
HYBRID_SPECS = {
    "mimo": _hybrid((0, 5), (1, 2, 3, 4), KVSpec.mha(2, 2, 12, 8), KVSpec.mha(4, 4, 12, 8), window=6),
    "oss": _hybrid((1, 3), (0, 2), KVSpec.mha(2, 2, 8), KVSpec.mha(2, 2, 8), window=8),
    "all_swa": _hybrid((), (0, 1, 2), None, KVSpec.mha(3, 2, 8, dtype=torch.float16), window=3),
    "long_window": _hybrid((0,), (1, 2), KVSpec.mha(1, 1, 16), KVSpec.mha(2, 2, 4), window=20),
}

LAYOUT_ORDERS = {  # the contract's table, restated independently of kvtier.layout
    "layer_first": ("layer", "page", "slot", "head", "dim"),
    "page_first": ("page", "slot", "layer", "head", "dim"),
    "page_first_direct": ("page", "layer", "slot", "head", "dim"),
    "page_head": ("page", "head", "slot", "layer", "dim"),
}

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as same-width ints so that comparisons are bit-exact (NaN-safe)."""
    return t.view(_INT[t.element_size()])


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    b = bits(t)
    info = torch.iinfo(b.dtype)
    b.copy_(torch.randint(info.min, info.max, b.shape, generator=gen, dtype=torch.int64).to(b.dtype))


def random_device_pool(spec: KVSpec, size: int, page_size: int, seed: int = 0) -> DeviceKVPool:
    pool = DeviceKVPool(spec, size, page_size)
    gen = torch.Generator().manual_seed(seed)
    for name in spec.names:
        for layer in range(spec.layer_num):
            fill_random(pool.buffer(name, layer), gen)
    return pool


def slots(pages: list[int], page_size: int) -> torch.Tensor:
    """Token slots of the given page numbers, in order."""
    return torch.tensor([p * page_size + s for p in pages for s in range(page_size)], dtype=torch.int64)


def logical_page(pool: DeviceKVPool, name: str, first_slot: int, page_size: int) -> torch.Tensor:
    """One device page of a component as ``(slot, layer, head, dim)``."""
    return torch.stack([pool.buffer(name, l)[first_slot:first_slot + page_size]
                        for l in range(pool.spec.layer_num)], dim=1)


def native_order(page: torch.Tensor, layout: str) -> torch.Tensor:
    """``(slot, layer, head, dim)`` page -> the layout's order without the page axis."""
    src = ("slot", "layer", "head", "dim")
    order = [a for a in LAYOUT_ORDERS[layout] if a != "page"]
    return page.permute([src.index(a) for a in order]).contiguous()


def flat_page(pool: DeviceKVPool, first_slot: int, page_size: int) -> torch.Tensor:
    """The canonical flat page: per component ``(layer, slot, head, dim)``, concatenated."""
    return torch.cat([logical_page(pool, n, first_slot, page_size).transpose(0, 1).reshape(-1)
                      for n in pool.spec.names])


def record_copy_threads(monkeypatch) -> tuple[list, list]:
    """Make every copy split across threads (no size threshold). Returns the list the
    numpy path's copy threads are appended to as they start, and the list of the thread
    counts the compiled path was asked to split its calls over."""
    import threading

    from kvtier.transfer import copy as copy_mod
    from kvtier.transfer import native

    started, compiled = [], []

    class CountingThread(threading.Thread):
        def start(self):
            started.append(self)
            super().start()

    real = native.run_jobs

    def counting_copy(jobs, threads):
        compiled.append(threads)
        return real(jobs, threads)

    monkeypatch.setattr(copy_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(copy_mod, "COMPILED_SHARE_MIN_BYTES", 0)
    monkeypatch.setattr(copy_mod.threading, "Thread", CountingThread)
    monkeypatch.setattr(native, "run_jobs", counting_copy)
    return started, compiled
