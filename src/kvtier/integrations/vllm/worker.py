"""The worker side: copies between vLLM's KV blocks and this rank's host pool."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult

from ...pools import HostKVPool
from ...pools.views import PageViews
from ...transfer import copy_pages
from .blocks import BlockFormat
from .manager import KVTierLoadStoreSpec


def block_pages(gpu: GPULoadStoreSpec, pages: np.ndarray, blocks_per_key: int) -> tuple[np.ndarray, np.ndarray]:
    """``(vLLM blocks, host pages)`` pairs of one job.

    ``pages`` holds ``blocks_per_key`` host pages per offloaded block, one per vLLM
    block it spans. vLLM's block ids cover consecutive blocks of the request starting
    at block ``block_indices[0]``, which may sit inside an offloaded block: its first
    ``block_indices[0] % blocks_per_key`` vLLM blocks are then not moved. Every host
    page after those is."""
    blocks = np.asarray(gpu.block_ids, dtype=np.int64)
    sizes = list(gpu.group_sizes) if gpu.group_sizes is not None else [len(blocks)]
    if len(sizes) != 1:
        raise ValueError(f"kvtier: a job over {len(sizes)} KV cache groups; this spec serves one")
    skip = int(gpu.block_indices[0]) % blocks_per_key if gpu.block_indices else 0
    host = np.asarray(pages, dtype=np.int64)[skip:]
    if len(host) != len(blocks):
        raise ValueError(f"kvtier: {len(blocks)} vLLM blocks (skipping {skip}) for {len(pages)} host pages of "
                         f"{len(pages) // blocks_per_key} offloaded blocks")
    return blocks, host


class KVTierOffloadingWorker(OffloadingWorker):
    """Moves whole blocks with kvtier's page copy engine (coalesced runs of consecutive
    pages; threads on the CPU, a kernel on CUDA).

    ``pool``: this rank's host pool, one page per vLLM block (the pool file the
    scheduler's tier maps too). ``layer_rows``: each layer's ``(num_blocks, page_bytes)``
    int8 rows, in the order of the format's layers. Copies finish inside ``submit_*``
    (vLLM defers stores to the start of the next step, and a load's request waits for
    it anyway), so :meth:`wait` has nothing to wait for.
    """

    def __init__(self, pool: HostKVPool, fmt: BlockFormat, layer_rows: list[torch.Tensor], *,
                 blocks_per_key: int = 1, on_shutdown: Callable[[], None] | None = None) -> None:
        if len(layer_rows) != fmt.spec.layer_num:
            raise ValueError(f"kvtier: {len(layer_rows)} KV layers, the tier's format has {fmt.spec.layer_num}")
        self.pool, self.format, self.blocks_per_key = pool, fmt, blocks_per_key
        views = fmt.views(layer_rows)
        self._engine = {name: PageViews.build(None, views[name]) for name in fmt.spec.names}
        self._block_bytes = fmt.page_size * fmt.spec.bytes_per_token
        self._finished: list[TransferResult] = []
        self._on_shutdown = on_shutdown

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, host: LoadStoreSpec, to_host: bool) -> bool:
        if not isinstance(host, KVTierLoadStoreSpec):
            raise TypeError(f"kvtier: job {job_id} names {type(host).__name__}, not kvtier's host pages")
        start = time.perf_counter()
        blocks, pages = block_pages(gpu, host.pages, self.blocks_per_key)
        blocks_t, pages_t = torch.from_numpy(blocks), torch.from_numpy(pages)
        views = self.pool.page_views
        if to_host:
            pairs = [(views[n], self._engine[n]) for n in self._engine]
            dst, src = pages_t, blocks_t
        else:
            pairs = [(self._engine[n], views[n]) for n in self._engine]
            dst, src = blocks_t, pages_t
        nbytes = len(pages) * self._block_bytes
        copy_pages(pairs, dst, src, layer=None, nbytes=nbytes, io_backend="auto",
                   threads=self.pool.copy_threads, workers=self.pool.copy_workers)
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every submitted copy has already finished

    def shutdown(self) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown()
