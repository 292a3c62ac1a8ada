"""What the copy backends share: I/O worker threads over chunks of a batch, and a
per-thread staging arena."""

from __future__ import annotations

import threading
from abc import abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from .base import Storage, _check_keys
from .options import Opt, check_options

#: Payload bytes packed per backend round trip: bounds memory for large batches.
BATCH_BYTES = 64 << 20


def aligned(raw: np.ndarray, nbytes: int, align: int) -> np.ndarray:
    """The first ``nbytes`` of the bytes ``raw`` (at least ``nbytes + align - 1`` of them)
    that start at a multiple of ``align``."""
    skip = -raw.ctypes.data % align
    return raw[skip:skip + nbytes]


class ThreadedStorage(Storage):
    """A backend whose batches run on ``io_threads`` workers, the calling thread being one.

    Staging lives in a per-thread arena reused across calls: fresh buffers of a batch's
    size would be page-faulted in on every call, which costs as much as the copy itself.
    """

    OPTIONS = {**Storage.OPTIONS, "io_threads": Opt(int, 1)}
    #: Payload bytes one worker moves per step (at least one page).
    CHUNK_BYTES = BATCH_BYTES

    def __init__(self, *, io_threads: int = 2, **options) -> None:
        super().__init__(**options)
        check_options(self.OPTIONS, io_threads=io_threads)
        self.io_threads = io_threads
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _arena(self, nbytes: int, align: int = 1) -> np.ndarray:
        """This thread's staging, ``nbytes`` starting at a multiple of ``align`` bytes."""
        arena = getattr(self._local, "arena", None)
        if arena is None or arena.nbytes < nbytes + align - 1:
            arena = self._local.arena = np.empty(nbytes + align - 1, dtype=np.uint8)
        return aligned(arena, nbytes, align)

    # -- the contract, on each backend's primitives ----------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> int:
        present = self.exists_each(keys)
        return next((i for i, p in enumerate(present) if not p), len(present))

    def delete(self, keys: Sequence[str]) -> None:
        keys = _check_keys(keys)
        try:
            self._remove_keys(keys)
        except Exception as e:
            self._fault("delete", e)

    def clear(self) -> None:
        try:
            self._remove_all()
        except Exception as e:
            self._fault("clear", e)

    @abstractmethod
    def _remove_keys(self, keys: list[str]) -> None:
        """Remove every object of each key."""

    @abstractmethod
    def _remove_all(self) -> None:
        """Remove every object this backend stored."""

    @staticmethod
    def _carve(arena: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
        offsets = np.cumsum([0, *sizes]).tolist()
        return [arena[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def _run(self, fn, n: int, page_bytes: int, least: int = 1) -> None:
        """``fn(range)`` over chunks of the ``n`` pages: at most ``CHUNK_BYTES`` each (but
        at least ``least`` pages, and never more than a worker's share), taken in turn by
        up to ``io_threads`` workers, the calling thread being one of them. File reads,
        socket I/O, checksums and numpy copies release the GIL, so one worker's I/O
        overlaps another's checks and copies."""
        per_thread = -(-n // self.io_threads)
        step = max(1, min(per_thread, max(least, self.CHUNK_BYTES // max(page_bytes, 1))))
        chunks = [range(a, min(n, a + step)) for a in range(0, n, step)]
        helpers = min(self.io_threads, len(chunks)) - 1
        if helpers <= 0:
            for chunk in chunks:
                fn(chunk)
            return
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads - 1, thread_name_prefix=f"kvtier-{self.scheme}")
            pool = self._pool
        todo, todo_lock = iter(chunks), threading.Lock()

        def work() -> None:
            # NOTE: workers take the next chunk when done with one, so a worker slowed by
            # a busy core takes fewer chunks instead of holding up the call.
            while True:
                with todo_lock:
                    chunk = next(todo, None)
                if chunk is None:
                    return
                fn(chunk)

        futures = []
        for _ in range(helpers):
            try:
                futures.append(pool.submit(work))
            except RuntimeError:  # close() on another thread shut the pool down since it was taken:
                break  # this thread takes the chunks no helper took
        try:
            work()
        finally:  # never return (or raise) while a helper may still write into the pool
            for future in futures:
                future.exception()
        for future in futures:
            future.result()

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        super().close()
