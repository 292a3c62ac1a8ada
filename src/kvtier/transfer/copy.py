"""Shared pieces of the copy engines: integer views, the thread split, the torch path.

On the CPU the engine (``kvtier.transfer.cpu``) copies numpy views of the pools'
memory: ``np.copyto`` costs about 1 µs a call (a torch ``copy_`` about 4 µs) and
releases the GIL, so a few Python threads split the work (:func:`split_threads`).
Elsewhere (CUDA) the pairs are torch views copied with ``Tensor.copy_``.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import weakref
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch

# numpy has no bfloat16/fp8: views reinterpret elements as integers of the same width.
_NP_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Below this many bytes a call is copied on the calling thread: starting a thread
# (~50 µs) would cost more than it saves.
PARALLEL_MIN_BYTES = 4 << 20
# The compiled copy keeps its threads, spinning between the calls of a burst
# (``_copy_pool.h``), and gives each at least this many bytes: with them running, a hot
# 128 KiB copy took 7.9 µs on two threads and 11.8 on one (64 KiB: 7.4 against 6.4). So
# a 640 KB sliding layer splits, and a machine with many cores does not wake them all
# for a small copy. The compiled copy itself keeps a call under 4 MiB on its own thread
# when they are asleep.
COMPILED_SHARE_MIN_BYTES = 64 << 10

Pair = tuple[Any, Any]
T = TypeVar("T")


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory with elements reinterpreted as same-width ints: numpy-friendly
    and compared bit for bit (NaN payloads included)."""
    return t.detach().view(_NP_BY_SIZE[t.element_size()])


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor, elements reinterpreted as same-width ints."""
    return int_view(t).numpy()


class CopyWorkers:
    """``threads - 1`` daemon threads, started on first use and kept, that run parts of a
    copy beside the calling thread (which runs one part itself).

    Starting a thread per call costs ~100-150 µs here, as much as copying 2 MiB, paid
    by every per-layer load. Several callers may share one set (each waits only for its
    own parts). The threads end when this object is garbage collected.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid: int | None = None  # the process whose threads serve ``_jobs``

    def _start(self) -> None:
        # NOTE: a forked child inherits the queue but not the threads: start its own
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            self._jobs = queue.SimpleQueue()
            for _ in range(self.threads - 1):
                threading.Thread(target=_serve, args=(self._jobs,), name="kvtier-copy", daemon=True).start()
            weakref.finalize(self, _stop, self._jobs, self.threads - 1).atexit = False
            self._pid = os.getpid()

    def run(self, parts: Sequence[Sequence[T]], run: Callable[[Sequence[T]], None]) -> None:
        """``run(part)`` for every part at once: ``parts[0]`` here, the others on the workers.
        The first error of any part is re-raised here, after every part has finished."""
        self._start()
        errors: list[BaseException] = []
        done = [threading.Event() for _ in parts[1:]]
        for part, event in zip(parts[1:], done):
            self._jobs.put((run, part, event, errors))
        try:
            run(parts[0])
        except BaseException as e:
            errors.append(e)
        for event in done:
            event.wait()
        if errors:
            raise errors[0]


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        run, part, event, errors = job
        try:
            run(part)
        except BaseException as e:  # re-raised on the calling thread
            errors.append(e)
        finally:
            # NOTE: drop the views before the caller goes on: a thread that frees a tensor
            # after the main thread began to exit dies inside torch's C++ code and aborts
            # the process ("terminate called without an active exception", exit 134)
            job = run = part = None
            event.set()


def _stop(jobs: queue.SimpleQueue, count: int) -> None:
    # NOTE: never while the interpreter exits (not at exit, nor when the pool is collected
    # during teardown): woken then, the threads die mid-call into C++ code (torch) and
    # abort the process ("terminate called without an active exception", exit 134).
    # Left blocked on the queue, daemon threads end with the process.
    if sys.is_finalizing():
        return
    for _ in range(count):
        jobs.put(None)


def thread_count(nbytes: int, threads: int, workers: CopyWorkers | None = None, *, compiled: bool = False) -> int:
    """Threads worth splitting a copy of ``nbytes`` over, at most ``threads`` (and
    ``workers``' when given): one below ``PARALLEL_MIN_BYTES``; for the compiled copy's
    kept threads, as many as get ``COMPILED_SHARE_MIN_BYTES`` each."""
    if compiled:
        if COMPILED_SHARE_MIN_BYTES > 0:
            threads = min(threads, nbytes // COMPILED_SHARE_MIN_BYTES)
    elif nbytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, threads if workers is None else min(threads, workers.threads))


def split_threads(items: Sequence[T], nbytes: int, threads: int, run: Callable[[Sequence[T]], None],
                  workers: CopyWorkers | None = None) -> None:
    """``run(items)``, or with ``threads > 1`` and at least ``PARALLEL_MIN_BYTES`` to move,
    ``run`` on ``threads`` round-robin parts at once (the calling thread takes one), on
    ``workers`` when given, else on threads started for this call.

    Dealt round-robin so that equal-sized items balance evenly. ``run`` must release
    the GIL for the split to pay (``np.copyto`` does on copies of over 500 elements). The
    first error of any part is re-raised here, after every part has finished.
    """
    threads = thread_count(nbytes, threads, workers)
    if threads <= 1 or len(items) < 2:
        run(items)
        return
    threads = min(threads, len(items))
    parts = [items[i::threads] for i in range(threads)]
    if workers is not None:
        workers.run(parts, run)
        return
    errors: list[BaseException] = []

    def work(part: Sequence[T]) -> None:
        try:
            run(part)
        except BaseException as e:  # re-raised on the calling thread
            errors.append(e)

    started = [threading.Thread(target=work, args=(part,)) for part in parts[1:]]
    for w in started:
        w.start()
    work(parts[0])
    for w in started:
        w.join()
    if errors:
        raise errors[0]


def copy_torch(pairs: Sequence[Pair]) -> None:
    """Copy torch view pairs in order (device-agnostic path)."""
    for dst, src in pairs:
        dst.copy_(src)
