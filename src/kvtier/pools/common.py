"""Argument checks and byte-buffer carving shared by the device and host pools."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from .._checks import positive_ints
from ..errors import UsageError
from ..layout import Layout
from ..spec import KVSpec
from .memory import pool_bytes

_ALIGN = 4096  # component offsets inside one allocation: page-aligned for pinning/registration


def check_sizes(size: object, page_size: object) -> None:
    positive_ints(("size", size), ("page_size", page_size))
    if size % page_size:
        raise UsageError(f"size {size} is not a multiple of page_size {page_size}")


def layout_shapes(spec: KVSpec, layout: Layout, num_pages: int, page_size: int) -> dict[str, tuple[int, ...]]:
    """Each component's buffer shape in ``layout``'s axis order."""
    sizes = {"page": num_pages, "slot": page_size, "layer": spec.layer_num}
    return {c.name: layout.shape({**sizes, "head": c.head_num, "dim": c.head_dim}) for c in spec.components}


def check_names(what: str, mapping: object, names, kind: str) -> None:
    """``ValueError`` unless ``mapping`` is a mapping whose keys are exactly ``names``
    (``kind``: what they name, e.g. ``"components"``)."""
    if not isinstance(mapping, Mapping) or set(mapping) != set(names):
        got = sorted(mapping) if isinstance(mapping, Mapping) else type(mapping).__name__
        raise UsageError(f"{what} must map exactly the {kind} {list(names)}, got {got}")


def check_buffers(spec: KVSpec, buffers: Iterable[tuple[str, object, tuple[int, ...]]], needs: str = "") -> None:
    """An engine's tensors, as ``from_buffers`` takes them: each ``(where, tensor, shape)``
    of ``buffers`` a tensor of that shape and ``spec.dtype``, on the first one's device;
    ``ValueError`` naming the first mismatch (``where``; ``needs`` says why that shape)."""
    first_where = first = None
    for where, t, shape in buffers:
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{where} is {type(t).__name__}, not a tensor")
        if first is None:
            first_where, first = where, t
        if tuple(t.shape) != shape:
            raise UsageError(f"{where} has shape {tuple(t.shape)}, expected {shape}{needs}")
        if t.dtype != spec.dtype:
            raise UsageError(f"{where} has dtype {t.dtype}, spec has {spec.dtype}")
        if t.device != first.device:
            raise UsageError(f"{where} is on {t.device}, {first_where} on {first.device}")


def parse_device(device: object) -> torch.device:
    try:
        return _indexed(torch.device(device))
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"invalid device {device!r}: {e}") from None


def _indexed(dev: torch.device) -> torch.device:
    """``cuda`` as the CUDA device it means now (``cuda:N``): the tensors made there say
    ``cuda:N``, and a pool that kept ``cuda`` refused its own indices as on another
    device (``torch.device`` compares the index too)."""
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


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
    return _indexed(dev)


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
