"""What a piece of code leaves allocated: for memory the compiled parts hand to torch."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Callable

import torch
from torch.utils.dlpack import from_dlpack


def left_after(step: Callable[[], None], times: int) -> int:
    """Bytes still allocated (as ``tracemalloc`` sees them: Python's allocators, the raw
    one among them) after ``step`` ran ``times`` times and the garbage was collected."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(times):
            step()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def capsule_tensor(capsule) -> torch.Tensor:
    """The 1-D int64 CPU tensor of a compiled part's DLPack capsule of slots (taken once)."""
    tensor = from_dlpack(capsule)
    assert tensor.dtype == torch.int64 and tensor.device.type == "cpu" and tensor.is_contiguous()
    assert tensor.dim() == 1
    return tensor
