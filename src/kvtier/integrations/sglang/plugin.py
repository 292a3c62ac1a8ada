"""sglang general plugin: kvtier host pools in sglang's processes, when asked.

sglang spawns its scheduler processes, so a patch made in the launching process does
not reach the process that builds the cache. sglang 0.5.23 runs every entry point of
the group ``sglang.srt.plugins`` at the start of each of its processes
(``load_plugins()``, before the cache is built and before the server args are
published); kvtier's entry point is::

    [project.entry-points."sglang.srt.plugins"]
    kvtier_host_pool = "kvtier.integrations.sglang.plugin:load"

It changes nothing unless asked. ``KVTIER_SGLANG_HOST_POOL`` names a mode:
``asymmetric`` (kvtier pools for ``head_dim != v_head_dim``), ``all`` (every MHA model)
or ``off`` (nothing, whatever the storage backend). Unset or empty: kvtier's pools for
``head_dim != v_head_dim`` only when kvtier's ``KVTierStorage`` is sglang's configured
HiCache storage backend (``--hicache-storage-backend dynamic``, its extra config's
``module_path``/``class_name`` naming it), decided when sglang picks the host-pool
class, after it published its server args; otherwise sglang's own pools.
sglang's ``SGLANG_PLUGINS`` (comma-separated names) can also leave the plugin out.

sglang logs and skips a plugin that raises an ``Exception``, so a value kvtier does
not know, or a pool class it cannot install, ends the process with ``SystemExit`` and
one line naming it (sglang's loader does not catch it). Logging is not set up yet when
the plugin runs; the line naming each pool kvtier took over comes when sglang picks
the class (logger ``sglang.kvtier``).
"""

from __future__ import annotations

import os

from ...errors import UsageError

ENV = "KVTIER_SGLANG_HOST_POOL"
MODES = {"asymmetric": False, "all": True, "off": None}  # mode -> install_host_pool(symmetric=...)


def mode_from_env(environ=os.environ) -> str | None:
    """The mode ``KVTIER_SGLANG_HOST_POOL`` names, None where it is unset or empty;
    ``ValueError`` for anything else."""
    raw = environ.get(ENV, "")
    mode = raw.strip().lower()
    if not mode:
        return None
    if mode not in MODES:
        raise UsageError(f"{ENV}={raw!r} is not a kvtier host-pool mode; use one of {', '.join(MODES)}, or unset it")
    return mode


def load() -> None:
    """sglang calls this in each of its processes (see the module docstring)."""
    try:
        mode = mode_from_env()
    except ValueError as e:
        raise SystemExit(f"kvtier: {e}") from None
    if mode == "off":
        return
    if mode is None:
        from .install import install_host_pool_if_storage_backend

        install_host_pool_if_storage_backend()
        return
    try:
        from .install import install_host_pool

        install_host_pool(symmetric=MODES[mode], reason=f"{ENV}={mode}")
    except Exception as e:
        raise SystemExit(f"kvtier: {ENV}={mode}, but kvtier cannot install its host pool KVTierMHAHostPool in sglang: "
                         f"{type(e).__name__}: {' '.join(str(e).split())}") from None
