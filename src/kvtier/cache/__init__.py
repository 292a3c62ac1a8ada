"""The hierarchical prefix cache: radix tree, page states, policies and background workers."""

from ..errors import CacheClosedError, IntegrityError, LoadError
from .cache import PREFETCH_POLICIES, WRITE_POLICIES, HierarchicalCache
from .handles import Acquired, Committed, Lease, LoadHandle, MatchResult, PrefetchHandle

__all__ = ["Acquired", "CacheClosedError", "Committed", "IntegrityError", "Lease", "PREFETCH_POLICIES",
           "WRITE_POLICIES", "HierarchicalCache", "LoadError", "LoadHandle", "MatchResult", "PrefetchHandle"]
