"""Capacity planning: replay request traces through the cache policy (``kvtier simulate``)."""

from ..errors import TraceError
from .simulator import CostModel, SimConfig, SimResult, belady_hits, simulate
from .traces import Request, read_mooncake, repeat, synthetic

__all__ = ["CostModel", "Request", "SimConfig", "SimResult", "TraceError", "belady_hits", "read_mooncake",
           "repeat", "simulate", "synthetic"]
