"""What this machine's CPU caches hold, as Linux's sysfs tells it: the sizes that
kvtier's copy and write paths, and its benchmarks' limits, are cut to."""

from __future__ import annotations

import os

#: sysfs's caches of the first CPU (``index*/level``, ``type``, ``size`` such as ``2048K``)
CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"


def cache_bytes(level: int, cache_dir: str = CACHE_DIR, default: int = 0) -> int:
    """Bytes of the data (or unified) cache at ``level`` that the first CPU uses, or
    ``default`` where sysfs does not tell (no such folder, level or size)."""
    try:
        for index in sorted(os.listdir(cache_dir)):
            at = os.path.join(cache_dir, index)
            with open(os.path.join(at, "level")) as f_level, open(os.path.join(at, "type")) as f_type:
                if f_level.read().strip() != str(level) or f_type.read().strip() not in ("Unified", "Data"):
                    continue
            with open(os.path.join(at, "size")) as f:
                size = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            return int(size.rstrip("KMG")) * scale
    except (OSError, ValueError):
        pass
    return default
