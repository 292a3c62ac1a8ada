"""The argument checks kvtier's calls share, each with one wording.

``bool`` is a subclass of ``int``, so ``isinstance(True, int)`` holds; every check here
refuses bools (``layer_num=True`` is a mistake, not one layer). A check returns the
value it accepts, or raises :class:`~kvtier.errors.UsageError` (or ``error``, a
subclass) naming ``name`` and the value: ``"{name} must be a positive int, got 0"``.
"""

from __future__ import annotations

import math

from .errors import UsageError


def is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """Whether ``value`` is an ``int`` or a ``float`` and not a ``bool`` (nan and inf are numbers)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_at_least(name: str, value: object, low: int, *, error: type[UsageError] = UsageError) -> int:
    """``value`` if it is an int ``>= low``: ``"{name} must be an int >= {low}, got {value!r}"``."""
    return _int_from(name, value, low, f"an int >= {low}", error)


def positive_int(name: str, value: object, *, error: type[UsageError] = UsageError) -> int:
    """``value`` if it is an int ``> 0``: ``"{name} must be a positive int, got {value!r}"``."""
    return _int_from(name, value, 1, "a positive int", error)


def non_negative_int(name: str, value: object, *, error: type[UsageError] = UsageError) -> int:
    """``value`` if it is an int ``>= 0``: ``"{name} must be a non-negative int, got {value!r}"``."""
    return _int_from(name, value, 0, "a non-negative int", error)


def positive_ints(*named: tuple[str, object]) -> None:
    """:func:`positive_int` of each ``(name, value)``, in order."""
    for name, value in named:
        _int_from(name, value, 1, "a positive int", UsageError)


def index_in_range(name: str, value: object, n: int) -> int:
    """``value`` if it is an int in ``[0, n)``: ``"{name} {value!r} is out of range [0, {n})"``."""
    if not is_int(value) or not 0 <= value < n:
        raise UsageError(f"{name} {value!r} is out of range [0, {n})")
    return value


def layer_range(name: str, value: object, n: int) -> range:
    """``value`` if it is a non-empty ``range`` of step 1 inside ``[0, n)``, else a
    ``UsageError`` saying so with the numbers."""
    if not isinstance(value, range) or value.step != 1 or not 0 <= value.start < value.stop <= n:
        raise UsageError(f"{name} must be a non-empty range(start, stop) of step 1 inside [0, {n}), got {value!r}")
    return value


def positive_number(name: str, value: object) -> float:
    """``value`` if it is a finite int or float ``> 0``: ``"{name} must be a finite number > 0,
    got {value!r}"`` (the command line's wording for the same values)."""
    if not is_number(value) or not 0 < value < math.inf:
        raise UsageError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _int_from(name: str, value: object, low: int, what: str, error: type[UsageError]) -> int:
    if not is_int(value) or value < low:
        raise error(f"{name} must be {what}, got {value!r}")
    return value
