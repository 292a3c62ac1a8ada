"""kvtier host pools inside sglang HiCache (L2): :class:`KVTierMHAHostPool`
(:mod:`.install` makes sglang build it).

sglang 0.5.23 builds an MHA host pool with ``get_mha_host_pool_cls(buffer_info)``
(called by ``hybrid_pool_assembler``), whose class for ``head_dim != v_head_dim``
refuses ``layer_first`` and ``page_head``, raises for flat pages and for split-heads
metadata. After :func:`install_host_pool` the same factory returns
:class:`KVTierMHAHostPool` for those models: an sglang ``HostKVCache`` (so the
controller, ``HostPoolGroup`` and storage backends take it as one of their own)
whose memory, transfers and metadata are a :class:`kvtier.HostKVPool`.

Each component's host buffer, as sglang's attributes show it (K and V apart, so
they may differ in ``dim``):

    layout              k_buffer / v_buffer                       kvtier buffer (no copy)
    layer_first         (layer, page * slot, head, dim)           (layer, page, slot, head, dim)
    page_first          (page * slot, layer, head, dim)           (page, slot, layer, head, dim)
    page_first_direct   (page, layer, slot, head, dim)            same
    page_head           (page, head, slot, layer, dim)            same

Slots are sglang's own (``alloc``/``free``/``clear`` are ``HostKVCache``'s), so its
radix tree and controller see no difference.
"""

from __future__ import annotations

from typing import Sequence

import torch
from sglang.srt.mem_cache.pool_host.base import HostKVCache

from ...errors import UnsupportedHostPoolError, UsageError
from ...layout import get_layout
from ...pools import DeviceKVPool, HostKVPool
from ...spec import KVSpec

#: sglang layout -> whether sglang merges the (page, slot) axes into one token axis.
#: The kvtier layout has the same name and the same axis order.
SGLANG_LAYOUTS = {"layer_first": True, "page_first": True, "page_first_direct": False, "page_head": False}
#: sglang io backends -> kvtier copy engine (Triton/custom kernel on CUDA for "kernel").
IO_BACKENDS = {"direct": "direct", "kernel": "kernel"}


def _check_layout(layout: str) -> None:
    if layout not in SGLANG_LAYOUTS:
        raise UnsupportedHostPoolError(f"kvtier host pool: --hicache-mem-layout {layout!r} is not one of "
                                       f"{sorted(SGLANG_LAYOUTS)}")


def _check_buffer_info(info, pool_label: str) -> None:
    info.validate()
    if info.scales is not None:
        raise UnsupportedHostPoolError(f"{pool_label}: kvtier host pools do not carry KV scales "
                                       f"({info.scales.layout.value}); leave this model to sglang's pool")
    if info.transfer_buffers is not None:
        raise UnsupportedHostPoolError(f"{pool_label}: kvtier host pools need fixed device buffers, and this device "
                                       "pool relocates its backing (transfer_buffers)")


def _device_pool(spec: KVSpec, infos: Sequence, page_size: int) -> DeviceKVPool:
    """The device buffers of ``infos`` (target, then packed drafts) as one kvtier
    device pool; rows past the last whole page (none in sglang's pools) are left out."""
    k = [b for info in infos for b in info.buffers.k]
    v = [b for info in infos for b in info.buffers.v]
    rows = k[0].shape[0] // page_size * page_size
    return DeviceKVPool.from_buffers(spec, {"k": [b[:rows] for b in k], "v": [b[:rows] for b in v]}, page_size)


class KVTierMHAHostPool(HostKVCache):
    """sglang's MHA host pool contract over a :class:`kvtier.HostKVPool`, for every
    layout and any ``head_dim``/``v_head_dim`` (see the module docstring).

    The constructor takes what sglang's ``build_kv_host_pool`` gives
    ``MHATokenToKVPoolHost``. Index arguments are sglang's: token slots in whole pages
    (CPU, or the device for ``io_backend="kernel"``); kvtier checks them before any
    byte moves and raises ``ValueError`` with the numbers.
    """

    def __init__(self, buffer_info, host_to_device_ratio: float, host_size: float, page_size: int, layout: str,
                 pin_memory: bool = True, device: str = "cpu", allocator_type: str = "default", *,
                 device_capacity_tokens: int, start_layer: int, end_layer: int,
                 draft_buffer_infos: Sequence = (), write_back_staging=None, pool_label: str = "kv",
                 head_group_num: int = 1, host_token_capacity: int | None = None,
                 dcp_size: int = 1, dcp_rank: int = 0) -> None:
        _check_layout(layout)
        if dcp_size != 1:
            raise UnsupportedHostPoolError(f"{pool_label}: decode context parallelism (dcp_size={dcp_size}) is "
                                           "wired in sglang for MLA host pools only")
        infos = (buffer_info, *draft_buffer_infos)
        target = (buffer_info.head_num, buffer_info.head_dim, buffer_info.v_head_dim, buffer_info.dtype,
                  buffer_info.device)
        for info in infos:
            _check_buffer_info(info, pool_label)
            geometry = (info.head_num, info.head_dim, info.v_head_dim, info.dtype, info.device)
            if geometry != target:
                raise UnsupportedHostPoolError(f"{pool_label}: a packed draft pool has (heads, K dim, V dim, dtype, "
                                               f"device) {geometry}, the target {target}")
        # Geometry first: HostKVCache.__init__ sizes the pool from it, then calls init_kv_buffer.
        self.dtype = buffer_info.dtype
        self.head_num, self.head_dim = buffer_info.head_num, buffer_info.head_dim
        self.v_head_dim = buffer_info.v_head_dim
        self.target_layer_num = len(buffer_info.buffers.k)
        self.layer_num = self.target_layer_num + len(draft_buffer_infos)
        self.head_group_num = head_group_num
        self.spec = KVSpec.mha(self.layer_num, self.head_num, self.head_dim, self.v_head_dim, self.dtype)
        self._transfer_device = buffer_info.device
        self._buffer_infos = infos
        super().__init__(dtype=self.dtype, device_capacity_tokens=device_capacity_tokens,
                         size_per_token=self.get_size_per_token(), start_layer=start_layer, end_layer=end_layer,
                         host_to_device_ratio=host_to_device_ratio, host_size=host_size, page_size=page_size,
                         layout=layout, pin_memory=pin_memory, device=device, allocator_type=allocator_type,
                         pool_label=pool_label, host_token_capacity=host_token_capacity)
        self.device_pool = _device_pool(self.spec, infos, self.page_size)
        if self.head_dim == self.v_head_dim:
            # One row width for K and V: what sglang's symmetric pool exposes. (Its asymmetric
            # pool leaves it unset so that no caller copies V with K's width; so does this one.)
            self.token_stride_size = self.head_num * self.head_dim * self.dtype.itemsize

    # -- memory --------------------------------------------------------------------------
    def init_kv_buffer(self):
        """Allocate the kvtier pool (one allocation, pinned where an accelerator exists)
        and return ``(k_buffer, v_buffer)`` as sglang's views of it."""
        # NOTE: sglang passes pin_memory=True by default, also on machines without CUDA;
        # kvtier's None pins exactly when an accelerator exists.
        self.kvtier_pool = HostKVPool(self.spec, self.size, self.page_size, layout=self.layout,
                                      pin_memory=None if self.pin_memory else False, device=self.device)
        self.pin_memory = bool(self.kvtier_pool.raw is not None and self.kvtier_pool.raw.is_pinned())
        page_axis = get_layout(self.layout).order.index("page")
        merge = SGLANG_LAYOUTS[self.layout]
        return tuple(buf.flatten(page_axis, page_axis + 1) if merge else buf
                     for buf in (self.kvtier_pool.buffers["k"], self.kvtier_pool.buffers["v"]))

    @property
    def host_kv_data_refs(self) -> list[torch.Tensor]:
        """Per-layer views of the host buffers, every K layer then every V layer: the
        buffer without its layer axis, e.g. ``(token, head, dim)`` in ``layer_first``
        (contiguous there only; sglang's decode host-receive path asks for that layout)."""
        order = get_layout(self.layout).order
        axis = order.index("layer") - (SGLANG_LAYOUTS[self.layout] and order.index("page") < order.index("layer"))
        return [buf.select(axis, i) for buf in self.kv_buffer for i in range(self.layer_num)]

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        """What a zero-copy transport registers: K and V, views of one allocation."""
        return [self.k_buffer, self.v_buffer]

    def destroy(self) -> None:
        """Drop the buffers (torch frees its pinned memory; nothing was host-registered).
        Idempotent."""
        self.kv_buffer = None
        self.kvtier_pool = None

    def get_size_per_token(self) -> int:
        return self.spec.bytes_per_token

    def get_ksize_per_token(self) -> int:
        """Bytes of K per token, every layer (sglang sizes Mooncake's GB-per-page by it)."""
        return self.spec.components[0].token_elems * self.layer_num * self.dtype.itemsize

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        """Whether every page span :meth:`get_page_buffer_meta` lists starts on a
        ``page_size_bytes`` boundary (what O_DIRECT needs)."""
        ptrs, _ = self.kvtier_pool.get_page_buffer_meta(torch.arange(min(self.size, 2 * self.page_size)))
        return all(p % page_size_bytes == 0 for p in ptrs)

    # -- device <-> host ------------------------------------------------------------------
    def _indices(self, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str):
        if io_backend not in IO_BACKENDS:
            raise UnsupportedHostPoolError(f"{self.pool_label}: kvtier host pools move pages with io_backend "
                                           f"{sorted(IO_BACKENDS)}, not {io_backend!r}")
        # NOTE: sglang moves host indices to the GPU for its kernels; kvtier's copy engine
        # reads page starts from host indices on the CPU.
        return host_indices.cpu() if host_indices.device.type != "cpu" else host_indices, device_indices

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Device -> host, every layer (target and packed drafts), whole pages."""
        host_indices, device_indices = self._indices(host_indices, device_indices, io_backend)
        self.kvtier_pool.backup_from_device_all_layer(self.device_pool, host_indices, device_indices,
                                                      io_backend=IO_BACKENDS[io_backend])

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:
        """Host -> device, one layer. Like sglang's pool, a target load of a layer this
        pool does not hold (another pool's transfer id) does nothing."""
        if not is_draft and not 0 <= layer_id < self.target_layer_num:
            return
        host_indices, device_indices = self._indices(host_indices, device_indices, io_backend)
        self.kvtier_pool.load_to_device_per_layer(self.device_pool, host_indices, device_indices, int(layer_id),
                                                  io_backend=IO_BACKENDS[io_backend])

    # -- pages for storage backends -----------------------------------------------------------
    # NOTE: a flat page is in sglang's byte order (each component's page in the layout's
    # native order, K then V), which sglang's file/3FS/NIXL backends store as is;
    # KVTierStorage turns it into kvtier's canonical objects (.pools.wrap_flat_page).
    def get_data_page(self, index, flat: bool = True):
        """The page starting at token slot ``index``: a new 1-D tensor, or with
        ``flat=False`` ``{"k": view, "v": view}`` in the layout's native order."""
        parts = self.kvtier_pool.get_data_page(int(index), flat=False)
        return torch.cat([p.reshape(-1) for p in parts.values()]) if flat else parts

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return self.kvtier_pool.get_dummy_flat_data_page()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a page given as :meth:`get_data_page` returns it."""
        index = int(index)
        expected = self.spec.page_elems(self.page_size)
        if not isinstance(data_page, torch.Tensor) or data_page.dtype != self.dtype or data_page.numel() != expected:
            got = (f"{data_page.dtype} tensor of {data_page.numel()}" if isinstance(data_page, torch.Tensor)
                   else type(data_page).__name__)
            raise UsageError(f"a flat page of this pool is a {self.dtype} tensor of {expected} elements, got {got}")
        views = self.kvtier_pool.get_data_page(index, flat=False)
        parts = data_page.reshape(-1).split([v.numel() for v in views.values()])
        for view, part in zip(views.values(), parts):
            view.copy_(part.view(view.shape))

    # -- zero-copy metadata (Mooncake) ------------------------------------------------------
    def get_page_buffer_meta(self, indices):
        """``(ptrs, sizes)``: ``layer_first``: per page, per layer, K then V; other
        layouts: per page, K then V (sglang's order; K and V sizes differ)."""
        return self.kvtier_pool.get_page_buffer_meta(indices)

    def get_page_buffer_element_size(self, split_factor: int = 1) -> int:
        """Bytes of the first span of a page (K's; V's spans are smaller when
        ``v_head_dim < head_dim``)."""
        page = torch.arange(self.page_size)
        meta = (self.get_split_heads_page_buffer_meta(page, split_factor) if split_factor != 1
                else self.get_page_buffer_meta(page))
        return int(meta[1][0])

    def get_split_heads_page_buffer_meta(self, indices, split_factor: int):
        """Per page, per head group of ``head_num // split_factor`` heads, K then V.
        ``page_head`` only: other layouts raise :class:`kvtier.UnsupportedLayoutError`
        (a ``NotImplementedError``, which sglang's callers catch)."""
        return self.kvtier_pool.get_split_heads_page_buffer_meta(indices, split_factor)

    def __repr__(self) -> str:
        return (f"KVTierMHAHostPool({self.pool_label}: {self.spec.fingerprint()}, {self.size} tokens, "
                f"page_size {self.page_size}, {self.layout})")


__all__ = ["IO_BACKENDS", "KVTierMHAHostPool", "SGLANG_LAYOUTS", "UnsupportedHostPoolError"]
