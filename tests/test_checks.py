"""kvtier._checks: each check accepts what it names and refuses bools, floats, strings
and out-of-range values with its one wording (``UsageError``, or the ``error`` given)."""

import math
import re

import pytest

from kvtier import DeviceKVPool, KVSpec, _checks
from kvtier.errors import TraceError, UsageError

NOT_INTS = [True, False, 1.0, 2.5, "3", None, [1]]


def refused(call, message):
    with pytest.raises(UsageError, match=f"^{re.escape(message)}$"):
        call()


def test_is_int_and_is_number():
    assert [_checks.is_int(v) for v in (0, -3, 1 << 70)] == [True, True, True]
    assert not any(_checks.is_int(v) for v in NOT_INTS)
    assert all(_checks.is_number(v) for v in (0, -3, 2.5, math.inf, math.nan))
    assert not any(_checks.is_number(v) for v in (True, False, "1", None, 1j))


def test_positive_int():
    assert _checks.positive_int("n", 1) == 1 and _checks.positive_int("n", 1 << 70) == 1 << 70
    for value in (0, -1, *NOT_INTS):
        refused(lambda: _checks.positive_int("KVSpec.layer_num", value),
                f"KVSpec.layer_num must be a positive int, got {value!r}")


def test_positive_ints_names_the_first_bad_one():
    _checks.positive_ints(("a", 1), ("b", 2))
    _checks.positive_ints()
    refused(lambda: _checks.positive_ints(("a", 1), ("b", True), ("c", 0)), "b must be a positive int, got True")


def test_non_negative_int():
    assert _checks.non_negative_int("n", 0) == 0 and _checks.non_negative_int("n", 7) == 7
    for value in (-1, *NOT_INTS):
        refused(lambda: _checks.non_negative_int("alloc_device", value),
                f"alloc_device must be a non-negative int, got {value!r}")


def test_int_at_least():
    assert _checks.int_at_least("load", 0, 0) == 0 and _checks.int_at_least("pages", 5, 5) == 5
    for value in (4, -1, *NOT_INTS):
        refused(lambda: _checks.int_at_least("pages", value, 5), f"pages must be an int >= 5, got {value!r}")


def test_index_in_range():
    assert _checks.index_in_range("layer", 0, 3) == 0 and _checks.index_in_range("layer", 2, 3) == 2
    for value in (3, -1, *NOT_INTS):
        refused(lambda: _checks.index_in_range("layer", value, 3), f"layer {value!r} is out of range [0, 3)")
    refused(lambda: _checks.index_in_range("layer", 0, 0), "layer 0 is out of range [0, 0)")


def test_positive_number():
    assert _checks.positive_number("t", 2) == 2 and _checks.positive_number("t", 0.25) == 0.25
    for value in (0, -1.5, math.inf, math.nan, True, "1", None):
        refused(lambda: _checks.positive_number("prefetch_timeout", value),
                f"prefetch_timeout must be a finite number > 0, got {value!r}")


def test_the_error_class_can_be_a_subclass():
    """A trace file's values are refused as TraceError (a UsageError), same wording."""
    with pytest.raises(TraceError, match="^line 3: input_length must be a non-negative int, got -1$"):
        _checks.non_negative_int("line 3: input_length", -1, error=TraceError)
    with pytest.raises(TraceError, match="must be a positive int, got False"):
        _checks.positive_int("x", False, error=TraceError)
    with pytest.raises(TraceError, match="must be an int >= 2, got 1"):
        _checks.int_at_least("x", 1, 2, error=TraceError)


SPEC = KVSpec.mha(2, 8, 64)


@pytest.mark.parametrize("call, message", [
    (lambda: KVSpec.mha(True, 8, 64), "KVSpec.layer_num must be a positive int, got True"),
    (lambda: SPEC.shard(True, 2), "KVSpec.shard rank True is out of range [0, 2)"),
    (lambda: DeviceKVPool(SPEC, 16.0, 4), "size must be a positive int, got 16.0"),
    (lambda: DeviceKVPool(SPEC, 16, 4).buffer("k", True), "layer True is out of range [0, 2)"),
    (lambda: DeviceKVPool(SPEC, 16, 4).alloc(-4), "alloc must be a non-negative int, got -4"),
])
def test_the_public_calls_refuse_bools_and_floats_in_these_words(call, message):
    refused(call, message)
