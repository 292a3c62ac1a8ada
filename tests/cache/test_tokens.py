"""Token ids from lists and tuples: the compiled reader (``kvtier.cache._tokens``) and
the pure path give the same arrays and the same errors. When the reader is not built
its own tests are skipped, or fail under KVTIER_REQUIRE_SERVICES=1 (CI)."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest

from kvtier.cache import tokens
from services import unavailable

INT64 = (-(1 << 63), (1 << 63) - 1)


@pytest.fixture
def compiled():
    if tokens._fill_int64 is None:
        unavailable("kvtier.cache._tokens is not built (no C compiler at install time?) or KVTIER_NATIVE=0")
    return tokens._fill_int64


@pytest.fixture(params=["compiled", "pure"])
def path(request, monkeypatch):
    if request.param == "compiled":
        request.getfixturevalue("compiled")
    else:
        monkeypatch.setattr(tokens, "_fill_int64", None)
    return request.param


def _cases():
    rng = random.Random(3)
    ids = [rng.randrange(-(1 << 40), 1 << 40) for _ in range(1000)]
    return [[], [0], ids, tuple(ids), [*INT64, -1, 1, 255, 256], [True, False, 7], [np.int64(5), 6],
            [np.int32(-3)] * 4]


@pytest.mark.parametrize("ids", _cases(), ids=range(len(_cases())))
def test_both_paths_give_the_ids_as_int64(path, ids):
    out = tokens.token_array(ids)
    assert isinstance(out, array) and out.typecode == "q"
    assert out.tolist() == [int(i) for i in ids]


@pytest.mark.parametrize("ids, message", [
    ([1, 1 << 63], "outside the int64 range"),
    ([-(1 << 63) - 1], "outside the int64 range"),
    ([1, 2.0], "element of type float"),
    ([1, "2"], "element of type str"),
    ((None, 1), "element of type NoneType"),
])
def test_both_paths_refuse_the_same_ids(path, ids, message):
    with pytest.raises(ValueError, match=message):
        tokens.token_array(ids)


def test_the_compiled_reader_is_built(compiled):
    """CI builds it: a missing one fails there instead of silently testing the pure path only."""
    out = array("q", [0]) * 3
    assert compiled(out, [1, -2, 3]) is True and out.tolist() == [1, -2, 3]


def test_the_compiled_reader_answers_false_for_what_it_does_not_read(compiled):
    for ids in ([1, True], [1, 1 << 64], [np.int64(1)], [1.0]):
        assert compiled(array("q", [0]) * len(ids), ids) is False


def test_the_compiled_reader_checks_its_arguments(compiled):
    with pytest.raises(ValueError, match="3 ids need 24 bytes, the buffer holds 16"):
        compiled(array("q", [0, 0]), [1, 2, 3])
    with pytest.raises(TypeError, match="list or a tuple"):
        compiled(array("q", [0]), iter([1]))
    with pytest.raises((TypeError, BufferError)):
        compiled(b"\0" * 8, [1])  # read-only
    with pytest.raises((TypeError, ValueError, BufferError)):
        compiled(np.zeros(4, dtype=np.int64)[::2], [1, 2])  # not contiguous
