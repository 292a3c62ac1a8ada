"""kvtier: a hierarchical KV cache (device, host, storage) for every attention geometry."""

from .cache import (Acquired, CacheClosedError, Committed, HierarchicalCache, LoadError, LoadHandle, MatchResult,
                    PrefetchHandle)
from .errors import UnsupportedLayoutError
from .layout import LAYOUTS, Layout
from .pools import DeviceKVPool, HostKVPool
from .spec import Component, KVSpec

__version__ = "0.1.0"

__all__ = ["LAYOUTS", "Acquired", "CacheClosedError", "Committed", "Component", "DeviceKVPool", "HierarchicalCache",
           "HostKVPool", "KVSpec", "Layout", "LoadError", "LoadHandle", "MatchResult", "PrefetchHandle",
           "UnsupportedLayoutError"]
