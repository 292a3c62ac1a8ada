"""kvtier: a hierarchical KV cache (device, host, storage) for every attention geometry."""

from .cache import (Acquired, CacheClosedError, Committed, HierarchicalCache, Lease, LoadError, LoadHandle,
                    MatchResult, PrefetchHandle)
from .errors import IntegrityError, UnsupportedLayoutError
from .hybrid import Attention, HybridSpec, KVGroup
from .layout import LAYOUTS, Layout
from .pools import DeviceKVPool, HostKVPool, HybridDevicePool, HybridHostPool
from .spec import Component, KVSpec

__version__ = "0.1.0"

__all__ = ["LAYOUTS", "Acquired", "Attention", "CacheClosedError", "Committed", "Component", "DeviceKVPool",
           "HierarchicalCache", "HostKVPool", "HybridDevicePool", "HybridHostPool", "HybridSpec", "IntegrityError",
           "KVGroup", "KVSpec", "Layout", "Lease", "LoadError", "LoadHandle", "MatchResult", "PrefetchHandle",
           "UnsupportedLayoutError"]
