"""The interfaces the cache needs from what the engine hands it."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class DeviceAllocator(Protocol):
    """Hands out device token slots in whole, aligned pages (``DeviceKVPool`` is one;
    an engine may pass its own, which the cache then allocates from and frees to)."""

    def alloc(self, n: int) -> torch.Tensor | None: ...

    def free(self, indices: torch.Tensor) -> None: ...

    def available_size(self) -> int: ...


@runtime_checkable
class Storage(Protocol):
    """An L3 store (``kvtier.storage.open`` returns one)."""

    def batch_exists(self, keys: Sequence[str]) -> int: ...

    def batch_get(self, keys: Sequence[str], host_pool, host_indices: torch.Tensor) -> list[bool]: ...

    def batch_set(self, keys: Sequence[str], host_pool, host_indices: torch.Tensor) -> list[bool]: ...

    def stats(self) -> dict: ...
