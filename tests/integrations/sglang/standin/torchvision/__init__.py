"""A stand-in for ``torchvision``, which the sglang test environment never installs.

The package index's torchvision is a CUDA build that breaks on the CPU torch, and
sglang imports it at module level in multimodal code these tests never run (e.g.
``from torchvision.transforms import InterpolationMode``). Every submodule imports,
every attribute is a placeholder, and calling one raises, so a test that reached
real torchvision code would fail loudly instead of computing with a fake.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvtier-standin"


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Placeholder(metaclass=_PlaceholderMeta):
    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("torchvision is a test stand-in here (see tests/integrations/sglang/standin)")


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder
