"""Best-of-N wall-clock timing and the machine's memcpy limit."""

from __future__ import annotations

import time
from typing import Callable

import torch


def best_seconds(fn: Callable[[], None], repeat: int, warmup: int = 1) -> float:
    """Fastest of ``repeat`` runs after ``warmup`` untimed ones (first touches fault pages in)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def memcpy_gbps(dst: torch.Tensor, src: torch.Tensor, nbytes: int, repeat: int) -> float:
    """GB/s of one contiguous ``copy_`` of ``nbytes`` (torch uses all its threads)."""
    d, s = dst.view(torch.uint8)[:nbytes], src.view(torch.uint8)[:nbytes]
    return nbytes / best_seconds(lambda: d.copy_(s), repeat) / 1e9
