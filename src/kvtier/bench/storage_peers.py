"""Peers' file tiers for ``kvtier bench storage``, where they are installed: vLLM's
``fs`` secondary tier (``vllm.v1.kv_offload.tiering.fs.io``, vLLM 0.32), driven through
its own batch functions, buffered and with O_DIRECT (its default where the
filesystem allows it), one file per page from one contiguous buffer, the pages
split between ``threads``.

NOTE: vLLM's tier (``manager.py``) starts 16 read-priority and 16 write-priority
threads, but submits each transfer job (one request's blocks) as a single task: one
thread reads or writes a job's blocks one after another, and only concurrent jobs
use more threads. So a batch split between kvtier's ``io_threads`` (2 by default)
gives vLLM at least the requests in flight that one of its jobs has."""

from __future__ import annotations

import importlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..storage.threaded import aligned


def vllm_fs_io():
    """vLLM's fs tier I/O module, or ``None`` where vLLM (0.32 or later) is not installed."""
    try:
        return importlib.import_module("vllm.v1.kv_offload.tiering.fs.io")
    except Exception:  # not installed, or an install that fails to import here
        return None


class VllmFsTier:
    """``put``/``get``/``clear`` of ``pages`` blocks of ``block_bytes`` through vLLM's fs tier."""

    def __init__(self, io, root: Path, pages: int, block_bytes: int, threads: int, o_direct: bool) -> None:
        self.io, self.root, self.threads, self.o_direct = io, root, threads, o_direct
        self.block = block_bytes
        # NOTE: page-aligned, as vLLM's CPU pool is: O_DIRECT needs aligned buffers
        self.buf = aligned(np.ones(pages * block_bytes + 4096, dtype=np.uint8), pages * block_bytes, 4096)
        self.view = memoryview(self.buf)
        self.paths = [f"{root}/{i // 256:03d}/{i}.bin" for i in range(pages)]
        self.offsets = [i * block_bytes for i in range(pages)]

    @staticmethod
    def available(io, root: Path) -> bool:
        """Whether O_DIRECT works in ``root`` (vLLM's own probe)."""
        root.mkdir(parents=True, exist_ok=True)
        return bool(io.probe_o_direct(str(root)))

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)

    def _split(self, fn) -> None:
        n = len(self.paths)
        share = -(-n // self.threads)
        parts = [range(t * share, min(n, (t + 1) * share)) for t in range(self.threads)]
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(lambda r: fn([self.paths[i] for i in r], self.view, [self.offsets[i] for i in r],
                                       self.block, self.o_direct), [r for r in parts if len(r)]))

    def put(self) -> None:
        self._split(self.io.batch_store_block)

    def get(self) -> None:
        self._split(self.io.batch_load_block)
