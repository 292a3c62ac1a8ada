"""kvtier behind vLLM's ``OffloadingConnector``: a host tier and storage for vLLM v1.

Use (vLLM 0.32; importing this module imports vLLM, ``import kvtier`` does not)::

    vllm serve MODEL --enable-prefix-caching --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm", "host_bytes": 17179869184,
        "storage": "file:///var/cache/kvtier"}}'

vLLM evicts a block from its own cache -> the block was stored in kvtier's host tier
(and, asynchronously, in storage) -> a later prompt with the same prefix loads it
back instead of recomputing it. Blocks only in storage are read into the host tier,
and verified, on a thread while vLLM keeps scheduling.

Where things run: each worker rank owns its host pool, in a shared-memory file
(:mod:`.region`), and copies vLLM's blocks in and out of it (:mod:`.worker`); the
engine core's side keeps the page table (:mod:`.pages`) and moves pages between that
same memory and storage (:mod:`.tier`), and answers vLLM's scheduler (:mod:`.manager`).
vLLM's default process layout, the in-process one and tensor parallelism all work this
way. :mod:`.blocks` says which attention layouts become canonical K/V pages.

Keys: vLLM's chained block hash (with its group index) under a namespace naming the
model — ``vllm:<path or hub id>@<revision>:<dtype>:w<checkpoint digest>`` unless
``namespace`` is given — and the block format (KV geometry and block size, or the
backend for opaque pages).

Hybrid models: every KV cache group vLLM hands over (sliding window groups included)
has its own host pools, page table and storage keys (:mod:`.groups`); vLLM's scheduler
decides which of a sliding group's blocks to store and load.

Limits: pipeline and context parallel size 1.
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
