"""The engine-side (L1) KV pool: per layer, token-major ``(size, head, dim)`` buffers."""

from __future__ import annotations

import numpy as np
import torch

from .._checks import index_in_range
from ..errors import UsageError
from ..layout import DEVICE_LAYOUT
from ..spec import KVSpec
from .allocator import PageAllocator
from .common import carve, check_buffers, check_names, check_sizes, check_spec, layout_shapes, parse_device
from .views import PageViews


class DeviceKVPool:
    """KV buffers as an engine holds them: ``buffer(name, layer)`` is ``(size, head, dim)``.

    Either allocated here (one allocation; per component a view in
    :data:`~kvtier.layout.DEVICE_LAYOUT`'s order, ``(layer, page, slot, head, dim)``)
    or wrapping an engine's own tensors with :meth:`from_buffers`.
    ``alloc``/``free`` hand out whole pages of token slots, as the host pool does.
    """

    def __init__(self, spec: KVSpec, size: int, page_size: int, device: str | torch.device = "cpu") -> None:
        check_spec(spec)
        check_sizes(size, page_size)
        dev = parse_device(device)
        self.raw, buffers = carve(spec, layout_shapes(spec, DEVICE_LAYOUT, size // page_size, page_size), device=dev)
        # NOTE: flatten(0, 1) of a layer's (page, slot, head, dim) is a view: slot follows page in memory
        layers = {n: [t.flatten(0, 1) for t in DEVICE_LAYOUT.canonical(b).unbind(2)] for n, b in buffers.items()}
        self._init(spec, size, page_size, dev, layers, buffers)

    @classmethod
    def from_buffers(cls, spec: KVSpec, buffers: dict[str, list[torch.Tensor]], page_size: int) -> "DeviceKVPool":
        """Wrap an engine's per-layer tensors ``{name: [layer0, layer1, ...]}``, each
        ``(size, head, dim)`` of ``spec.dtype``, all on one device. No copy is made."""
        check_spec(spec)
        check_names("buffers", buffers, spec.names, "components")
        first = buffers[spec.names[0]][0] if buffers[spec.names[0]] else None
        if not isinstance(first, torch.Tensor):
            raise UsageError(f"buffers[{spec.names[0]!r}] must be a non-empty list of tensors")
        size = first.shape[0]
        for c in spec.components:
            if len(buffers[c.name]) != spec.layer_num:
                raise UsageError(f"buffers[{c.name!r}] has {len(buffers[c.name])} layers, spec has {spec.layer_num}")
        check_buffers(spec, ((f"buffers[{c.name!r}][{i}]", t, (size, c.head_num, c.head_dim))
                             for c in spec.components for i, t in enumerate(buffers[c.name])))
        check_sizes(size, page_size)
        pool = cls.__new__(cls)
        pool.raw = None
        stacked = {c.name: _stack_view(buffers[c.name], page_size) for c in spec.components}
        pool._init(spec, size, page_size, first.device, {n: list(v) for n, v in buffers.items()}, stacked)
        return pool

    def _init(self, spec, size, page_size, device, layers, buffers) -> None:
        """``layers[name]``: the engine's ``(size, head, dim)`` tensor per layer;
        ``buffers[name]``: all of them as one view in ``DEVICE_LAYOUT``'s order, or ``None``."""
        self.spec = spec
        self.size = size
        self.page_size = page_size
        self.device = device
        self._index_device = torch.device("cpu") if device.type == "meta" else device
        self._layers: dict[str, list[torch.Tensor]] = layers
        self._allocator = PageAllocator(size, page_size, device)
        num_pages = size // page_size
        self.page_views: dict[str, PageViews] = {}
        for c in spec.components:
            buffer = buffers[c.name]
            canon = None if buffer is None else DEVICE_LAYOUT.canonical(buffer)  # (page, slot, layer, head, dim)
            per_layer = tuple(t.unflatten(0, (num_pages, page_size)) for t in layers[c.name])
            self.page_views[c.name] = PageViews.build(canon, per_layer)

    # -- engine view -------------------------------------------------------
    def buffer(self, name: str, layer: int) -> torch.Tensor:
        """``(size, head, dim)`` buffer of component ``name`` at ``layer``."""
        if name not in self._layers:
            raise UsageError(f"unknown component {name!r}; this pool has {list(self._layers)}")
        index_in_range("layer", layer, self.spec.layer_num)
        return self._layers[name][layer]

    @property
    def k_buffer(self) -> list[torch.Tensor]:
        return self._component_layers("k")

    @property
    def v_buffer(self) -> list[torch.Tensor]:
        return self._component_layers("v")

    def _component_layers(self, name: str) -> list[torch.Tensor]:
        if name not in self._layers:
            raise AttributeError(f"this pool has no component {name!r} (components: {list(self._layers)})")
        return list(self._layers[name])

    # -- page allocation ----------------------------------------------------
    @property
    def index_device(self) -> torch.device:
        """Where this pool's slot indices live: its device, or the CPU for a ``meta``
        pool (the simulator's: metadata only, no memory)."""
        return self._index_device

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` token slots in whole pages, on :attr:`index_device`; ``None`` when full."""
        slots = self._allocator.alloc(n)
        if slots is None or self._index_device.type == "cpu":  # the allocator's own are on the CPU
            return slots
        return slots.to(self._index_device)

    def free(self, indices: torch.Tensor) -> None:
        self._allocator.free(indices)

    def allocated_pages(self, page_ids: torch.Tensor | np.ndarray) -> np.ndarray:
        """``(n,)`` bool numpy array: which of the CPU int64 ``page_ids`` (a tensor or numpy
        array) are allocated."""
        return self._allocator.allocated(page_ids)

    def first_unallocated(self, pages: np.ndarray, start: int = 0) -> int:
        """The index of the first of the (valid) int64 page numbers ``pages[start:]`` that
        is not allocated, or -1."""
        return self._allocator.first_free(pages, start)

    def available_size(self) -> int:
        return self._allocator.available_size()

    def alloc_pages(self, k: int):
        """``k`` whole pages as page numbers (int64 numpy), ``None`` when full: what a
        caller that keeps page numbers (the hybrid cache's sliding pages) takes."""
        return self._allocator.alloc_pages(k)

    def free_pages(self, pages) -> None:
        """Return pages by number (int64 numpy), as :meth:`alloc_pages` gave them."""
        self._allocator.free_pages(pages)

    def release_pages(self, pages) -> None:
        """:meth:`free_pages` unchecked, for pages the caller found allocated and distinct
        under its own lock (``PageAllocator.release``)."""
        self._allocator.release(pages)


def _stack_view(layers: list[torch.Tensor], page_size: int) -> torch.Tensor | None:
    """A view in ``DEVICE_LAYOUT``'s order over per-layer ``(size, head, dim)`` tensors when
    they sit in one storage at a constant stride (as engines that slice one allocation
    do); else None."""
    t0 = layers[0]
    (size, heads, dims), (token, head, dim) = t0.shape, t0.stride()
    es = t0.element_size()
    gap = layers[1].data_ptr() - t0.data_ptr() if len(layers) > 1 else size * token * es  # one layer: as unsqueeze
    if len(layers) > 1 and (gap <= 0 or gap % es):
        return None
    for i, t in enumerate(layers):
        same = t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr() and t.stride() == t0.stride()
        if not same or t.data_ptr() - t0.data_ptr() != i * gap:
            return None
    sizes = {"layer": len(layers), "page": size // page_size, "slot": page_size, "head": heads, "dim": dims}
    strides = {"layer": gap // es, "page": page_size * token, "slot": token, "head": head, "dim": dim}
    return t0.as_strided(DEVICE_LAYOUT.shape(sizes), DEVICE_LAYOUT.shape(strides))
