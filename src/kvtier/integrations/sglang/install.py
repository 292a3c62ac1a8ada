"""Make sglang 0.5.23 build kvtier host pools: :func:`install_host_pool`.

sglang picks an MHA host-pool class with ``get_mha_host_pool_cls(buffer_info)`` in
``pool_host.mha``; ``hybrid_pool_assembler`` (and any module that imported the name)
holds its own reference, so installing rebinds the name in every loaded sglang module.
Call it before sglang builds its cache; in sglang's spawned scheduler processes the
plugin entry point (:mod:`.plugin`) calls it, or, when nothing asked for a mode,
:func:`install_host_pool_if_storage_backend`, which decides when sglang picks the class.

The factory logs which pool it took over when sglang picks the class (sglang has set up
its logging by then), on ``sglang.kvtier``, beside sglang's own lines.
"""

from __future__ import annotations

import logging
import sys

from sglang.srt.mem_cache.pool_host import mha as sglang_mha

log = logging.getLogger("sglang.kvtier")  # sglang's logging configuration shows it with sglang's own lines

_ORIGINAL = sglang_mha.get_mha_host_pool_cls
_FACTORY_NAME = "get_mha_host_pool_cls"
POOL_CLASS = "KVTierMHAHostPool"
#: ``module_path`` values of the ``dynamic`` storage backend that name kvtier (with ``class_name`` KVTierStorage).
STORAGE_MODULES = ("kvtier.integrations.sglang", "kvtier.integrations.sglang.storage")
STORAGE_CLASS = "KVTierStorage"
STORAGE_REASON = "kvtier is the HiCache storage backend"


def _pool_class() -> type:
    from .host_pool import KVTierMHAHostPool

    return KVTierMHAHostPool


def _extra_config(text: str | None) -> dict:
    """``--hicache-storage-backend-extra-config`` as sglang reads it (JSON, or ``@file``)."""
    if not text:
        return {}
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    return HybridCacheController.parse_storage_backend_extra_config(text)[0]


def kvtier_storage_configured() -> bool:
    """Whether the server args sglang published in this process make kvtier's
    ``KVTierStorage`` the HiCache storage backend: ``--hicache-storage-backend dynamic``
    with ``module_path`` ``kvtier.integrations.sglang`` (or ``.storage``) and
    ``class_name`` ``KVTierStorage`` in the extra config. False where nothing is
    published yet (sglang publishes them before it builds its cache) or the extra config
    does not parse (sglang then refuses it itself)."""
    from sglang.srt.runtime_context import get_memory

    try:
        memory = get_memory()
        if memory.hicache_storage_backend != "dynamic":
            return False
        config = _extra_config(memory.hicache_storage_backend_extra_config)
    except Exception:  # not published, or a config sglang refuses with its own error
        return False
    return config.get("module_path") in STORAGE_MODULES and config.get("class_name") == STORAGE_CLASS


def _takes(buffer_info, symmetric: bool) -> bool:
    if buffer_info.scales is not None:  # MXFP8: sglang's own pool, or its error
        return False
    return symmetric or buffer_info.head_dim != buffer_info.v_head_dim


def _choose(buffer_info, symmetric: bool, reason: str) -> type:
    if not _takes(buffer_info, symmetric):
        theirs = _ORIGINAL(buffer_info)
        why = ("the KV cache has scales" if buffer_info.scales is not None
               else "K and V have one head_dim; KVTIER_SGLANG_HOST_POOL=all takes such pools too")
        log.info("kvtier keeps sglang's host pool %s (%s): %s", theirs.__name__, reason, why)
        return theirs
    theirs = _ORIGINAL(buffer_info).__name__
    try:
        ours = _pool_class()
    except Exception as e:
        raise RuntimeError(f"kvtier cannot build its host pool {POOL_CLASS} in place of sglang's {theirs} ({reason}): "
                           f"{type(e).__name__}: {e}") from e
    log.info("kvtier took over sglang's host pool %s: %s (K %d, V %d wide; %s)", theirs, ours.__name__,
             buffer_info.head_dim, buffer_info.v_head_dim, reason)
    return ours


def _make_factory(symmetric: bool, reason: str | None):
    """The factory sglang calls; ``reason`` None: only while :func:`kvtier_storage_configured`."""
    def get_mha_host_pool_cls(buffer_info) -> type:
        """kvtier's host pool for asymmetric K/V (and, if asked, symmetric MHA);
        sglang's choice for everything else."""
        why = reason if reason is not None else STORAGE_REASON if kvtier_storage_configured() else None
        return _ORIGINAL(buffer_info) if why is None else _choose(buffer_info, symmetric, why)

    get_mha_host_pool_cls.kvtier = True
    get_mha_host_pool_cls.symmetric = symmetric
    get_mha_host_pool_cls.reason = reason
    return get_mha_host_pool_cls


def _rebind(factory) -> list[str]:
    """Point every loaded sglang module's ``get_mha_host_pool_cls`` (``from ... import``
    copies the name) at ``factory``; names of the modules changed."""
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler  # binds the name at import

    changed = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("sglang.") or module is None:
            continue
        current = getattr(module, _FACTORY_NAME, None)
        if current is _ORIGINAL or getattr(current, "kvtier", False):
            setattr(module, _FACTORY_NAME, factory)
            changed.append(name)
    if getattr(assembler, _FACTORY_NAME, None) is not factory:
        raise RuntimeError(f"{assembler.__name__} does not pick its host pools with sglang's {_FACTORY_NAME}")
    return changed


def install_host_pool(symmetric: bool = False, *, reason: str = "install_host_pool()") -> None:
    """Make sglang build kvtier host pools; call before sglang builds its cache.

    After it, sglang's ``get_mha_host_pool_cls`` returns :class:`KVTierMHAHostPool`
    for K/V with ``head_dim != v_head_dim`` (every host layout), and with
    ``symmetric=True`` for every MHA model without KV scales. MLA, MXFP8 and other
    pools stay sglang's. Idempotent; a later call replaces the ``symmetric`` choice.
    ``reason`` goes into the line logged when sglang picks a pool. Raises if kvtier's
    pool class does not import or sglang does not pick its pools with that factory.
    """
    _pool_class()
    changed = _rebind(_make_factory(symmetric, reason))
    log.info("kvtier host pools installed in sglang (%s MHA; %s): %s", "all" if symmetric else "asymmetric K/V",
             reason, ", ".join(changed))


def install_host_pool_if_storage_backend() -> None:
    """Like :func:`install_host_pool` (asymmetric K/V), but each time sglang picks a
    pool class it first asks :func:`kvtier_storage_configured`: kvtier's pool only
    while kvtier is the configured HiCache storage backend, sglang's own otherwise.
    kvtier's pool class is imported only then."""
    _rebind(_make_factory(False, None))


def uninstall_host_pool() -> None:
    """Give sglang back its own ``get_mha_host_pool_cls``."""
    _rebind(_ORIGINAL)


__all__ = ["install_host_pool", "install_host_pool_if_storage_backend", "kvtier_storage_configured",
           "uninstall_host_pool"]
