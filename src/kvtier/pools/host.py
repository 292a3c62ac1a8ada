"""The host-memory (L2) KV pool: whole pages in one of the layouts of ``kvtier.layout``."""

from __future__ import annotations

import os
import weakref

import numpy as np
import torch

from .._checks import index_in_range, is_int, layer_range, positive_int
from ..errors import UsageError
from ..layout import get_layout, require_split_heads
from ..spec import KVSpec
from ..transfer import CopyWorkers, check_io_backend, copy_layer, copy_pages, layer_pairs
from .allocator import PageAllocator
from .common import carve, check_buffers, check_names, check_sizes, check_spec, layout_shapes, parse_device
from .device import DeviceKVPool
from .indices import page_numbers
from .meta import SpanTable, SpanTables
from .views import PageViews

_CPU = torch.device("cpu")


def check_pair(device_pool, host_pool) -> None:
    """``UsageError`` unless a transfer's device and host pools have one page size, and
    both or neither are ``meta`` pools (shapes without memory: a copy between one and a
    real pool would move nothing, silently)."""
    if device_pool.page_size != host_pool.page_size:
        raise UsageError(f"device pool page_size {device_pool.page_size} != host pool page_size "
                         f"{host_pool.page_size}")
    if (device_pool.device.type == "meta") != (host_pool.device.type == "meta"):
        raise UsageError(f"device pool on {device_pool.device}, host pool on {host_pool.device}: a meta pool "
                         "(shapes without memory) copies with meta pools only")


def _resolve_pin(pin_memory: bool | None, device: torch.device) -> bool:
    accel = torch.cuda.is_available()
    if pin_memory is None:
        return accel and device.type == "cpu"
    if pin_memory and not accel:
        raise UsageError("pin_memory=True needs an accelerator (CUDA) and none is available; use pin_memory=None")
    return bool(pin_memory)


def _shared_allocation(buffers: list[torch.Tensor]) -> torch.Tensor | None:
    """A uint8 view of the one storage all ``buffers`` live in, or ``None`` if several."""
    storage = buffers[0].untyped_storage()
    if any(b.untyped_storage().data_ptr() != storage.data_ptr() for b in buffers[1:]):
        return None
    return torch.empty(0, dtype=torch.uint8, device=buffers[0].device).set_(storage)


class HostKVPool:
    """A host pool of ``size`` token slots in pages of ``page_size``, one buffer per component.

    Each component's buffer is allocated in the layout's axis order, e.g.
    ``page_first``: ``(page, slot, layer, head, dim)``. All buffers are views of one
    allocation (pinned when an accelerator exists). Token slot ``t`` lives in page
    ``t // page_size``, slot ``t % page_size``. Methods taking indices want whole pages
    of token slots and raise ``ValueError`` before moving any byte when they are not.
    """

    def __init__(self, spec: KVSpec, size: int, page_size: int, layout: str = "page_first",
                 pin_memory: bool | None = None, device: str | torch.device = "cpu",
                 copy_threads: int | None = None) -> None:
        check_spec(spec)
        check_sizes(size, page_size)
        lay = get_layout(layout)
        dev = parse_device(device)
        pin = _resolve_pin(pin_memory, dev)
        raw, buffers = carve(spec, layout_shapes(spec, lay, size // page_size, page_size), device=dev,
                             pin_memory=pin)
        self._init(spec, page_size, lay, dev, raw, buffers, copy_threads)

    @classmethod
    def from_buffers(cls, spec: KVSpec, buffers: dict[str, torch.Tensor], page_size: int,
                     layout: str = "page_first", copy_threads: int | None = None) -> "HostKVPool":
        """Wrap existing host tensors (an engine's own host pool) without copying.

        ``buffers[name]`` holds component ``name`` in ``layout``'s axis order, e.g.
        ``page_first``: ``(page, slot, layer, head, dim)``, C-contiguous, of ``spec.dtype``,
        all on one device and with one page count. Every method then reads and writes
        those tensors in place. :attr:`raw` is the one allocation they share, or ``None``
        when they live in several (see :attr:`regions`). ``alloc``/``free`` keep this
        object's own bookkeeping; an engine that owns the memory usually manages its
        slots itself. Raises ``ValueError`` naming the first mismatch.
        """
        check_spec(spec)
        lay = get_layout(layout)
        check_names("buffers", buffers, spec.names, "components")
        first = buffers[spec.names[0]]
        if not isinstance(first, torch.Tensor) or first.dim() != len(lay.order):
            raise UsageError(f"buffers[{spec.names[0]!r}] must be a {len(lay.order)}-D tensor in {lay.name} order "
                             f"{lay.order}, got {getattr(first, 'shape', type(first).__name__)}")
        num_pages = first.shape[lay.order.index("page")]
        check_sizes(num_pages * page_size, page_size)
        shapes = layout_shapes(spec, lay, num_pages, page_size)
        check_buffers(spec, ((f"buffers[{c.name!r}]", buffers[c.name], shapes[c.name]) for c in spec.components),
                      needs=f" ({lay.name} {lay.order} with page_size {page_size})")
        for c in spec.components:
            if not buffers[c.name].is_contiguous():
                raise UsageError(f"buffers[{c.name!r}] is not contiguous (strides {buffers[c.name].stride()}); page "
                                 f"spans need each component's buffer packed in {lay.name} order")
        pool = cls.__new__(cls)
        pool._init(spec, page_size, lay, first.device, _shared_allocation(list(buffers.values())),
                   {c.name: buffers[c.name] for c in spec.components}, copy_threads)
        return pool

    def _init(self, spec, page_size, layout, device, raw, buffers, copy_threads) -> None:
        self._layout = layout
        self.spec, self.page_size, self.device = spec, page_size, device
        self.layout = layout.name
        self.num_pages = buffers[spec.names[0]].shape[layout.order.index("page")]
        self.size = self.num_pages * page_size
        if copy_threads is not None:
            positive_int("copy_threads", copy_threads)
        self.copy_threads = copy_threads or max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
        self.copy_workers = CopyWorkers(self.copy_threads)  # kept threads: none started until a big copy
        self.raw: torch.Tensor | None = raw
        self.buffers: dict[str, torch.Tensor] = buffers
        self.page_views: dict[str, PageViews] = {}
        # (the spec's properties build these anew each time; every transfer asks)
        self._names, self._page_bytes = spec.names, page_size * spec.bytes_per_token
        for name, buf in self.buffers.items():
            canon = self._layout.canonical(buf)  # (page, slot, layer, head, dim)
            self.page_views[name] = PageViews.build(canon, tuple(canon.unbind(2)))
        self._spans = SpanTables(layout, spec, buffers)
        self._allocator = PageAllocator(self.size, page_size)
        self._load_pairs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # see _layer_pairs

    # -- properties ------------------------------------------------------------
    @property
    def page_format(self) -> str:
        """Byte order of one page as :meth:`get_page_buffer_meta` lists its spans."""
        return self._layout.page_format

    @property
    def supports_split_heads(self) -> bool:
        return self._layout.supports_split_heads

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer and component."""
        return self._page_bytes

    @property
    def regions(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of each distinct allocation holding this pool's buffers
        (one for a pool allocated here): what a zero-copy transport must register."""
        if self.raw is not None:
            return [(self.raw.data_ptr(), self.raw.numel())]
        spans = {}
        for buf in self.buffers.values():
            storage = buf.untyped_storage()
            spans[storage.data_ptr()] = storage.nbytes()
        return sorted(spans.items())

    # -- allocation --------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` token slots (``n % page_size == 0``) in whole pages; ``None`` when full."""
        return self._allocator.alloc(n)

    def free(self, indices: torch.Tensor) -> None:
        self._allocator.free(indices)

    def available_size(self) -> int:
        return self._allocator.available_size()

    def alloc_pages(self, k: int):
        """``k`` whole pages as page numbers (int64 numpy), ``None`` when full: what a
        caller that keeps page numbers (the hybrid cache's sliding pages) takes."""
        return self._allocator.alloc_pages(k)

    def free_pages(self, pages) -> None:
        """Return pages by number (int64 numpy), as :meth:`alloc_pages` gave them."""
        self._allocator.free_pages(pages)

    # -- device <-> host -------------------------------------------------------
    def backup_from_device_all_layer(self, device_pool: DeviceKVPool, host_indices: torch.Tensor,
                                     device_indices: torch.Tensor, io_backend: str = "direct") -> None:
        """Copy whole pages, every layer and component, device -> host."""
        host_pages, dev_pages = self._check_transfer(device_pool, host_indices, device_indices, io_backend,
                                                     dst_is_host=True)
        self._backup_pages(device_pool, host_pages, dev_pages, io_backend)

    def _backup_pages(self, device_pool: DeviceKVPool, host_pages, dev_pages, io_backend: str) -> None:
        """The copy of :meth:`backup_from_device_all_layer`, on pages it checked."""
        views = [(self.page_views[n], device_pool.page_views[n]) for n in self._names]
        copy_pages(views, host_pages, dev_pages, layer=None, nbytes=len(host_pages) * self.page_bytes,
                   io_backend=io_backend, threads=self.copy_threads, workers=self.copy_workers)

    def load_to_device_per_layer(self, device_pool: DeviceKVPool, host_indices: torch.Tensor,
                                 device_indices: torch.Tensor, layer_id: int, io_backend: str = "direct") -> None:
        """Copy one layer of whole pages, every component, host -> device."""
        index_in_range("layer_id", layer_id, self.spec.layer_num)
        host_pages, dev_pages = self._check_transfer(device_pool, host_indices, device_indices, io_backend,
                                                     dst_is_host=False)
        self._load_pages(device_pool, host_pages, dev_pages, layer_id, io_backend)

    def load_to_device_layers(self, device_pool: DeviceKVPool, host_indices: torch.Tensor,
                              device_indices: torch.Tensor, layers: range, io_backend: str = "direct") -> None:
        """Copy the layers of ``layers`` (a range of step 1) of whole pages, every
        component, host -> device: what ``load_to_device_per_layer`` does for each of
        them, in one copy. For a caller that loads several layers before it needs the
        first: where a host page holds a token's layers side by side (``page_first``,
        ``page_head``), one copy reads each token's run of those layers at once instead
        of gathering short runs far apart layer by layer."""
        layers = layer_range("layers", layers, self.spec.layer_num)
        host_pages, dev_pages = self._check_transfer(device_pool, host_indices, device_indices, io_backend,
                                                     dst_is_host=False)
        self._load_pages(device_pool, host_pages, dev_pages, layers, io_backend)

    def _load_pages(self, device_pool: DeviceKVPool, host_pages, dev_pages, layers: int | range,
                    io_backend: str) -> None:
        """The copy of a load, on pages and layers (a layer, or a range of them) checked."""
        count = len(layers) if isinstance(layers, range) else 1
        nbytes = len(host_pages) * self.page_bytes * count // self.spec.layer_num
        if type(layers) is int:  # NOTE: a per-layer load: its view pairs are kept (_layer_pairs)
            pairs = self._layer_pairs(device_pool, layers)
            if pairs is not None and copy_layer(pairs, dev_pages, host_pages, nbytes=nbytes, io_backend=io_backend,
                                                threads=self.copy_threads, workers=self.copy_workers):
                return
        views = [(device_pool.page_views[n], self.page_views[n]) for n in self._names]
        copy_pages(views, dev_pages, host_pages, layer=layers, nbytes=nbytes,
                   io_backend=io_backend, threads=self.copy_threads, workers=self.copy_workers)

    def _layer_pairs(self, device_pool: DeviceKVPool, layer: int) -> list | None:
        """``transfer.layer_pairs`` of a load of ``layer`` from this pool into
        ``device_pool``, worked out at the first load of that layer and kept while
        ``device_pool`` lives (weakly keyed: the pairs view its memory); ``None`` where
        there are none (a pool off the CPU) or ``device_pool`` cannot be a key."""
        try:
            by_layer = self._load_pairs.get(device_pool)
            if by_layer is None:
                by_layer = self._load_pairs[device_pool] = {}
        except TypeError:  # NOTE: a subclass that defines __eq__ alone cannot be a key: copy_pages' path
            return None
        if layer not in by_layer:
            by_layer[layer] = layer_pairs([(device_pool.page_views[n], self.page_views[n]) for n in self._names],
                                          layer)
        return by_layer[layer]

    def _check_transfer(self, device_pool, host_indices, device_indices, io_backend, *, dst_is_host):
        """``(host pages, device pages)``: the page numbers (int64 numpy) of both index
        tensors, checked against both pools, before any byte moves."""
        check_io_backend(io_backend)
        if not isinstance(device_pool, DeviceKVPool):
            raise UsageError(f"device_pool must be a DeviceKVPool, got {type(device_pool).__name__}")
        if device_pool.spec is not self.spec and device_pool.spec != self.spec:
            raise UsageError(f"device pool spec {device_pool.spec.fingerprint()} differs from host pool spec "
                             f"{self.spec.fingerprint()}")
        check_pair(device_pool, self)
        return self._check_slots(device_pool, host_indices, device_indices, dst_is_host)

    def _check_slots(self, device_pool, host_indices, device_indices, dst_is_host: bool):
        """:meth:`_check_transfer`'s page numbers, for a device pool known to match this
        one (a hybrid pool's group, checked once for every group)."""
        host_pages = page_numbers(host_indices, page_size=self.page_size, size=self.size, what="host_indices",
                                  allowed_devices=(_CPU, self.device), unique=dst_is_host)
        dev_pages = page_numbers(device_indices, page_size=self.page_size, size=device_pool.size,
                                 what="device_indices", allowed_devices=(_CPU, device_pool.device),
                                 unique=not dst_is_host)
        # NOTE: counted in pages once both are whole pages (no torch call: see indices._cpu_int64)
        if len(host_pages) != len(dev_pages):
            raise UsageError(f"host_indices has {len(host_pages) * self.page_size} slots, device_indices "
                             f"{len(dev_pages) * self.page_size}; they must match")
        return host_pages, dev_pages

    # -- single pages -------------------------------------------------------------
    def _page_of(self, index: int) -> int:
        if isinstance(index, torch.Tensor) and index.numel() == 1:
            index = int(index)
        if not is_int(index):
            raise UsageError(f"page index must be an int token slot, got {index!r}")
        if not 0 <= index < self.size or index % self.page_size:
            raise UsageError(f"page index {index} must be a multiple of page_size {self.page_size} "
                             f"in [0, {self.size})")
        return index // self.page_size

    def get_data_page(self, index: int, flat: bool = True):
        """The page whose first token slot is ``index``.

        ``flat=True``: a new 1-D tensor in the canonical flat order (per component,
        in spec order, ``(layer, slot, head, dim)``), the same for every layout.
        ``flat=False``: ``{name: view}`` of the page in the layout's native order (no copy).
        """
        page = self._page_of(index)
        if not flat:
            axis = self._layout.order.index("page")
            return {name: buf.select(axis, page) for name, buf in self.buffers.items()}
        parts = [v.all_layers[page].transpose(0, 1).reshape(-1) for v in self.page_views.values()]
        return torch.cat(parts)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zero page in flat form (for storage reads of a missing page)."""
        return torch.zeros(self.spec.page_elems(self.page_size), dtype=self.spec.dtype, device=self.device)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a canonical flat page (see :meth:`get_data_page`) into page ``index``."""
        page = self._page_of(index)
        expected = self.spec.page_elems(self.page_size)
        if not isinstance(data_page, torch.Tensor):
            raise UsageError(f"data_page must be a tensor, got {type(data_page).__name__}")
        if data_page.dtype != self.spec.dtype:
            raise UsageError(f"data_page dtype {data_page.dtype} != spec dtype {self.spec.dtype}")
        if data_page.numel() != expected:
            raise UsageError(f"data_page has {data_page.numel()} elements, a flat page has {expected}")
        if (data_page.device.type == "meta") != (self.device.type == "meta"):
            raise UsageError(f"data_page is on {data_page.device}, the pool on {self.device}: a meta tensor "
                             "(shapes without memory) copies with meta pools only")
        flat = data_page.detach().reshape(-1)  # bytes only: the pool never joins a caller's autograd graph
        offset = 0
        for c in self.spec.components:
            n = self.spec.layer_num * self.page_size * c.token_elems
            src = flat[offset:offset + n].view(self.spec.layer_num, self.page_size, c.head_num, c.head_dim)
            self.page_views[c.name].all_layers[page].transpose(0, 1).copy_(src)
            offset += n

    # -- zero-copy metadata ---------------------------------------------------------
    def _meta_pages(self, indices: torch.Tensor) -> np.ndarray:
        return page_numbers(indices, page_size=self.page_size, size=self.size, what="indices")

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """``(ptr_list, size_list)``: one span per contiguous piece of each page.

        ``layer_first``: for each page, each layer, each component, the ``(slot, head, dim)``
        span; other layouts: for each page, each component, the whole page span.
        Bytes inside a span are in the layout's native order (:attr:`page_format`).
        """
        return self._spans.pages.lists(self._meta_pages(indices))

    def get_page_buffer_meta_array(self, indices: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`get_page_buffer_meta` as numpy: ``(ptrs, sizes)``, two new ``(spans,)``
        int64 arrays holding the same spans in the same order, without building one
        Python int per span (``layer_first`` lists ``pages * layers * components``)."""
        return self._spans.pages.arrays(self._meta_pages(indices))

    def _split_heads_table(self, split_factor: int) -> SpanTable:
        require_split_heads(self._layout)
        positive_int("split_factor", split_factor)
        for c in self.spec.components:
            if c.head_num % split_factor:
                raise UsageError(f"component {c.name!r} has {c.head_num} heads, not divisible by "
                                 f"split_factor {split_factor}")
        return self._spans.split_heads(split_factor)

    def get_split_heads_page_buffer_meta(self, indices: torch.Tensor, split_factor: int) -> tuple[list[int], list[int]]:
        """For each page, each of ``split_factor`` head groups, each component: that
        group's span. Needs a layout keeping head groups contiguous (``page_head``);
        raises :class:`kvtier.UnsupportedLayoutError` otherwise."""
        table = self._split_heads_table(split_factor)
        return table.lists(self._meta_pages(indices))

    def get_split_heads_page_buffer_meta_array(self, indices: torch.Tensor,
                                               split_factor: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`get_split_heads_page_buffer_meta` as numpy: ``(ptrs, sizes)``, two new
        ``(pages * split_factor * components,)`` int64 arrays, same spans, same order."""
        table = self._split_heads_table(split_factor)
        return table.arrays(self._meta_pages(indices))
