"""Token ids from lists and tuples: the compiled reader (``kvtier.cache._tokens``) and
the pure path give the same arrays and the same errors. When the reader is not built
its own tests are skipped, or fail under KVTIER_REQUIRE_SERVICES=1 (CI)."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest

from kvtier.cache import tokens
from kvtier.compiled import load
from tests.support.services import unavailable

INT64 = (-(1 << 63), (1 << 63) - 1)


@pytest.fixture
def compiled():
    """The compiled module ``kvtier.cache._tokens``."""
    module = load(tokens.COMPILED)
    if module is None:
        unavailable("kvtier.cache._tokens is not built (no C compiler at install time?) or KVTIER_NATIVE=0")
    return module


@pytest.fixture(params=["compiled", "pure"])
def path(request, monkeypatch):
    if request.param == "compiled":
        request.getfixturevalue("compiled")
    else:
        monkeypatch.setenv("KVTIER_NATIVE", "0")
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
    assert compiled.fill_int64(out, [1, -2, 3]) is True and out.tolist() == [1, -2, 3]


def test_the_compiled_reader_answers_false_for_what_it_does_not_read(compiled):
    for ids in ([1, True], [1, 1 << 64], [np.int64(1)], [1.0]):
        assert compiled.fill_int64(array("q", [0]) * len(ids), ids) is False


def test_the_compiled_reader_checks_its_arguments(compiled):
    with pytest.raises(ValueError, match="3 ids need 24 bytes, the buffer holds 16"):
        compiled.fill_int64(array("q", [0, 0]), [1, 2, 3])
    with pytest.raises(TypeError, match="list or a tuple"):
        compiled.fill_int64(array("q", [0]), iter([1]))
    with pytest.raises((TypeError, BufferError)):
        compiled.fill_int64(b"\0" * 8, [1])  # read-only
    with pytest.raises((TypeError, ValueError, BufferError)):
        compiled.fill_int64(np.zeros(4, dtype=np.int64)[::2], [1, 2])  # not contiguous


def test_the_compiled_run_comparison_equals_the_slice_comparison(compiled):
    """``same_at(tokens, pos, key)`` is ``tokens[pos:pos + len(key)] == key`` for every
    position, length and one-id change, out-of-range runs included (False, never a read
    past the end)."""
    rng = random.Random(5)
    tokens = array("q", [rng.randrange(-(1 << 62), 1 << 62) for _ in range(40)])
    for pos in range(0, 44):
        for n in (0, 1, 7, 40 - pos, 41 - pos):
            if n < 0:
                continue
            key = tokens[pos:pos + n] + (array("q", [1]) if pos + n > 40 else array("q"))
            assert compiled.same_at(tokens, pos, key) is (pos + len(key) <= 40 and tokens[pos:pos + len(key)] == key)
            if len(key) and pos + len(key) <= 40:
                changed = array("q", key)
                changed[rng.randrange(len(key))] ^= 1 << 40
                assert compiled.same_at(tokens, pos, changed) is False
    with pytest.raises(TypeError, match="int64 buffers"):
        compiled.same_at(tokens, 0, b"\0" * 8)


def test_the_radix_walk_matches_the_same_with_either_comparison(monkeypatch, compiled):
    """A tree walked with the compiled comparison and with array slices finds the same
    prefixes (prompts sharing prefixes of every length, in and out of page bounds)."""
    import torch

    from kvtier import DeviceKVPool, HierarchicalCache, HostKVPool, KVSpec

    rng = random.Random(6)
    spec = KVSpec.k_only(1, 1, 1, dtype=torch.float16)
    cache = HierarchicalCache(DeviceKVPool(spec, 4096, 4), HostKVPool(spec, 64, 4), write_policy="write_back")
    base = [rng.randrange(50) for _ in range(80)]
    prompts = [base[:rng.randrange(0, 80)] + [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
               for _ in range(60)]
    for p in prompts[:40]:
        p = p[:len(p) - len(p) % 4]
        slots = cache.alloc_device(len(p))
        cache.free_device(slots[:cache.insert(p, slots)])
    found = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVTIER_NATIVE", flag)
        found[flag] = [cache.peek(p).device_len for p in prompts]
    assert found["1"] == found["0"]
    assert len(set(found["0"])) > 5
    cache.close()
