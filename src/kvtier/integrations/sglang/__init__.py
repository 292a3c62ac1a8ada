"""sglang HiCache integration.

L3: :class:`KVTierStorage`, kvtier storage as HiCache's storage backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
        "class_name": "KVTierStorage", "interface_v1": 1, "url": "file:///var/cache/kvtier"}'

L2: :func:`install_host_pool`, called before sglang builds its cache, makes sglang's
host-pool factory return :class:`KVTierMHAHostPool` for K/V with
``head_dim != v_head_dim`` in every layout (``symmetric=True``: every MHA model).

sglang is imported only when one of these names is first looked up, so this package
imports (and ``kvtier`` works) without sglang installed.
"""

from __future__ import annotations

_LAZY = {"KVTierStorage": ".storage", "KVTierMHAHostPool": ".host_pool", "install_host_pool": ".install",
         "uninstall_host_pool": ".install"}

__all__ = ["KVTierMHAHostPool", "KVTierStorage", "install_host_pool", "uninstall_host_pool"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
