"""The ``kv_connector_extra_config`` that :class:`KVTierOffloadingSpec` accepts, checked once.

kvtier's own keys are ``host_bytes`` (required), ``storage`` and ``namespace``, plus
tuning knobs; the rest are the keys vLLM's ``OffloadingConnector`` itself reads.
Anything else is a ``ValueError`` at construction, on one line that names the key,
the nearest known one and every key there is, so a typo (``host_byte``) never
silently turns the cache off.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping

from ..._checks import is_number, positive_int, positive_number
from ...errors import UsageError

#: Keys that vLLM's OffloadingConnector and OffloadingSpec read themselves.
VLLM_KEYS = frozenset({"spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "offload_prompt_only",
                       "self_describing_kv_events", "canonical_layout"})
#: kvtier's keys and what each means.
KVTIER_KEYS = {
    "host_bytes": "bytes of host memory for the host tier, over all workers (required, > 0)",
    "storage": "storage URL (file:///dir, redis://host:port/db, mooncake://...); optional",
    "namespace": "names the model in storage keys instead of its path, revision, dtype and weights digest; optional",
    "storage_timeout_s": "seconds a storage probe or prefetch may take before its blocks count as misses (2.0)",
    "io_threads": "threads moving blocks between the host tier and storage (2)",
    "storage_buffer_bytes": "bytes of staging memory for storage reads and writes; while it is full, further "
                            "storage writes are dropped (default: a quarter of host_bytes)",
    "host_dir": "directory of the host tier's shared memory files (/dev/shm)",
    "sliding_host_share": "host pages of each sliding window KV cache group, as a fraction of a full attention "
                          "group's (0.25): vLLM stores only the window before each resume point of those",
}


@dataclass(frozen=True)
class KVTierConfig:
    host_bytes: int
    storage: str | None = None
    namespace: str | None = None
    storage_timeout_s: float = 2.0
    io_threads: int = 2
    storage_buffer_bytes: int | None = None
    host_dir: str = "/dev/shm"
    sliding_host_share: float = 0.25

    def __post_init__(self) -> None:
        positive_int("kvtier: host_bytes", self.host_bytes)
        if self.storage is not None and (not isinstance(self.storage, str) or "://" not in self.storage):
            raise UsageError(f"kvtier: storage must be a URL like file:///dir or redis://host:6379/0, "
                             f"got {self.storage!r}")
        if self.namespace is not None and (not isinstance(self.namespace, str) or not self.namespace):
            raise UsageError(f"kvtier: namespace must be a non-empty str, got {self.namespace!r}")
        positive_number("kvtier: storage_timeout_s", self.storage_timeout_s)
        positive_int("kvtier: io_threads", self.io_threads)
        if self.storage_buffer_bytes is not None:
            positive_int("kvtier: storage_buffer_bytes", self.storage_buffer_bytes)
        share = self.sliding_host_share
        if not is_number(share) or not 0 < share <= 1:
            raise UsageError(f"kvtier: sliding_host_share must be a number in (0, 1], got {share!r}")
        if not isinstance(self.host_dir, str) or not self.host_dir.startswith("/"):
            raise UsageError(f"kvtier: host_dir must be an absolute directory path, got {self.host_dir!r}")

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> "KVTierConfig":
        """kvtier's settings from vLLM's ``kv_connector_extra_config``; ``ValueError``
        naming any key that neither kvtier nor vLLM's connector knows."""
        unknown = sorted(set(extra) - VLLM_KEYS - set(KVTIER_KEYS))
        if unknown:
            near = {k: difflib.get_close_matches(k, [*KVTIER_KEYS, *VLLM_KEYS], n=1) for k in unknown}
            hints = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in near.items() if m)
            hints = f" ({hints})" if hints else ""
            raise UsageError(f"kvtier: unknown kv_connector_extra_config keys {unknown}{hints}; kvtier's keys: "
                             f"{', '.join(KVTIER_KEYS)}; vLLM's: {', '.join(sorted(VLLM_KEYS))}")
        if "host_bytes" not in extra:
            raise UsageError("kvtier: kv_connector_extra_config needs host_bytes (bytes of host memory for the "
                             "host tier), e.g. {'host_bytes': 1 << 30}")
        return cls(**{k: extra[k] for k in KVTIER_KEYS if k in extra})
