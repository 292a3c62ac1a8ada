"""kvtier's optional compiled modules, and the one switch that turns them off.

``setup.py`` builds each as an ``optional=True`` extension: where a C compiler is
missing the install goes on without it and kvtier uses its pure-Python path.
``KVTIER_NATIVE=0`` keeps to the pure paths even where the modules are built.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def switched_on() -> bool:
    """Whether ``KVTIER_NATIVE`` allows the compiled paths (read now)."""
    return os.environ.get("KVTIER_NATIVE", "1") != "0"


def built(name: str) -> ModuleType | None:
    """The compiled module ``name``, or ``None`` where it was not built."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def load(name: str) -> ModuleType | None:
    """The compiled module ``name`` where it is built and the switch allows it, else ``None``."""
    return built(name) if switched_on() else None
