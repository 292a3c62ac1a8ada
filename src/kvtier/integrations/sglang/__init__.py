"""sglang HiCache integration: :class:`KVTierStorage`, kvtier storage as HiCache's L3.

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
        "class_name": "KVTierStorage", "interface_v1": 1, "url": "file:///var/cache/kvtier"}'

sglang is imported only when ``KVTierStorage`` is first looked up, so this package
imports (and ``kvtier`` works) without sglang installed.
"""

from __future__ import annotations

_LAZY = {"KVTierStorage": ".storage"}

__all__ = ["KVTierStorage"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
