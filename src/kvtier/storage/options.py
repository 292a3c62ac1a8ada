"""Backend options, given as keywords or in the URL query (``redis://h:p/0?ttl=60``).

Each backend declares a table ``OPTIONS: {name: Opt}`` of the options a URL may
carry, and ``KEYWORDS`` for those that only keywords can (a spec, a dict). ``open``
parses the query with the table; every constructor checks its values with the same
table, so a keyword and a query value are held to one rule. Unknown names, values
of the wrong type or range, and one option given twice fail with a ``ValueError``
that lists what is supported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import parse_qsl

from .._checks import is_int
from ..errors import UsageError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Opt:
    """One option: its type (``int``, ``float``, ``bool`` or ``str``), the least value a
    number may take, whether ``None`` is allowed, and the allowed strings (if fixed)."""

    kind: type
    minimum: float | None = None
    none_ok: bool = False
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        what = {int: "int", float: "number", bool: "bool", str: "str"}[self.kind]
        if self.choices:
            what = "|".join(self.choices)
        elif self.minimum is not None:
            what += f" >= {self.minimum:g}"
        return what

    def parse(self, name: str, text: str):
        """The typed value of the URL text ``text``."""
        if self.kind is bool and text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        try:
            if self.kind is not bool:
                return self.kind(text)
        except ValueError:
            pass
        raise UsageError(f"option {name}={text!r} is not a {self.describe()}")

    def check(self, name: str, value):
        """``value`` if it is valid for this option; ``ValueError`` naming it otherwise."""
        if value is None and self.none_ok:
            return value
        ok = is_int(value) if self.kind is int else isinstance(value, self.kind)
        if self.kind is float and is_int(value):
            value, ok = float(value), True
        if ok and self.kind is float:
            ok = math.isfinite(value)
        if ok and self.minimum is not None:
            ok = value >= self.minimum
        if ok and self.choices:
            ok = value in self.choices
        if not ok:
            none = " or None" if self.none_ok else ""
            raise UsageError(f"option {name} must be a {self.describe()}{none}, got {value!r}")
        return value


def check_options(table: dict[str, Opt], **values) -> None:
    """Check keyword values against ``table`` (raises ``ValueError``)."""
    for name, value in values.items():
        table[name].check(name, value)


def merge_options(what: str, table: dict[str, Opt], keywords: set[str], query: str, given: dict) -> dict:
    """The options of one ``open`` call: the URL ``query`` parsed by ``table``, plus the
    keyword options ``given``. Raises ``ValueError`` for an unknown name (listing the
    supported ones), a bad value, or one option given twice."""
    supported = f"supported URL options: {', '.join(sorted(table)) or 'none'}"
    unknown = sorted(set(given) - set(table) - keywords)
    if unknown:
        raise UsageError(f"{what}: unknown options {unknown}; {supported}; keyword-only: "
                         f"{', '.join(sorted(keywords)) or 'none'}")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise UsageError(f"{what}: malformed URL query {query!r}; {supported}") from None
    out = dict(given)
    seen = set()
    for name, text in pairs:
        if name not in table:
            raise UsageError(f"{what}: unknown URL option {name!r}; {supported}")
        if name in seen or name in given:
            raise UsageError(f"{what}: option {name!r} given more than once (URL query and keywords)")
        seen.add(name)
        out[name] = table[name].check(name, table[name].parse(name, text))
    return out
