"""Shared pieces of the copy engines: integer views, the thread split, the torch path.

On the CPU the engine (``kvtier.transfer.cpu``) copies numpy views of the pools'
memory: ``np.copyto`` costs about 1 µs a call (a torch ``copy_`` about 4 µs) and
releases the GIL, so a few Python threads split the work (:func:`split_threads`).
Elsewhere (CUDA) the pairs are torch views copied with ``Tensor.copy_``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch

# numpy has no bfloat16/fp8: views reinterpret elements as integers of the same width.
_NP_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Below this many bytes a call is copied on the calling thread: starting a thread
# (~50 µs) would cost more than it saves.
PARALLEL_MIN_BYTES = 4 << 20

Pair = tuple[Any, Any]
T = TypeVar("T")


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory with elements reinterpreted as same-width ints: numpy-friendly
    and compared bit for bit (NaN payloads included)."""
    return t.detach().view(_NP_BY_SIZE[t.element_size()])


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor, elements reinterpreted as same-width ints."""
    return int_view(t).numpy()


def split_threads(items: Sequence[T], nbytes: int, threads: int, run: Callable[[Sequence[T]], None]) -> None:
    """``run(items)``, or with ``threads > 1`` and at least ``PARALLEL_MIN_BYTES`` to move,
    ``run`` on ``threads`` round-robin parts at once (the calling thread takes one).

    Dealt round-robin so that equal-sized items balance evenly. ``run`` must release
    the GIL for the split to pay (``np.copyto`` does on large copies). The first error
    of any part is re-raised here, after every part has finished.
    """
    if threads <= 1 or nbytes < PARALLEL_MIN_BYTES or len(items) < 2:
        run(items)
        return
    threads = min(threads, len(items))
    errors: list[BaseException] = []

    def work(part: Sequence[T]) -> None:
        try:
            run(part)
        except BaseException as e:  # re-raised on the calling thread
            errors.append(e)

    workers = [threading.Thread(target=work, args=(items[i::threads],)) for i in range(1, threads)]
    for w in workers:
        w.start()
    work(items[0::threads])
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def copy_torch(pairs: Sequence[Pair]) -> None:
    """Copy torch view pairs in order (device-agnostic path)."""
    for dst, src in pairs:
        dst.copy_(src)
