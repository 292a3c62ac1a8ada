"""Argument types for the command line: a bad value is refused by argparse, in one line."""

from __future__ import annotations

import argparse
import math
import re
from typing import Callable

from ..errors import UsageError


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def seed(text: str) -> int:
    """A random seed: an integer in ``[0, 2**63)``, what torch's and numpy's generators take."""
    value = _int(text)
    if not 0 <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63), got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (rates, bandwidths)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """``"16,64"`` -> ``(16, 64)``, each a positive integer."""
    try:
        return tuple(positive_int(part) for part in text.split(","))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: each comma-separated item {e}") from None


def name_list(choices) -> Callable[[str], tuple[str, ...]]:
    """A type for ``"a,b"`` lists whose items must be among ``choices``, each at most once."""
    choices = tuple(choices)

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(","))
        for name in names:
            if name not in choices:
                raise argparse.ArgumentTypeError(f"unknown name {name!r} in {text!r}; choose from {', '.join(choices)}")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{text!r} names an item twice")
        return names

    parse.__name__ = "name list"
    return parse


def capacity(text: str, *, unlimited: bool = False) -> float:
    """Tokens as ``N`` or ``1e6``, >= 0; ``inf`` only where ``unlimited``. Raises ``UsageError``."""
    word = text.strip().lower()
    if word in ("inf", "infinite", "unlimited"):
        if unlimited:
            return math.inf
        raise UsageError(f"must be a finite number of tokens, got {text!r} (only --storage-tokens may be inf)")
    try:
        value = float(word)
    except ValueError:
        raise UsageError(f"must be a number of tokens such as 4096 or 1e6, got {text!r}") from None
    if math.isnan(value):
        raise UsageError(f"must be a number of tokens, got {text!r}")
    if math.isinf(value) and not unlimited:
        raise UsageError(f"must be a finite number of tokens, got {text!r} (only --storage-tokens may be inf)")
    if value < 0:
        raise UsageError(f"must be >= 0 tokens, got {text!r}")
    return value


def capacity_type(*, unlimited: bool = False) -> Callable[[str], float]:
    """:func:`capacity` as an argparse type."""
    def parse(text: str) -> float:
        try:
            return capacity(text, unlimited=unlimited)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "capacity"
    return parse


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


#: Byte units: binary (KiB = 1024) and decimal (KB = 1000); a bare number is bytes.
BYTE_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
              "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNIT_BY_LOWER = {u.lower(): n for u, n in BYTE_UNITS.items()}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str, flag: str, *, unlimited: bool = False) -> int | float:
    """Bytes as ``N``, ``64GiB``, ``1.5 TiB`` or ``500GB`` (a unit of :data:`BYTE_UNITS`,
    in any case), rounded down to whole bytes; ``inf`` (a float) only where ``unlimited``.
    ``UsageError`` starting ``FLAG 'TEXT':``."""
    if text.strip().lower() in ("inf", "infinite", "unlimited"):
        if unlimited:
            return math.inf
        raise UsageError(f"{flag} {text!r}: must be a finite size (only the storage tier may be inf)")
    match = _BYTES.match(text)
    if match is None:
        raise UsageError(f"{flag} {text!r}: expected a size such as 4096, 64GiB or 500GB")
    number, unit = match.groups()
    if len(number) > 40:  # beyond any memory, and past int()'s 4,300 digits: refused before either
        raise UsageError(f"{flag} {text[:24]!r}...: a size of {len(number)} digits; expected one such as 64GiB")
    scale = _UNIT_BY_LOWER.get(unit.lower())
    if scale is None:
        raise UsageError(f"{flag} {text!r}: unknown unit; use KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
    # NOTE: exact decimal arithmetic, so "1.1GB" is 1,100,000,000 bytes, not a float's one less
    whole, _, frac = number.partition(".")
    return (int(whole or 0) * 10 ** len(frac) + int(frac or 0)) * scale // 10 ** len(frac)
