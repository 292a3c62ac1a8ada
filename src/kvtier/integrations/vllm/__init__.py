"""kvtier behind vLLM's ``OffloadingConnector``: a host tier and storage for vLLM v1.

Use (vLLM 0.32; importing this module imports vLLM, ``import kvtier`` does not)::

    LLM(model, enable_prefix_caching=True, kv_transfer_config=KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={"spec_name": "KVTierOffloadingSpec",
                                   "spec_module_path": "kvtier.integrations.vllm",
                                   "host_bytes": 1 << 30, "storage": "file:///var/cache/kvtier"}))

vLLM evicts a block from its own cache -> the block was stored in kvtier's host tier
(and, asynchronously, in storage) -> a later prompt with the same prefix loads it
back instead of recomputing it. Blocks only in storage are fetched into the host
tier on a thread while vLLM keeps scheduling; see :mod:`.tier` for page states and
:mod:`.blocks` for which attention layouts get canonical K/V pages.

Keys: vLLM's chained block hash (with its group index) under a namespace naming the
model — ``vllm:<name or path>@<revision>:<dtype>`` unless ``namespace`` is given —
and the block format (KV geometry and block size, or the backend for opaque pages).

Limits: one KV cache group (full attention, no hybrid models), one offloaded block
per vLLM block (``blocks_per_chunk`` 1), and one worker per engine (tensor and
pipeline parallel size 1): the scheduler-side manager and the worker share the host
tier in one process.
"""

from __future__ import annotations

# NOTE: the spec, manager and worker subclass vLLM's classes and import vLLM; they
# load on first use, so that the parts that do not (blocks, pages, tier, config)
# import without vLLM. vLLM's loader does getattr(module, "KVTierOffloadingSpec").
_LAZY = {"KVTierOffloadingSpec": "spec", "UnsupportedVLLMSetupError": "spec", "engine_tier": "spec",
         "KVTierOffloadingManager": "manager", "KVTierLoadStoreSpec": "manager",
         "KVTierOffloadingWorker": "worker"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KVTierLoadStoreSpec", "KVTierOffloadingManager", "KVTierOffloadingSpec", "KVTierOffloadingWorker",
           "UnsupportedVLLMSetupError", "engine_tier"]
