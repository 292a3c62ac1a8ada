"""kvtier: a hierarchical KV cache (device, host, storage) for every attention geometry."""

from .cache import HierarchicalCache, LoadHandle, MatchResult, PrefetchHandle
from .errors import UnsupportedLayoutError
from .layout import LAYOUTS, Layout
from .pools import DeviceKVPool, HostKVPool
from .spec import Component, KVSpec

__version__ = "0.1.0"

__all__ = ["LAYOUTS", "Component", "DeviceKVPool", "HierarchicalCache", "HostKVPool", "KVSpec", "Layout",
           "LoadHandle", "MatchResult", "PrefetchHandle", "UnsupportedLayoutError"]
