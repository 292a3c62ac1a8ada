"""The hierarchical prefix cache: radix tree, policies and background workers."""

from .cache import PREFETCH_POLICIES, WRITE_POLICIES, HierarchicalCache
from .handles import Acquired, LoadHandle, MatchResult, PrefetchHandle

__all__ = ["Acquired", "PREFETCH_POLICIES", "WRITE_POLICIES", "HierarchicalCache", "LoadHandle", "MatchResult",
           "PrefetchHandle"]
