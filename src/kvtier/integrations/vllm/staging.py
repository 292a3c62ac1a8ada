"""The staging buffer between kvtier's vLLM host tier and storage.

No storage call ever reads or fills a host page itself: a write first copies its
pages here and writes from here, a read lands here and is copied into host pages
only once it is complete and verified. A storage call that hangs or crawls then
holds staging pages, never host pages, and a full buffer is the backlog's bound:
what does not fit is dropped (the tier counts it), not queued.

One staging pool per distinct shard of the tier's ranks (ranks that hold the same
heads share one), all with the same page numbers. Not thread-safe: the tier calls
:meth:`take` and :meth:`give` under its lock; copies run outside it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ...pools import HostKVPool
from ...pools.allocator import PageAllocator
from ...transfer import copy_pages


def copy_between(dst: HostKVPool, dst_pages: np.ndarray, src: HostKVPool, src_pages: np.ndarray) -> None:
    """Copy whole pages ``src_pages[i]`` of ``src`` into ``dst_pages[i]`` of ``dst``
    (pools of one spec, page size and layout)."""
    if len(dst_pages) == 0:
        return
    pairs = [(dst.page_views[n], src.page_views[n]) for n in dst.spec.names]
    copy_pages(pairs, torch.from_numpy(np.asarray(dst_pages, dtype=np.int64)),
               torch.from_numpy(np.asarray(src_pages, dtype=np.int64)), layer=None,
               nbytes=len(dst_pages) * dst.page_bytes, io_backend="direct", threads=dst.copy_threads,
               workers=dst.copy_workers)


class StagingBuffer:
    """``pages`` staging pages for each of ``groups`` (shard spec -> the ranks holding
    it) of the host ``pools``."""

    def __init__(self, pools: Sequence[HostKVPool], groups: dict, pages: int) -> None:
        self.pages, self._hosts, self._groups = pages, pools, groups
        self._free = PageAllocator(pages, 1)
        first = pools[0]
        self.pools = {spec: HostKVPool(spec, pages * first.page_size, first.page_size,
                                       layout=pools[ranks[0]].layout, pin_memory=False)
                      for spec, ranks in groups.items()}
        for pool in self.pools.values():  # touched now, not in the first reads (see region._populate)
            for buf in pool.buffers.values():
                buf.view(torch.uint8).zero_()

    def take(self, keys: int, per_key: int) -> np.ndarray:
        """Staging pages for as many of ``keys`` blocks of ``per_key`` pages as are free
        (``len(result) // per_key`` of them; none when full): the rest do not wait."""
        fits = min(keys, self._free.available_size() // per_key)
        return self._free.alloc(fits * per_key).numpy()

    def give(self, pages: np.ndarray) -> None:
        self._free.free(torch.from_numpy(pages))

    def stage_out(self, staging: np.ndarray, host: np.ndarray) -> None:
        """Host pages ``host`` -> staging pages ``staging``, once per distinct shard."""
        for spec, ranks in self._groups.items():
            copy_between(self.pools[spec], staging, self._hosts[ranks[0]], host)

    def stage_in(self, host: np.ndarray, staging: np.ndarray) -> None:
        """Staging pages ``staging`` -> host pages ``host`` of every rank."""
        for spec, ranks in self._groups.items():
            for rank in ranks:
                copy_between(self._hosts[rank], host, self.pools[spec], staging)
