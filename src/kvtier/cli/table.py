"""Printing results: tables (with ``rich`` when installed, plain aligned text otherwise)
and strict JSON."""

from __future__ import annotations

import json
import math
import sys
from typing import Sequence


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        _print_plain(title, columns, rows)
        return
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(str(v) for v in row))
    # NOTE: rich wraps at 80 columns when stdout is not a terminal (CI logs, pipes).
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def _print_plain(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [list(map(str, columns))] + [[str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    print(title)
    for j, r in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.4g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def json_text(value: object) -> str:
    """Strict JSON (RFC 8259): non-finite floats, such as an unlimited capacity, become ``null``."""
    return json.dumps(_finite(value), indent=2, allow_nan=False)


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
