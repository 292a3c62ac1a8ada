"""The engine-side (L1) KV pool: per layer, token-major ``(size, head, dim)`` buffers."""

from __future__ import annotations

import torch

from ..errors import UsageError
from ..spec import KVSpec
from .allocator import PageAllocator
from .common import carve, check_sizes, check_spec, parse_device
from .views import PageViews


class DeviceKVPool:
    """KV buffers as an engine holds them: ``buffer(name, layer)`` is ``(size, head, dim)``.

    Either allocated here (one allocation; per-component ``(layer, size, head, dim)``
    views) or wrapping an engine's own tensors with :meth:`from_buffers`.
    ``alloc``/``free`` hand out whole pages of token slots, as the host pool does.
    """

    def __init__(self, spec: KVSpec, size: int, page_size: int, device: str | torch.device = "cpu") -> None:
        check_spec(spec)
        check_sizes(size, page_size)
        dev = parse_device(device)
        shapes = {c.name: (spec.layer_num, size, c.head_num, c.head_dim) for c in spec.components}
        self.raw, stacked = carve(spec, shapes, device=dev)
        self._init(spec, size, page_size, dev, {n: list(t.unbind(0)) for n, t in stacked.items()}, stacked)

    @classmethod
    def from_buffers(cls, spec: KVSpec, buffers: dict[str, list[torch.Tensor]], page_size: int) -> "DeviceKVPool":
        """Wrap an engine's per-layer tensors ``{name: [layer0, layer1, ...]}``, each
        ``(size, head, dim)`` of ``spec.dtype``, all on one device. No copy is made."""
        check_spec(spec)
        if not isinstance(buffers, dict) or set(buffers) != set(spec.names):
            got = sorted(buffers) if isinstance(buffers, dict) else type(buffers).__name__
            raise UsageError(f"buffers must map exactly the components {list(spec.names)}, got {got}")
        first = buffers[spec.names[0]][0] if buffers[spec.names[0]] else None
        if not isinstance(first, torch.Tensor):
            raise UsageError(f"buffers[{spec.names[0]!r}] must be a non-empty list of tensors")
        size = first.shape[0]
        for c in spec.components:
            layers = buffers[c.name]
            if len(layers) != spec.layer_num:
                raise UsageError(f"buffers[{c.name!r}] has {len(layers)} layers, spec has {spec.layer_num}")
            for i, t in enumerate(layers):
                where = f"buffers[{c.name!r}][{i}]"
                if not isinstance(t, torch.Tensor):
                    raise UsageError(f"{where} is {type(t).__name__}, not a tensor")
                if tuple(t.shape) != (size, c.head_num, c.head_dim):
                    raise UsageError(f"{where} has shape {tuple(t.shape)}, expected {(size, c.head_num, c.head_dim)}")
                if t.dtype != spec.dtype:
                    raise UsageError(f"{where} has dtype {t.dtype}, spec has {spec.dtype}")
                if t.device != first.device:
                    raise UsageError(f"{where} is on {t.device}, buffers[{spec.names[0]!r}][0] on {first.device}")
        check_sizes(size, page_size)
        pool = cls.__new__(cls)
        pool.raw = None
        stacked = {c.name: _stack_view(buffers[c.name]) for c in spec.components}
        pool._init(spec, size, page_size, first.device, {n: list(v) for n, v in buffers.items()}, stacked)
        return pool

    def _init(self, spec, size, page_size, device, layers, stacked) -> None:
        self.spec = spec
        self.size = size
        self.page_size = page_size
        self.device = device
        self._layers: dict[str, list[torch.Tensor]] = layers
        self._allocator = PageAllocator(size, page_size, device)
        num_pages = size // page_size
        self.page_views: dict[str, PageViews] = {}
        for c in spec.components:
            # (layer, size, head, dim) -> (page, slot, layer, head, dim)
            all_layers = stacked[c.name]
            canon = None
            if all_layers is not None:
                canon = all_layers.unflatten(1, (num_pages, page_size)).permute(1, 2, 0, 3, 4)
            per_layer = tuple(t.unflatten(0, (num_pages, page_size)) for t in layers[c.name])
            self.page_views[c.name] = PageViews.build(canon, per_layer)

    # -- engine view -------------------------------------------------------
    def buffer(self, name: str, layer: int) -> torch.Tensor:
        """``(size, head, dim)`` buffer of component ``name`` at ``layer``."""
        if name not in self._layers:
            raise UsageError(f"unknown component {name!r}; this pool has {list(self._layers)}")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.spec.layer_num:
            raise UsageError(f"layer {layer!r} out of range [0, {self.spec.layer_num})")
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
        return torch.device("cpu") if self.device.type == "meta" else self.device

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` token slots in whole pages, on :attr:`index_device`; ``None`` when full."""
        slots = self._allocator.alloc(n)
        return None if slots is None else slots.to(self.index_device)

    def free(self, indices: torch.Tensor) -> None:
        self._allocator.free(indices)

    def allocated_pages(self, page_ids: torch.Tensor) -> torch.Tensor:
        """``(n,)`` bool: which of the CPU int64 ``page_ids`` are allocated."""
        return self._allocator.allocated(page_ids)

    def available_size(self) -> int:
        return self._allocator.available_size()

    def alloc_pages(self, k: int):
        """``k`` whole pages as page numbers (int64 numpy), ``None`` when full: what a
        caller that keeps page numbers (the hybrid cache's sliding pages) takes."""
        return self._allocator.alloc_pages(k)

    def free_pages(self, pages) -> None:
        """Return pages by number (int64 numpy), as :meth:`alloc_pages` gave them."""
        self._allocator.free_pages(pages)


def _stack_view(layers: list[torch.Tensor]) -> torch.Tensor | None:
    """A ``(layer, size, head, dim)`` view over per-layer tensors when they sit in one
    storage at a constant stride (as engines that slice one allocation do); else None."""
    t0 = layers[0]
    if len(layers) == 1:
        return t0.unsqueeze(0)
    es = t0.element_size()
    gap = layers[1].data_ptr() - t0.data_ptr()
    if gap <= 0 or gap % es:
        return None
    for i, t in enumerate(layers):
        same = t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr() and t.stride() == t0.stride()
        if not same or t.data_ptr() - t0.data_ptr() != i * gap:
            return None
    return t0.as_strided((len(layers), *t0.shape), (gap // es, *t0.stride()))
