"""A stand-in for ``torchvision``, which the sglang test environment never installs.

The package index's torchvision is a CUDA build that breaks on the CPU torch, and
sglang imports it at module level in multimodal code these tests never run (e.g.
``from torchvision.transforms import InterpolationMode``). Every submodule imports,
every attribute is a placeholder, and calling one raises, so a test that reached
real torchvision code would fail loudly instead of computing with a fake. The
placeholders are the ones ``kvtier bench cache`` uses for the same imports
(``kvtier.bench._torchvision_standin``); here the stand-in stays for the session.
"""

from __future__ import annotations

import sys

from kvtier.bench._torchvision_standin import Finder, placeholder_attribute

__version__ = "0.0.0+kvtier-standin"

sys.meta_path.insert(0, Finder())  # the submodules (this module is the package itself)
__getattr__ = placeholder_attribute
