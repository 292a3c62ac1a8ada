"""What ``--hicache-storage-backend-extra-config`` may say to kvtier, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError

#: Keys sglang itself reads from the same JSON object (the ``dynamic`` loader, the
#: controller's interface switch, the host allocator); accepted and left to sglang.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "allocator"})
#: kvtier's own keys.
KVTIER_KEYS = frozenset({"url", "namespace"})


@dataclass(frozen=True)
class Settings:
    """``url``: a kvtier storage URL (``file:///dir``, ``redis://host:port/db``,
    ``mooncake://host:port?...``); ``namespace``: the model part of every key (default:
    sglang's ``model_name`` with the KV dtype); ``interface_v1``: whether sglang moves
    pages through ``batch_get_v1``/``batch_set_v1`` (zero-copy) or its flat-page path."""

    url: str
    namespace: str | None
    interface_v1: bool

    @classmethod
    def parse(cls, extra_config: dict | None) -> "Settings":
        """Raises ``ValueError`` for a missing ``url``, a non-string value, or a key that
        neither kvtier nor sglang reads (a typo would otherwise be ignored)."""
        config = dict(extra_config or {})
        unknown = sorted(set(config) - SGLANG_KEYS - KVTIER_KEYS)
        if unknown:
            raise UsageError(f"kvtier: unknown keys {unknown} in --hicache-storage-backend-extra-config; kvtier "
                             f"reads {sorted(KVTIER_KEYS)} (storage options go in the URL query, e.g. "
                             f"file:///dir?capacity_bytes=N), sglang reads {sorted(SGLANG_KEYS)}")
        url = config.get("url")
        if not isinstance(url, str) or not url:
            raise UsageError("kvtier: --hicache-storage-backend-extra-config needs \"url\", a kvtier storage URL "
                             f"such as file:///var/cache/kvtier or redis://host:6379/0; got {url!r}")
        namespace = config.get("namespace")
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise UsageError(f"kvtier: \"namespace\" must be a non-empty string, got {namespace!r}")
        return cls(url, namespace, bool(config.get("interface_v1", 0)))
