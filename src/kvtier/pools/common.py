"""Argument checks and byte-buffer carving shared by the device and host pools."""

from __future__ import annotations

import torch

from ..errors import UsageError
from ..spec import KVSpec
from .memory import pool_bytes

_ALIGN = 4096  # component offsets inside one allocation: page-aligned for pinning/registration


def check_sizes(size: object, page_size: object) -> None:
    for field, value in (("size", size), ("page_size", page_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UsageError(f"{field} must be a positive int, got {value!r}")
    if size % page_size:
        raise UsageError(f"size {size} is not a multiple of page_size {page_size}")


def parse_device(device: object) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"invalid device {device!r}: {e}") from None


def check_device(device: str) -> torch.device:
    """A device for a pool and the computation on it: ``cpu``, or a CUDA device that exists
    here; ``ValueError`` otherwise, before anything is allocated."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"device {device!r}: expected cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"device {device!r}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {device!r}: CUDA is not available here (a CPU-only torch build, or no GPU "
                             "visible); use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return dev


def check_spec(spec: object) -> KVSpec:
    if not isinstance(spec, KVSpec):
        raise UsageError(f"spec must be a KVSpec, got {type(spec).__name__}")
    return spec


def carve(spec: KVSpec, shapes: dict[str, tuple[int, ...]], *, device: torch.device,
          pin_memory: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One allocation holding every component, each a view of ``shapes[name]``.

    Returns ``(raw uint8 buffer, {name: typed view})``. Each component starts at a
    4 KiB-aligned address: the allocation is aligned too, not only the offsets.
    """
    offsets, total = {}, 0
    for c in spec.components:
        offsets[c.name] = total
        nbytes = spec.element_size
        for n in shapes[c.name]:
            nbytes *= n
        total += -(-nbytes // _ALIGN) * _ALIGN
    raw = pool_bytes(total, device=device, pin_memory=pin_memory)  # aligned (see memory.py)
    views = {}
    for c in spec.components:
        shape = shapes[c.name]
        nbytes = spec.element_size * torch.Size(shape).numel()
        start = offsets[c.name]
        views[c.name] = raw[start:start + nbytes].view(spec.dtype).view(shape)
    return raw, views
