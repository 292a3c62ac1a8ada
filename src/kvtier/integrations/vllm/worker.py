"""The worker side: copies between vLLM's KV blocks and the host tier's pages."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult

from ...pools.views import PageViews
from ...transfer import copy_pages
from .manager import KVTierLoadStoreSpec
from .tier import HostTier


class KVTierOffloadingWorker(OffloadingWorker):
    """Moves whole blocks with kvtier's page copy engine (coalesced runs of consecutive
    pages; threads on the CPU, a kernel on CUDA).

    ``layer_rows``: each layer's ``(num_blocks, page_bytes)`` int8 rows, in the order
    of the tier's spec layers. Copies finish inside ``submit_*`` (vLLM defers stores to
    the start of the next step, and a load's request waits for it anyway), so
    :meth:`wait` has nothing to wait for.
    """

    def __init__(self, tier: HostTier, layer_rows: list[torch.Tensor],
                 on_shutdown: Callable[[], None] | None = None) -> None:
        fmt = tier.format
        if len(layer_rows) != fmt.spec.layer_num:
            raise ValueError(f"kvtier: {len(layer_rows)} KV layers, the tier's format has {fmt.spec.layer_num}")
        self.tier = tier
        views = fmt.views(layer_rows)
        self._engine = {name: PageViews.build(None, views[name]) for name in fmt.spec.names}
        self._block_bytes = fmt.page_size * fmt.spec.bytes_per_token
        self._finished: list[TransferResult] = []
        self._on_shutdown = on_shutdown

    def _copy(self, job_id: int, blocks: np.ndarray, pages: np.ndarray, to_host: bool) -> bool:
        start = time.perf_counter()
        blocks_t = torch.from_numpy(np.asarray(blocks, dtype=np.int64))
        pages_t = torch.from_numpy(np.asarray(pages, dtype=np.int64))
        if len(blocks_t) != len(pages_t):
            raise ValueError(f"kvtier: job {job_id} moves {len(blocks_t)} blocks into {len(pages_t)} pages")
        host = self.tier.pool.page_views
        if to_host:
            pairs = [(host[n], self._engine[n]) for n in self._engine]
            dst, src = pages_t, blocks_t
        else:
            pairs = [(self._engine[n], host[n]) for n in self._engine]
            dst, src = blocks_t, pages_t
        nbytes = len(pages_t) * self._block_bytes
        copy_pages(pairs, dst, src, layer=None, nbytes=nbytes, io_backend="auto",
                   threads=self.tier.pool.copy_threads, workers=self.tier.pool.copy_workers)
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KVTierLoadStoreSpec), f"store into {type(dst_spec).__name__}"
        return self._copy(job_id, src_spec.block_ids, dst_spec.pages, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, KVTierLoadStoreSpec), f"load from {type(src_spec).__name__}"
        return self._copy(job_id, dst_spec.block_ids, src_spec.pages, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every submitted copy has already finished

    def shutdown(self) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown()
