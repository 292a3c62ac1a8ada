"""Build hook for kvtier's optional compiled parts (metadata lives in pyproject.toml).

``kvtier.transfer._native`` (the CPU block copy), ``kvtier.cache._tokens`` (token ids
from lists, the radix walk) and ``kvtier.pools._indices`` (slot checks, page expansion) and ``kvtier.storage._pageio``
(a page file's parts moved and checksummed) are
``optional``: where one fails to compile (no compiler, unusual platform) setuptools
skips it and kvtier uses its pure-Python path.
"""

import sys

from setuptools import Extension, setup

_ARGS = [] if sys.platform == "win32" else ["-O3", "-std=c99"]
_THREADS = [] if sys.platform == "win32" else ["-pthread"]  # _pageio's hasher, _native's copy threads

setup(ext_modules=[Extension("kvtier.transfer._native", ["src/kvtier/transfer/_native.c"],
                             depends=["src/kvtier/_lines.h", "src/kvtier/_sequences.h",
                                      "src/kvtier/transfer/_copy_loop.h", "src/kvtier/transfer/_copy_pool.h"],
                             optional=True,
                             extra_compile_args=_ARGS + _THREADS,
                             extra_link_args=_THREADS),
                   Extension("kvtier.cache._tokens", ["src/kvtier/cache/_tokens.c"],
                             depends=["src/kvtier/_slots.h", "src/kvtier/_lines.h"], optional=True,
                             extra_compile_args=_ARGS),
                   Extension("kvtier.pools._indices", ["src/kvtier/pools/_indices.c"],
                             depends=["src/kvtier/_sequences.h", "src/kvtier/_slots.h", "src/kvtier/_lines.h"],
                             optional=True,
                             extra_compile_args=_ARGS),
                   Extension("kvtier.storage._pageio",
                             ["src/kvtier/storage/_pageio.c", "src/kvtier/storage/_pageio_read.c",
                              "src/kvtier/storage/_pageio_shape.c", "src/kvtier/storage/_pageio_write.c"],
                             depends=["src/kvtier/storage/_pageio.h", "src/kvtier/_lines.h", "src/kvtier/_sequences.h"],
                             optional=True, extra_compile_args=_ARGS + _THREADS, extra_link_args=_THREADS)])
