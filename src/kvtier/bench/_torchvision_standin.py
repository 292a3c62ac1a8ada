"""A stand-in for ``torchvision`` while sglang's cache modules import, where torchvision
is not installed.

sglang 0.5.23's ``sglang.srt.mem_cache.memory_pool`` imports ``sglang.srt.configs``,
whose ``__init__`` imports every model's config, multimodal ones included, and
``sglang.srt.multimodal.internvl_utils`` imports ``torchvision.transforms`` at module
level. The radix tree never runs that code, and the package index's torchvision is a
CUDA build that fails on a CPU torch, so a CPU environment (kvtier's ``.venv-sglang``)
goes without it. The tests put the same kind of stand-in on ``sys.path``
(``tests/integrations/sglang/standin``).

Every submodule imports and every attribute is a placeholder whose call raises: code
that reached torchvision would fail loudly instead of computing with a fake. The
stand-in answers imports only inside :func:`torchvision_standin`; after it, its modules
leave ``sys.modules`` and ``import torchvision`` fails as before (what imported them
keeps its placeholders).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from contextlib import contextmanager

_NAME = "torchvision"


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Placeholder(metaclass=_PlaceholderMeta):
    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("torchvision is not installed: this is kvtier's stand-in for sglang's imports of it")


def placeholder_attribute(name: str):
    """A stand-in module's attribute ``name``: a placeholder (dunder names are missing)."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        return placeholder_attribute(name)


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of ``torchvision`` and its submodules with stand-in modules."""

    def find_spec(self, fullname, path, target=None):
        if fullname == _NAME or fullname.startswith(_NAME + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


@contextmanager
def torchvision_standin():
    """Within: ``torchvision`` and its submodules import as stand-ins, unless the real
    one is installed. Yields whether the stand-in is in."""
    if importlib.util.find_spec(_NAME) is not None:
        yield False
        return
    # NOTE: transformers decides once, at import, whether torchvision is installed, and
    # must decide "no" (the stand-in cannot do what it would then ask of it): it goes first
    if importlib.util.find_spec("transformers") is not None:
        importlib.import_module("transformers")
    finder = Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield True
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n, m in sys.modules.items() if isinstance(m, _StandInModule)]:
            del sys.modules[name]
