"""Build hook for the optional compiled copy path (metadata lives in pyproject.toml).

``kvtier.transfer._native`` is ``optional``: where it fails to compile (no compiler,
unusual platform) setuptools skips it and kvtier uses its pure numpy copy path.
"""

import sys

from setuptools import Extension, setup

_ARGS = [] if sys.platform == "win32" else ["-O3", "-std=c99"]

setup(ext_modules=[Extension("kvtier.transfer._native", ["src/kvtier/transfer/_native.c"],
                             optional=True, extra_compile_args=_ARGS)])
