"""Best-of-N wall-clock timing and the machine's memcpy limit."""

from __future__ import annotations

import time
from typing import Callable

import torch


def best_seconds(fn: Callable[[], None], repeat: int, warmup: int = 1, cuda: bool = False) -> float:
    """Fastest of ``repeat`` runs after ``warmup`` untimed ones (first touches fault pages in).
    With ``cuda``, each run ends with a device synchronize, so queued copies count."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")

    def run():
        fn()
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        run()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def memcpy_gbps(dst: torch.Tensor, src: torch.Tensor, nbytes: int, repeat: int) -> float:
    """GB/s of one contiguous ``copy_`` of ``nbytes``: a memcpy with all of torch's threads
    on the CPU, one cudaMemcpy between pinned host and device memory on CUDA."""
    d, s = dst.view(torch.uint8)[:nbytes], src.view(torch.uint8)[:nbytes]
    cuda = "cuda" in (d.device.type, s.device.type)
    return nbytes / best_seconds(lambda: d.copy_(s, non_blocking=cuda), repeat, cuda=cuda) / 1e9
