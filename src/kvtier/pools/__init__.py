"""Device (L1) and host (L2) KV pools."""

from .allocator import PageAllocator
from .device import DeviceKVPool
from .host import HostKVPool
from .hybrid import HybridDevicePool, HybridHostPool

__all__ = ["DeviceKVPool", "HostKVPool", "HybridDevicePool", "HybridHostPool", "PageAllocator"]
