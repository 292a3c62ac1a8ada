"""kvtier's optional compiled modules, and the one switch that turns them off.

``setup.py`` builds each as an ``optional=True`` extension: where a C compiler is
missing the install goes on without it and kvtier uses its pure-Python path.
``KVTIER_NATIVE=0`` keeps to the pure paths even where the modules are built.

Every compiled module is reached through :func:`load`, which reads the switch at each
call (the import itself is done once), so ``KVTIER_NATIVE=0`` set at any time, e.g. by
a test's ``monkeypatch.setenv``, turns every path at its next call. A caller reads it
once per public call, never inside a loop: the radix walk loads ``walk_run`` before it
walks, not per node.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

# NOTE: ``os.environ.get`` costs 0.2-0.6 us (it encodes the key, and raises and catches a
# KeyError when the variable is unset), a twentieth of a cache hit for its three reads.
# The encoded dict that ``os.environ`` keeps, and that its writes update, answers the
# same in 25 ns.
try:
    _ENVIRON, _KEY, _OFF = os.environ._data, os.environ.encodekey("KVTIER_NATIVE"), os.environ.encodevalue("0")
except AttributeError:  # an ``os.environ`` that is not CPython's ``os._Environ``
    _ENVIRON, _KEY, _OFF = os.environ, "KVTIER_NATIVE", "0"


class _Imported(dict):
    """Module name -> the module, or ``None`` where it was not built (imported once)."""

    def __missing__(self, name: str) -> ModuleType | None:
        try:
            module = importlib.import_module(name)
        except ImportError:
            module = None
        self[name] = module
        return module


_imported = _Imported()


def switched_on() -> bool:
    """Whether ``KVTIER_NATIVE`` allows the compiled paths (read now)."""
    return _ENVIRON.get(_KEY) != _OFF


def built(name: str) -> ModuleType | None:
    """The compiled module ``name``, or ``None`` where it was not built (switch or not)."""
    return _imported[name]


def load(name: str) -> ModuleType | None:
    """The compiled module ``name`` where it is built and the switch allows it (read
    now), else ``None``: what every path that has a compiled twin asks at each call."""
    return _imported[name] if _ENVIRON.get(_KEY) != _OFF else None  # switched_on(), without its call
