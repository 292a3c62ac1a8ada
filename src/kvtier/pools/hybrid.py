"""Pools of a hybrid model: one device or host pool per layer group.

A :class:`~kvtier.hybrid.HybridSpec` cuts a model's layers into groups, each with its
own geometry (MiMo-V2-Flash: 9 full-attention layers of 4 KV heads, 39 sliding-window
layers of 8). Each group gets an ordinary :class:`DeviceKVPool` / :class:`HostKVPool`
of its :class:`~kvtier.spec.KVSpec`, so every page API (flat pages, span metadata,
split-heads metadata, storage) works per group unchanged, in every layout. Groups
have their own slot spaces and sizes: a sliding group needs only its windows, so its
pools are usually much smaller than the full groups'.

What the group pools add is the model's view: a transfer names a model layer id and
finds its group; indices come per group (``{group name: slots}``), and a group left
out of the mapping has nothing to copy.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .._checks import layer_range
from ..errors import UsageError
from ..hybrid import HybridSpec
from ..spec import KVSpec
from ..transfer import check_io_backend
from .common import check_names
from .device import DeviceKVPool
from .host import HostKVPool, check_pair


def as_hybrid(spec: KVSpec | HybridSpec) -> HybridSpec:
    """``spec`` itself, or a plain ``KVSpec`` as the one full group of a hybrid spec."""
    if isinstance(spec, HybridSpec):
        return spec
    if isinstance(spec, KVSpec):
        return HybridSpec.of(spec)
    raise UsageError(f"spec must be a KVSpec or a HybridSpec, got {type(spec).__name__}")


def _sizes(spec: HybridSpec, size: int | Mapping[str, int]) -> dict[str, int]:
    """Token slots per group: one size for all, or one per group name (every group)."""
    if not isinstance(size, Mapping):
        return dict.fromkeys(spec.names, size)
    if set(size) != set(spec.names):
        raise UsageError(f"sizes must name exactly the groups {list(spec.names)}, got {sorted(size)}")
    return dict(size)


def _check_pools(spec: HybridSpec, pools: Mapping[str, object], kind: type) -> dict:
    check_names("pools", pools, spec.names, "groups")
    page_sizes = set()
    for g in spec.groups:
        pool = pools[g.name]
        if not isinstance(pool, kind):
            raise UsageError(f"pool of group {g.name!r} is a {type(pool).__name__}, not a {kind.__name__}")
        if pool.spec != g.spec:
            raise UsageError(f"pool of group {g.name!r} has spec {pool.spec.fingerprint()}, the group "
                             f"{g.spec.fingerprint()}")
        page_sizes.add(pool.page_size)
    if len(page_sizes) > 1:
        raise UsageError(f"every group's pool needs one page size, got {sorted(page_sizes)}")
    return {g.name: pools[g.name] for g in spec.groups}


class _GroupPools:
    """What device and host group pools share: the spec, the pools, lookups."""

    def __init__(self, spec: HybridSpec, pools: dict) -> None:
        devices = {pool.device for pool in pools.values()}
        if len(devices) > 1:
            raise UsageError(f"every group's pool needs one device, got {sorted(str(d) for d in devices)}")
        self.spec = spec
        self.pools = pools
        self.page_size = next(iter(pools.values())).page_size
        self.device = devices.pop()

    def __getitem__(self, group: str):
        """The pool of group ``group``."""
        pool = self.pools.get(group)
        if pool is None:
            raise UsageError(f"unknown group {group!r}; this spec has {list(self.spec.names)}")
        return pool

    def __iter__(self):
        return iter(self.pools.items())

    @property
    def sizes(self) -> dict[str, int]:
        """Token slots per group."""
        return {name: pool.size for name, pool in self.pools.items()}

    def available_size(self) -> dict[str, int]:
        return {name: pool.available_size() for name, pool in self.pools.items()}

    def _indices(self, what: str, indices: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``indices`` itself, once it maps only this spec's group names."""
        if type(indices) is not dict and not isinstance(indices, Mapping):  # NOTE: the ABC's check costs more
            raise UsageError(f"{what} must map group names to slot tensors, got {type(indices).__name__}")
        # NOTE: a keys view compared with the pools' (set-like, no set built): a sliding
        # layer's per-layer load is a few pages, and each of its checks counts
        if not indices.keys() <= self.pools.keys():
            unknown = sorted(set(indices) - set(self.pools))
            raise UsageError(f"{what} names groups {unknown}; this spec has {list(self.spec.names)}")
        return indices


class HybridDevicePool(_GroupPools):
    """One :class:`DeviceKVPool` per group; ``buffer(name, layer)`` takes a model layer id."""

    def __init__(self, spec: KVSpec | HybridSpec, size: int | Mapping[str, int], page_size: int,
                 device: str | torch.device = "cpu") -> None:
        spec = as_hybrid(spec)
        sizes = _sizes(spec, size)
        super().__init__(spec, {g.name: DeviceKVPool(g.spec, sizes[g.name], page_size, device) for g in spec.groups})

    @classmethod
    def from_pools(cls, spec: KVSpec | HybridSpec, pools: Mapping[str, DeviceKVPool]) -> "HybridDevicePool":
        """Group pools made elsewhere, e.g. :meth:`DeviceKVPool.from_buffers` over an
        engine's per-group tensors (no copy)."""
        spec = as_hybrid(spec)
        out = cls.__new__(cls)
        _GroupPools.__init__(out, spec, _check_pools(spec, pools, DeviceKVPool))
        return out

    @classmethod
    def from_buffers(cls, spec: KVSpec | HybridSpec, buffers: Mapping[str, dict[str, list[torch.Tensor]]],
                     page_size: int) -> "HybridDevicePool":
        """Wrap an engine's tensors: ``buffers[group][component]`` lists the group's
        layers in its ``layers`` order, each ``(size, head, dim)``."""
        spec = as_hybrid(spec)
        check_names("buffers", buffers, spec.names, "groups")
        return cls.from_pools(spec, {g.name: DeviceKVPool.from_buffers(g.spec, buffers[g.name], page_size)
                                     for g in spec.groups})

    def buffer(self, name: str, layer: int) -> torch.Tensor:
        """``(size, head, dim)`` buffer of component ``name`` at model layer ``layer``."""
        group, local = self.spec.group_of(layer)
        return self.pools[group.name].buffer(name, local)


class HybridHostPool(_GroupPools):
    """One :class:`HostKVPool` per group, in one layout; transfers take per-group indices."""

    def __init__(self, spec: KVSpec | HybridSpec, size: int | Mapping[str, int], page_size: int,
                 layout: str = "page_first", pin_memory: bool | None = None, device: str | torch.device = "cpu",
                 copy_threads: int | None = None) -> None:
        spec = as_hybrid(spec)
        sizes = _sizes(spec, size)
        super().__init__(spec, {g.name: HostKVPool(g.spec, sizes[g.name], page_size, layout, pin_memory, device,
                                                   copy_threads) for g in spec.groups})
        self.layout = layout

    @classmethod
    def from_pools(cls, spec: KVSpec | HybridSpec, pools: Mapping[str, HostKVPool]) -> "HybridHostPool":
        spec = as_hybrid(spec)
        checked = _check_pools(spec, pools, HostKVPool)
        layouts = {p.layout for p in checked.values()}
        if len(layouts) > 1:
            raise UsageError(f"every group's host pool needs one layout, got {sorted(layouts)}")
        out = cls.__new__(cls)
        _GroupPools.__init__(out, spec, checked)
        out.layout = layouts.pop()
        return out

    def backup_from_device_all_layer(self, device_pool: HybridDevicePool, host_indices: Mapping[str, torch.Tensor],
                                     device_indices: Mapping[str, torch.Tensor], io_backend: str = "direct") -> None:
        """Copy whole pages of every group in ``host_indices`` (every layer), device -> host.
        Every group's numbers are checked before any group's bytes move."""
        host, dev = self._named(device_pool, host_indices, device_indices, io_backend)
        checked = [(name, self.pools[name]._check_slots(device_pool.pools[name], host[name], dev[name], True))
                   for name in self.pools if name in host]  # (the pools are in the spec's order)
        for name, (host_pages, dev_pages) in checked:
            self.pools[name]._backup_pages(device_pool.pools[name], host_pages, dev_pages, io_backend)

    def load_to_device_per_layer(self, device_pool: HybridDevicePool, host_indices: Mapping[str, torch.Tensor],
                                 device_indices: Mapping[str, torch.Tensor], layer_id: int,
                                 io_backend: str = "direct") -> None:
        """Copy model layer ``layer_id`` of its group's pages, host -> device (nothing
        when ``host_indices`` leaves that group out)."""
        group, local = self.spec.group_of(layer_id)
        host, dev = self._named(device_pool, host_indices, device_indices, io_backend)  # also where nothing moves
        if group.name in host:  # one group's copy: its pool checks its numbers first
            self.pools[group.name].load_to_device_per_layer(device_pool.pools[group.name], host[group.name],
                                                            dev[group.name], local, io_backend)

    def load_to_device_layers(self, device_pool: HybridDevicePool, host_indices: Mapping[str, torch.Tensor],
                              device_indices: Mapping[str, torch.Tensor], layers: range,
                              io_backend: str = "direct") -> None:
        """Copy model layers ``layers`` (a range of step 1), each from its group's pages,
        host -> device: ``load_to_device_per_layer`` of each, one copy per group (a
        group's layers inside a range of model layers are a range of its own). Every
        group's numbers are checked before any group's bytes move."""
        layers = layer_range("layers", layers, self.spec.layer_num)
        host, dev = self._named(device_pool, host_indices, device_indices, io_backend)
        local: dict[str, list[int]] = {}
        for layer in layers:
            group, i = self.spec.group_of(layer)
            if group.name in host:
                local.setdefault(group.name, []).append(i)
        checked = [(name, self.pools[name]._check_slots(device_pool.pools[name], host[name], dev[name], False))
                   for name in local]
        for name, (host_pages, dev_pages) in checked:
            got = local[name]
            self.pools[name]._load_pages(device_pool.pools[name], host_pages, dev_pages, range(got[0], got[-1] + 1),
                                         io_backend)

    def layer_bytes(self, host_indices: Mapping[str, torch.Tensor]) -> list[int]:
        """Per model layer, the bytes a load of ``host_indices`` (slots per group, as the
        transfers take them) moves for it; 0 for a layer whose group is left out. What
        ``kvtier.cache.mover.layer_runs`` weighs a hybrid load's runs by."""
        out = []
        for layer in range(self.spec.layer_num):
            group, _ = self.spec.group_of(layer)
            slots, pool = host_indices.get(group.name), self.pools[group.name]
            out.append(0 if slots is None else slots.numel() * pool.spec.bytes_per_token // pool.spec.layer_num)
        return out

    def _named(self, device_pool, host_indices, device_indices, io_backend: str | None = None):
        """The per-group indices, after checking the pool, its page size, ``io_backend``
        (when given: then every group's pools are known to match, and each group checks
        only its numbers) and the group names."""
        if not isinstance(device_pool, HybridDevicePool) or (device_pool.spec is not self.spec
                                                             and device_pool.spec != self.spec):
            got = device_pool.spec.fingerprint() if isinstance(device_pool, HybridDevicePool) else \
                type(device_pool).__name__
            raise UsageError(f"device_pool must be a HybridDevicePool of spec {self.spec.fingerprint()}, got {got}")
        if io_backend is not None:
            check_io_backend(io_backend)
            check_pair(device_pool, self)
        host = self._indices("host_indices", host_indices)
        dev = self._indices("device_indices", device_indices)
        if host.keys() != dev.keys():
            raise UsageError(f"host_indices names groups {sorted(host)}, device_indices {sorted(dev)}")
        return host, dev


__all__ = ["HybridDevicePool", "HybridHostPool", "as_hybrid"]
