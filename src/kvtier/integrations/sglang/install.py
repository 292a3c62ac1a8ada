"""Make sglang 0.5.23 build kvtier host pools: :func:`install_host_pool`.

sglang picks an MHA host-pool class with ``get_mha_host_pool_cls(buffer_info)`` in
``pool_host.mha``; ``hybrid_pool_assembler`` (and any module that imported the name)
holds its own reference, so installing rebinds the name in every loaded sglang module.
Call it before sglang builds its cache; in sglang's spawned scheduler processes the
plugin entry point (:mod:`.plugin`) calls it.
"""

from __future__ import annotations

import logging
import sys

from sglang.srt.mem_cache.pool_host import mha as sglang_mha

from .host_pool import KVTierMHAHostPool

log = logging.getLogger("kvtier.integrations.sglang")

_ORIGINAL = sglang_mha.get_mha_host_pool_cls
_FACTORY_NAME = "get_mha_host_pool_cls"


def _uses_kvtier(buffer_info, symmetric: bool) -> bool:
    if buffer_info.scales is not None:  # MXFP8: sglang's own pool, or its error
        return False
    return symmetric or buffer_info.head_dim != buffer_info.v_head_dim


def _make_factory(symmetric: bool):
    def get_mha_host_pool_cls(buffer_info) -> type:
        """kvtier's host pool for asymmetric K/V (and, if asked, symmetric MHA);
        sglang's choice for everything else."""
        return KVTierMHAHostPool if _uses_kvtier(buffer_info, symmetric) else _ORIGINAL(buffer_info)

    get_mha_host_pool_cls.kvtier = True
    get_mha_host_pool_cls.symmetric = symmetric
    return get_mha_host_pool_cls


def _rebind(factory) -> list[str]:
    """Point every loaded sglang module's ``get_mha_host_pool_cls`` (``from ... import``
    copies the name) at ``factory``; names of the modules changed."""
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler  # noqa: F401 - binds the name at import

    changed = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("sglang.") or module is None:
            continue
        current = getattr(module, _FACTORY_NAME, None)
        if current is _ORIGINAL or getattr(current, "kvtier", False):
            setattr(module, _FACTORY_NAME, factory)
            changed.append(name)
    return changed


def install_host_pool(symmetric: bool = False) -> None:
    """Make sglang build kvtier host pools; call before sglang builds its cache.

    After it, sglang's ``get_mha_host_pool_cls`` returns :class:`KVTierMHAHostPool`
    for K/V with ``head_dim != v_head_dim`` (every host layout), and with
    ``symmetric=True`` for every MHA model without KV scales. MLA, MXFP8 and other
    pools stay sglang's. Idempotent; a later call replaces the ``symmetric`` choice.
    """
    changed = _rebind(_make_factory(symmetric))
    log.info("kvtier host pools installed in sglang (%s MHA): %s", "all" if symmetric else "asymmetric K/V",
             ", ".join(changed))


def uninstall_host_pool() -> None:
    """Give sglang back its own ``get_mha_host_pool_cls``."""
    _rebind(_ORIGINAL)


__all__ = ["install_host_pool", "uninstall_host_pool"]
