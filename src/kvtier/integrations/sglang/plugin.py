"""sglang general plugin: installs kvtier host pools in every sglang process.

sglang spawns its scheduler processes, so a patch made in the launching process does
not reach the process that builds the cache. sglang 0.5.23 runs every entry point of
the group ``sglang.srt.plugins`` at the start of each scheduler process
(``load_plugins()``, before the cache is built); kvtier's entry point is::

    [project.entry-points."sglang.srt.plugins"]
    kvtier_host_pool = "kvtier.integrations.sglang.plugin:load"

``KVTIER_SGLANG_HOST_POOL`` chooses what it does: ``asymmetric`` (the default: kvtier
pools for ``head_dim != v_head_dim``), ``all`` (every MHA model) or ``off``. sglang's
``SGLANG_PLUGINS`` (comma-separated names) can also leave it out.
"""

from __future__ import annotations

import os

ENV = "KVTIER_SGLANG_HOST_POOL"
MODES = {"asymmetric": False, "all": True, "off": None}  # mode -> install_host_pool(symmetric=...)


def mode_from_env(environ=os.environ) -> str:
    """The mode ``KVTIER_SGLANG_HOST_POOL`` names; ``ValueError`` for anything else."""
    mode = environ.get(ENV, "asymmetric").strip().lower() or "asymmetric"
    if mode not in MODES:
        raise ValueError(f"{ENV}={environ[ENV]!r}; use one of {sorted(MODES)}")
    return mode


def load() -> None:
    """sglang calls this in each of its processes (see the module docstring)."""
    symmetric = MODES[mode_from_env()]
    if symmetric is None:
        return
    from .install import install_host_pool

    install_host_pool(symmetric=symmetric)
