"""kvtier: a hierarchical KV cache (device, host, storage) for every attention geometry."""

from .cache import Acquired, Committed, HierarchicalCache, Lease, LoadHandle, MatchResult, PrefetchHandle
from .errors import (CacheClosedError, IntegrityError, KVTierError, LoadError, UnsupportedError, UnsupportedLayoutError,
                     UsageError)
from .hybrid import Attention, HybridSpec, KVGroup
from .layout import LAYOUTS, Layout
from .pools import DeviceKVPool, HostKVPool, HybridDevicePool, HybridHostPool
from .spec import Component, KVSpec

__version__ = "0.1.0"

__all__ = ["LAYOUTS", "Acquired", "Attention", "CacheClosedError", "Committed", "Component", "DeviceKVPool",
           "HierarchicalCache", "HostKVPool", "HybridDevicePool", "HybridHostPool", "HybridSpec", "IntegrityError",
           "KVGroup", "KVSpec", "KVTierError", "Layout", "Lease", "LoadError", "LoadHandle", "MatchResult",
           "PrefetchHandle", "UnsupportedError", "UnsupportedLayoutError", "UsageError"]
