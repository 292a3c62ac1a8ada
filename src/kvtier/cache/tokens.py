"""The two inputs every cache call keys on, in one canonical form each.

Token ids become an ``array('q')`` (int64, one copy, compared with ``memcmp``);
a tenant salt becomes ``bytes``, the same form for the tree and the storage keys,
so ``None``/``""``/``b""`` are one tenant and ``"t"``/``b"t"`` another.
"""

from __future__ import annotations

import functools
import struct
from array import array

import numpy as np
import torch

from ..compiled import load
from ..errors import UsageError
from ..storage.keys import canonical_salt  # noqa: F401 (the cache's inputs, in one module)

_INT64 = np.iinfo(np.int64)
_ZERO = array("q", [0])
_ALL_INTS = object()

#: the compiled list reader and run comparison, through ``kvtier.compiled.load`` at each call
COMPILED = "kvtier.cache._tokens"


def token_array(token_ids) -> array:
    """``token_ids`` as a new ``array('q')`` that the caller owns (the one copy of the ids).

    Accepted: a 1-D sequence of Python ints (list, tuple, ``array``, any iterable),
    a 1-D integer tensor or numpy array, or a ``(1, n)`` one (the shape of Hugging
    Face ``input_ids``). Anything else (floats, bools, other shapes, ids outside
    int64) raises ``ValueError`` naming the shape or dtype.
    """
    # NOTE: the exact common types first: ``isinstance`` against ``torch.Tensor`` costs
    # 0.2 us (its metaclass's check), against ``np.ndarray`` 0.1, where a hit takes 10-18
    kind = type(token_ids)
    if kind is array and token_ids.typecode == "q":
        return token_ids[:]
    if kind is not list and kind is not tuple:
        token_ids = _ints_of(token_ids)
        if isinstance(token_ids, array):
            return token_ids
    compiled = load(COMPILED)
    if compiled is not None:
        out = _ZERO * len(token_ids)
        if compiled.fill_int64(out, token_ids):
            return out
    out = array("q")
    try:
        # NOTE: one struct.pack over the whole list checks and converts every id in C,
        # about 3x faster than array('q', list) (which grows the array item by item).
        out.frombytes(_packer(len(token_ids)).pack(*token_ids))
    except struct.error:
        bad = next((t for t in token_ids if not isinstance(t, int)), _ALL_INTS)
        if bad is _ALL_INTS:
            raise UsageError("token_ids hold an id outside the int64 range") from None
        raise UsageError(f"token_ids must be a 1-D sequence of ints, got an element of type "
                         f"{type(bad).__name__}") from None
    return out


def _ints_of(token_ids) -> array | list | tuple:
    """``token_ids`` of a type other than exactly list, tuple or ``array('q')``: the ids
    as a new ``array('q')`` (a tensor, a numpy array, a subclass of ``array('q')``), or a
    list or tuple of them still to be read (anything else, e.g. an ``array('i')``)."""
    # NOTE: the error's words are made only for an error: formatting a numpy dtype costs
    # 5 us, a third of a full hit (a numpy prompt's hit took 32 us against array's 17)
    if isinstance(token_ids, torch.Tensor):
        try:  # a CPU tensor without grad: its numpy view at once (detach and cpu cost 1.3 us)
            ids = token_ids.numpy()
        except (RuntimeError, TypeError):
            ids = token_ids.detach().cpu().numpy()
        return _from_numpy(ids, "tensor", token_ids.dtype)
    if isinstance(token_ids, np.ndarray):
        return _from_numpy(token_ids, "numpy array", token_ids.dtype)
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        return token_ids[:]
    if isinstance(token_ids, (str, bytes, bytearray, dict, set)) or token_ids is None:
        raise UsageError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    if isinstance(token_ids, (list, tuple)):
        return token_ids
    try:
        return list(token_ids)
    except TypeError:
        raise UsageError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}") from None


@functools.lru_cache(maxsize=256)
def _packer(n: int) -> struct.Struct:
    return struct.Struct(f"={n}q")


def _from_numpy(arr: np.ndarray, kind: str, dtype) -> array:
    """``arr`` (the ids of a ``kind`` of ``dtype``: the words of an error) as a new
    ``array('q')``."""
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise UsageError(f"token_ids must be 1-D or (1, n), got a {kind} of dtype {dtype} of shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise UsageError(f"token_ids must hold integers, got a {kind} of dtype {dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() > _INT64.max:
        raise UsageError("token_ids hold an id outside the int64 range")
    out = array("q")
    # NOTE: through a byte view of the buffer, not tobytes(): one copy
    out.frombytes(memoryview(np.ascontiguousarray(arr, dtype="=i8")).cast("B"))
    return out
