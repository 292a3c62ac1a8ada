"""Arguments that run Python while a compiled parser reads them."""

from __future__ import annotations


class Emptying:
    """A number whose reading (``__index__``) empties ``listed``, the list it is put in:
    a parser that reads on from that list reads freed items."""

    def __init__(self, listed: list, value: int) -> None:
        self.listed, self.value = listed, value

    def __index__(self) -> int:
        self.listed.clear()
        return self.value
