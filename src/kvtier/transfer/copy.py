"""Copy engines: execute a list of ``(dst, src)`` strided-view pairs.

On the CPU the pairs are numpy views of the pools' memory: ``np.copyto`` costs
about 1 µs a call (a torch ``copy_`` about 4 µs) and releases the GIL, so a few
Python threads split the pairs and copy in parallel. Elsewhere (CUDA) the
pairs are torch views copied with ``Tensor.copy_``.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np
import torch

# numpy has no bfloat16/fp8: views reinterpret elements as integers of the same width.
_NP_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Below this many bytes a call is copied on the calling thread: starting a thread
# (~50 µs) would cost more than it saves.
PARALLEL_MIN_BYTES = 4 << 20

Pair = tuple[Any, Any]


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory with elements reinterpreted as same-width ints: numpy-friendly
    and compared bit for bit (NaN payloads included)."""
    return t.detach().view(_NP_BY_SIZE[t.element_size()])


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor, elements reinterpreted as same-width ints."""
    return int_view(t).numpy()


def _copy_serial(pairs: Sequence[Pair]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


def copy_numpy(pairs: Sequence[Pair], nbytes: int, threads: int) -> None:
    """Copy numpy view pairs; with ``threads > 1`` and enough bytes, split across threads.

    Pairs are dealt round-robin so that equal-sized pairs balance evenly.
    """
    if threads <= 1 or nbytes < PARALLEL_MIN_BYTES or len(pairs) < 2:
        _copy_serial(pairs)
        return
    threads = min(threads, len(pairs))
    errors: list[BaseException] = []

    def work(part: Sequence[Pair]) -> None:
        try:
            _copy_serial(part)
        except BaseException as e:  # re-raised on the calling thread
            errors.append(e)

    workers = [threading.Thread(target=work, args=(pairs[i::threads],)) for i in range(1, threads)]
    for w in workers:
        w.start()
    work(pairs[0::threads])
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def copy_torch(pairs: Sequence[Pair]) -> None:
    """Copy torch view pairs in order (device-agnostic path)."""
    for dst, src in pairs:
        dst.copy_(src)
