"""Validation of token-slot index tensors that must come in whole, aligned pages.

Everything here runs in numpy or plain Python, never in a torch op: torch spreads
element-wise ops over its intra-op thread pool, and on a loaded machine waiting for
those threads costs far more than the work (milliseconds for a 4096-page check).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack

from ..compiled import load
from ..errors import UsageError

_INDEX_DTYPES = (torch.int64, torch.int32)
_CPU = torch.device("cpu")
_NP_INT64 = np.dtype(np.int64)

#: the compiled loops, through ``kvtier.compiled.load`` at each call
COMPILED = "kvtier.pools._indices"

#: a tensor of the DLPack capsule of new slots that the compiled parts return (taken
#: once, without a copy). NOTE: what torch.utils.dlpack.from_dlpack calls for a capsule,
#: after checks a capsule skips (0.27 us of a full hit); the public function where a
#: torch lacks it
from_capsule = getattr(torch._C, "_from_dlpack", from_dlpack)

#: inputs up to this many slots are checked in plain Python: below it, numpy's fixed
#: cost per call (a few microseconds for the seven array ops) is the larger one. The
#: compiled check takes every size (``_SMALL_SLOTS_COMPILED``): 1.7 µs from one slot to
#: two pages of 16, against the loop's 2.2-4.1 (and at 128 slots, two pages of 64, 3.1
#: against 7.4).
_SMALL_SLOTS = 128
_SMALL_SLOTS_COMPILED = 0


def page_starts(indices: torch.Tensor, *, page_size: int, size: int, what: str,
                allowed_devices: tuple[torch.device, ...] = (torch.device("cpu"),),
                unique: bool = False) -> torch.Tensor:
    """Check that ``indices`` are whole pages of token slots and return the page numbers.

    ``indices``: ``(n,)`` int64/int32 token slots, ``n % page_size == 0``; each page's slots
    are consecutive and start at a multiple of ``page_size``; all lie in ``[0, size)``.
    With ``unique``, no page may appear twice. Returns ``(n // page_size,)`` int64 page
    numbers on the CPU. Raises ``ValueError`` naming ``what`` and the offending numbers;
    never modifies anything.
    """
    return torch.from_numpy(page_numbers(indices, page_size=page_size, size=size, what=what,
                                         allowed_devices=allowed_devices, unique=unique))


def page_numbers(indices: torch.Tensor, *, page_size: int, size: int, what: str,
                 allowed_devices: tuple[torch.device, ...] = (torch.device("cpu"),),
                 unique: bool = False) -> np.ndarray:
    """:func:`page_starts` as a new int64 numpy array (no tensor around it)."""
    on_cpu = _CPU in allowed_devices
    if on_cpu:
        pages = _checked_in_place(indices, page_size, size, unique)
        if pages is not None:
            return pages
    flat = _cpu_int64(indices) if on_cpu else None
    if flat is None:  # NOTE: a 1-D int64 tensor on an allowed CPU passes every check here
        if not isinstance(indices, torch.Tensor):
            raise UsageError(f"{what} must be a torch.Tensor of int64 token slots, got {type(indices).__name__}")
        if indices.dtype not in _INDEX_DTYPES:
            raise UsageError(f"{what} must have dtype int64 or int32, got {indices.dtype}")
        if indices.dim() != 1:
            raise UsageError(f"{what} must be 1-D, got shape {tuple(indices.shape)}")
        if indices.device not in allowed_devices:
            raise UsageError(f"{what} is on {indices.device}; expected one of {[str(d) for d in allowed_devices]}")
    n = indices.numel() if flat is None else flat.size
    if n % page_size:
        raise UsageError(f"{what} holds {n} slots, not a multiple of page_size {page_size}")
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if n <= (_SMALL_SLOTS_COMPILED if load(COMPILED) is not None else _SMALL_SLOTS):
        ids = _small_page_ids((indices if flat is None else flat).tolist(), page_size, size, unique)
        if ids is not None:
            return np.array(ids, dtype=np.int64)
        # NOTE: invalid: fall through, so that one place words every error message
    return _page_ids(_host_int64(indices) if flat is None else flat, page_size=page_size, size=size, what=what,
                     unique=unique)


def _checked_in_place(indices, page_size: int, size: int, unique: bool) -> np.ndarray | None:
    """The page numbers of ``indices`` where it is a plain 1-D contiguous CPU int64
    tensor (the usual slots) and passes every check, read where they lie; else ``None``,
    for the numpy view's path to check again and word the error.

    NOTE: the compiled check reads the tensor's memory at its address: a numpy view, the
    one buffer torch gives, took 3.5 µs of an 8K-token insert (Zen 2, out of the caches),
    these attributes 1.7. Only an exact ``torch.Tensor``: a subclass may answer them its
    own way; and not a negative view (``torch._neg_view``), whose memory holds the
    values before their negation."""
    if type(indices) is not torch.Tensor or indices.dtype is not torch.int64 or not indices.is_cpu:
        return None
    compiled, shape = load(COMPILED), indices.shape
    if compiled is None or len(shape) != 1 or not shape[0] or shape[0] % page_size or not indices.is_contiguous() \
            or indices.is_neg():
        return None
    pages = np.empty(shape[0] // page_size, dtype=np.int64)
    if compiled.check_pages_at(indices.data_ptr(), shape[0], page_size, size, pages, unique) == -1:
        return pages
    return None


def _cpu_int64(indices) -> np.ndarray | None:
    """A 1-D CPU int64 tensor's numpy view, else ``None``: one torch call in place of the
    five checks, the path every valid CPU index tensor takes.

    NOTE: a per-layer load checks two index tensors per layer, right after copying
    memory that evicted the interpreter's own data from the core's caches; there each
    torch call cost 5-9 µs, not 0.5 (one call after reading 4 MiB)."""
    if not isinstance(indices, torch.Tensor):
        return None
    try:
        a = indices.numpy()  # raises for a tensor off the CPU
    except (TypeError, RuntimeError):
        return None
    return a if a.ndim == 1 and a.dtype is _NP_INT64 else None


def _host_int64(indices: torch.Tensor) -> np.ndarray:
    """``indices`` as a CPU int64 numpy array, converted by numpy (no torch op but a
    negative view's negation, which ``numpy()`` refuses)."""
    a = (indices if indices.device.type == "cpu" else indices.cpu()).resolve_neg().numpy()
    return a if a.dtype == np.int64 else a.astype(np.int64)


def _small_page_ids(slots: list[int], page_size: int, size: int, unique: bool) -> list[int] | None:
    """Page numbers of ``slots`` (a multiple of ``page_size`` long), or ``None`` if any
    check of :func:`page_starts` fails: every slot is compared, as in :func:`_page_ids`."""
    starts = slots[::page_size]
    for i, s in enumerate(starts):
        if s % page_size or s < 0 or s + page_size > size:
            return None
        if page_size > 1 and slots[i * page_size:(i + 1) * page_size] != list(range(s, s + page_size)):
            return None
    ids = [s // page_size for s in starts]
    if unique and len(set(ids)) != len(ids):
        return None
    return ids


def _page_ids(flat: np.ndarray, *, page_size: int, size: int, what: str, unique: bool) -> np.ndarray:
    """:func:`page_starts` on a ``(n,)`` int64 array, ``n`` a positive multiple of ``page_size``."""
    compiled = load(COMPILED)
    if compiled is not None and flat.flags.c_contiguous:
        page_ids = np.empty(flat.size // page_size, dtype=np.int64)
        if compiled.check_pages(flat, page_size, size, page_ids, unique) == -1:
            return page_ids
        # NOTE: a bad or repeated page: the numpy checks below find it and word the error
    pages = flat.reshape(-1, page_size)
    starts = pages[:, 0]
    page_ids, offsets = np.divmod(starts, page_size)
    if np.count_nonzero(offsets):  # NOTE: count_nonzero: a fraction of .any()'s fixed cost
        i = int(np.flatnonzero(offsets)[0])
        raise UsageError(f"{what}: page {i} starts at slot {int(starts[i])}, not a multiple of page_size {page_size}")
    # NOTE: aligned starts in [0, size) and consecutive slots keep every slot in range,
    # so the range check only needs the page numbers; as uint64 a negative one is huge,
    # so one max() checks both ends. A page p fits iff (p + 1) * page_size <= size.
    if int(page_ids.view(np.uint64).max()) >= size // page_size:
        raise UsageError(f"{what} has slots in [{int(flat.min())}, {int(flat.max())}], outside the pool's "
                         f"[0, {size})")
    if page_size > 1:
        broken = _steps(flat, page_size) != 1
        if np.count_nonzero(broken):
            i = int(np.flatnonzero(broken)[0]) // page_size
            raise UsageError(f"{what}: page {i} slots {pages[i].tolist()} are not consecutive from {int(starts[i])}")
    _check_unique(page_ids, what, unique)
    return page_ids


def _check_unique(page_ids: np.ndarray, what: str, unique: bool) -> None:
    if unique and page_ids.size > 1:
        ordered = np.sort(page_ids)
        if np.count_nonzero(ordered[1:] == ordered[:-1]):
            raise UsageError(f"{what} names the same page more than once; a destination page can be written once "
                             "per call")


def distinct_pages(pages: np.ndarray, count: int) -> bool | None:
    """Whether the int64 page numbers ``pages`` (at least one) all lie in ``[0, count)``
    and none comes twice, in one compiled pass (:func:`_page_ids`'s check of one-slot
    pages; about 2 us for 96 pages, against numpy's max and sort's 7); ``None`` where the
    compiled module is not taken, for the caller's own checks to answer."""
    compiled = load(COMPILED)
    if compiled is None or not pages.flags.c_contiguous:
        return None
    return compiled.check_pages(pages, 1, count, np.empty_like(pages), True) == -1


def first_flagged(flags: np.ndarray, pages: np.ndarray, start: int, value: bool) -> int:
    """The index ``i >= start`` of the first of the int64 ``pages`` whose ``flags`` entry
    (a bool per page) is ``value``, or -1; each page looked at must lie in ``flags``.

    NOTE: one compiled pass: gathering the flags, counting them and finding the first
    took numpy calls of 0.5-1 µs each, two such checks an insert."""
    compiled = load(COMPILED)
    if compiled is not None and pages.flags.c_contiguous:
        return compiled.first_flag(flags, pages, start, value)
    # the compiled pass's answers and errors: pages are read up to the first hit only
    if not 0 <= start <= len(pages):
        raise UsageError(f"first_flag: start {start} outside the {len(pages)} pages")
    tail = pages[start:]
    outside = np.flatnonzero((tail < 0) | (tail >= len(flags)))
    end = int(outside[0]) if len(outside) else len(tail)
    hits = np.flatnonzero(flags[tail[:end]] == value)
    if len(hits):
        return start + int(hits[0])
    if len(outside):
        raise UsageError(f"first_flag: page {int(tail[end])} (item {start + end}) outside the {len(flags)} flags")
    return -1


def _steps(flat: np.ndarray, page_size: int) -> np.ndarray:
    """``(n,)`` ``flat[k + 1] - flat[k]`` inside each page, ``1`` at each page's last slot.

    NOTE: one contiguous 1-D subtraction, then a strided write of one element per page:
    about half the time of subtracting ``(pages, page_size - 1)`` strided column views.
    """
    steps = np.empty_like(flat)
    np.subtract(flat[1:], flat[:-1], out=steps[:-1])
    steps.reshape(-1, page_size)[:, -1] = 1
    return steps


def page_slots(page_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page numbers ``(p,)`` -> their token slots, ``(p * page_size,)`` int64 on the CPU."""
    return slot_tensor(_host_int64(page_ids), page_size)


def slot_tensor(pages: np.ndarray, page_size: int) -> torch.Tensor:
    """:func:`page_token_slots` of ``pages`` as a new CPU tensor: written by the compiled
    expansion straight into the tensor's memory where it can (numpy's array and
    ``torch.from_numpy`` around it cost 1.0 us more of 8K slots to make and free)."""
    compiled = load(COMPILED)
    if compiled is not None and pages.dtype == np.int64 and pages.flags.c_contiguous:
        return from_capsule(compiled.expand_pages(pages, page_size, pages.size * page_size))
    return torch.from_numpy(page_token_slots(pages, page_size))


def page_token_slots(pages: np.ndarray, page_size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Page numbers ``(p,)`` (int64 numpy) -> their token slots, a new ``(p * page_size,)``
    int64 array, or written into ``out`` (a contiguous int64 array of that size, say a
    stretch of a larger one) and returned."""
    n = pages.size * page_size
    if out is not None and (out.dtype != np.int64 or out.shape != (n,) or not out.flags.c_contiguous):
        raise UsageError(f"page_token_slots: out must be a contiguous ({n},) int64 array, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if page_size == 1 and out is None:
        return pages.astype(np.int64)  # a copy
    compiled = load(COMPILED)
    if compiled is not None and pages.dtype == np.int64 and pages.flags.c_contiguous:
        out = np.empty(n, dtype=np.int64) if out is None else out
        compiled.expand_pages(pages, page_size, out)
        return out
    slots = (np.multiply(pages, page_size)[:, None] + _offsets(page_size)).reshape(-1)
    if out is None:
        return slots
    out[:] = slots
    return out


@functools.lru_cache(maxsize=16)
def _offsets(page_size: int) -> np.ndarray:
    """``0 .. page_size - 1``, shared (read only)."""
    offsets = np.arange(page_size, dtype=np.int64)
    offsets.flags.writeable = False
    return offsets
