"""The worker side: copies between vLLM's KV blocks and this rank's host pools (one per KV cache group)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult

from ...errors import UsageError
from ...pools import HostKVPool
from ...pools.views import PageViews
from ...transfer import copy_pages
from .blocks import BlockFormat
from .manager import KVTierLoadStoreSpec


def block_pages(gpu: GPULoadStoreSpec, pages: np.ndarray, blocks_per_key: int,
                groups: np.ndarray | None = None) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``(group, vLLM blocks, host pages)`` of one job, for each group it moves.

    ``pages`` holds ``blocks_per_key`` host pages per offloaded block (key), one per
    vLLM block it spans; ``groups`` the group position of each key (None: all 0).
    vLLM's block ids come group by group (``group_sizes``); group ``g``'s cover
    consecutive blocks of the request starting at block ``block_indices[g]``, which may
    sit inside an offloaded block: its first ``block_indices[g] % blocks_per_key`` vLLM
    blocks are then not moved, nor the pages after the group's last block (a load
    that ends inside an offloaded block). ``ValueError`` when keys and blocks disagree."""
    blocks = np.asarray(gpu.block_ids, dtype=np.int64)
    sizes = [int(n) for n in gpu.group_sizes] if gpu.group_sizes is not None else [len(blocks)]
    starts = [int(i) for i in gpu.block_indices] if gpu.block_indices is not None else [0] * len(sizes)
    per_key = np.asarray(pages, dtype=np.int64).reshape(-1, blocks_per_key)
    key_groups = np.zeros(len(per_key), dtype=np.int64) if groups is None else np.asarray(groups, dtype=np.int64)
    if len(key_groups) != len(per_key) or sum(sizes) != len(blocks) or len(starts) != len(sizes):
        raise UsageError(f"kvtier: a job of {len(blocks)} vLLM blocks in groups of {sizes} (first blocks {starts}) "
                         f"for {len(per_key)} offloaded blocks of groups {key_groups.tolist()}")
    out, at = [], 0
    for g, (n, first) in enumerate(zip(sizes, starts)):
        host = per_key[key_groups == g].ravel()
        skip = first % blocks_per_key
        if not 0 <= len(host) - skip - n < blocks_per_key or (n == 0) != (len(host) == 0):
            raise UsageError(f"kvtier: group {g}: {n} vLLM blocks (skipping {skip}) for {len(host)} host pages of "
                             f"{len(host) // blocks_per_key} offloaded blocks")
        if n:
            out.append((g, blocks[at:at + n], host[skip:skip + n]))
        at += n
    extra = set(key_groups.tolist()) - set(range(len(sizes)))
    if extra:
        raise UsageError(f"kvtier: offloaded blocks of groups {sorted(extra)} in a job over {len(sizes)} groups")
    return out


@dataclass
class WorkerGroup:
    """One KV cache group on this rank: its host pool, block format and layer rows."""

    pool: HostKVPool
    format: BlockFormat
    layer_rows: list[torch.Tensor]


class KVTierOffloadingWorker(OffloadingWorker):
    """Moves whole blocks with kvtier's page copy engine (coalesced runs of consecutive
    pages; threads on the CPU, a kernel on CUDA), each group through its own format.

    ``groups[g]``: group ``g``'s host pool on this rank, one page per vLLM block (the
    pool file the scheduler's tier maps too), its :class:`BlockFormat`, and each layer's
    ``(num_blocks, page_bytes)`` int8 rows in the order of the format's layers (groups
    may share tensors: their blocks are disjoint). A copy has landed when ``submit_*``
    returns (on an accelerator the stream is synchronised first): vLLM defers stores
    to the start of the next step and reuses a store's blocks once it is reported
    finished, so :meth:`wait` finds nothing left to wait for.
    """

    def __init__(self, groups: Sequence[WorkerGroup], *, blocks_per_key: int = 1,
                 on_shutdown: Callable[[], None] | None = None) -> None:
        self.groups, self.blocks_per_key = list(groups), blocks_per_key
        self._engines, self._block_bytes = [], []
        for g, group in enumerate(self.groups):
            fmt = group.format
            if len(group.layer_rows) != fmt.spec.layer_num:
                raise UsageError(f"kvtier: group {g} has {len(group.layer_rows)} KV layers, its format "
                                 f"{fmt.spec.layer_num}")
            views = fmt.views(group.layer_rows)
            self._engines.append({name: PageViews.build(None, views[name]) for name in fmt.spec.names})
            self._block_bytes.append(fmt.page_size * fmt.spec.bytes_per_token)
        self._accelerated = [r.device for group in self.groups for r in group.layer_rows if r.device.type != "cpu"]
        self._finished: list[TransferResult] = []
        self._on_shutdown = on_shutdown

    @classmethod
    def single(cls, pool: HostKVPool, fmt: BlockFormat, layer_rows: list[torch.Tensor], **kw):
        """The worker of a model with one KV cache group."""
        return cls([WorkerGroup(pool, fmt, list(layer_rows))], **kw)

    @property
    def pool(self) -> HostKVPool:
        """Group 0's host pool."""
        return self.groups[0].pool

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, host: LoadStoreSpec, to_host: bool) -> bool:
        if not isinstance(host, KVTierLoadStoreSpec):
            raise TypeError(f"kvtier: job {job_id} names {type(host).__name__}, not kvtier's host pages")
        start = time.perf_counter()
        nbytes = 0
        for g, blocks, pages in block_pages(gpu, host.pages, self.blocks_per_key, host.groups):
            pool, engine = self.groups[g].pool, self._engines[g]
            blocks_t, pages_t = torch.from_numpy(blocks), torch.from_numpy(pages)
            if to_host:
                pairs = [(pool.page_views[n], engine[n]) for n in engine]
                dst, src = pages_t, blocks_t
            else:
                pairs = [(engine[n], pool.page_views[n]) for n in engine]
                dst, src = blocks_t, pages_t
            size = len(pages) * self._block_bytes[g]
            copy_pages(pairs, dst, src, layer=None, nbytes=size, io_backend="auto",
                       threads=pool.copy_threads, workers=pool.copy_workers)
            nbytes += size
        for device in dict.fromkeys(self._accelerated):
            torch.accelerator.synchronize(device)  # the bytes are where the job says before it is reported done
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
        return  # every submitted copy landed before its submit returned

    def shutdown(self) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown()
