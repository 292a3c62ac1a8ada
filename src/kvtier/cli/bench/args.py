"""What the ``kvtier bench`` subcommands share: argument types and help texts."""

from __future__ import annotations

import argparse

JSON_HELP = "print the results as JSON (strict: a non-finite number is null)"
SMALLER = "use fewer or smaller pages, layers or heads"


def dims(text: str) -> tuple[tuple[int, int], ...]:
    """``"128,192/128"`` -> ``((128, 128), (192, 128))``: K[/V] head dims."""
    dims = []
    for item in text.split(","):
        k, _, v = item.partition("/")
        try:
            k_dim, v_dim = int(k), int(v or k)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: expected K or K/V head dims") from None
        if k_dim <= 0 or v_dim <= 0:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: head dims must be positive")
        dims.append((k_dim, v_dim))
    return tuple(dims)


def count(text: str) -> int:
    """A non-negative integer (``--load 0`` is no load)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value
