"""Stored format of ``file://`` objects (version 4): one file per page and writer.

A file holds the page that its writer held (see ``kvtier.storage.objects``), head
groups ``a..b-1`` of ``G`` then, from rank 0, the single-head components (``rep``),
in one of four orders that its header names:

- head order (0): a part per head group (``h{j}of{G}``), each ``(head, slot, layer,
  dim)`` of every multi-head component in turn; a reader of any tensor-parallel size
  reads only its groups' parts (``layer_first`` pools, staged in any order);
- split order (3): a part per multi-head component and head group
  (``h{j}of{G}.<component>``), each ``(head, slot, layer, dim)``, the first
  component's groups first: what a ``page_head`` pool holds contiguously, a
  component's groups one run. A reader of the whole page reads it as one piece per
  component: head order's parts alternate between components, so a cold read's
  request carried a piece per group and component (9 rather than 3 for a MiMo-like
  page), and cold reads of MiMo-like pages into a ``page_head`` pool ran 4-8% faster
  in split order (medians, a harness on an AMD EPYC VM's virtio disk); a reader of
  fewer heads reads its groups' run of each component;
- slot order (1): a part per multi-head component (``s.<component>.g{a}-{b}``), each
  ``(slot, layer, head, dim)`` over the file's heads: what a ``page_first`` pool
  holds contiguously; a reader of fewer heads reads the parts whole;
- layer order (2): the same per component in ``(layer, slot, head, dim)``
  (``l.<component>.g{a}-{b}``): a ``page_first_direct`` pool's page.

The field says which heads: ``<fingerprint>/p<page size>/g{a}-{b}of{G}`` with
``+rep``, or ``.../rep`` alone (every order is one for it).

    offset  size  field
    0       4     magic b"KVT2"
    4       2     format version (4)
    6       2     part count n
    8       4     header length (a multiple of 4096)
    12      4     order of the parts (0 head, 1 slot, 2 layer, 3 split)
    16      8     file length
    24      2     name length m
    26      m     name: "<key>#<field>" in UTF-8 (the object's own identity)
    26+m    8n    xxh3-64 checksum of each part's bytes
    pad           zeros up to the header length

Each part starts at a 4096-byte boundary (zeros between parts; the last one ends
the file), so a part reads with one ``preadv`` straight into a pool that holds it
contiguously, and every part stays aligned for direct I/O. Everything in the header
but the checksums follows from the name, the order and the reader's plan: a reader
builds it for the order it expects and compares bytes; a header of the other order
(:class:`OtherOrder`) sends it to that order's layout.
"""

from __future__ import annotations

import re
import struct

from ..errors import UsageError
from .codec import CorruptObject, UnexpectedObject
from .objects import PagePlan, Part, split_name

MAGIC = b"KVT2"
VERSION = 4
HEAD, SLOT, LAYER, SPLIT = 0, 1, 2, 3  # the orders of a file's parts
ORDERS = ("head", "slot", "layer", "head")  # each order's Part.order (kvtier.storage.objects.PART_AXES)
ALIGN = 4096
_FIXED = struct.Struct("<4sHHIIQH")
_FIELD = re.compile(r"g(\d+)-(\d+)of(\d+)(\+rep)?|rep")


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return -(-n // ALIGN) * ALIGN


class OtherOrder(UnexpectedObject):
    """An intact header of this object, of the other order of parts (``order``): the
    reader reads it in that order; met again there (the file replaced meanwhile), a
    miss that leaves the file as it is."""

    def __init__(self, order: int) -> None:
        super().__init__(f"parts in order {order}")
        self.order = order


class FileLayout:
    """Where each part of one file sits, and the header a file of that name (and
    order of parts) must have."""

    def __init__(self, name: str, sizes: list[int], order: int = HEAD) -> None:
        raw = name.encode()
        self.header_len = align_up(_FIXED.size + len(raw) + 8 * len(sizes))
        self.offsets, end = [], self.header_len
        for i, nbytes in enumerate(sizes):
            self.offsets.append(end)
            end = end + nbytes if i == len(sizes) - 1 else align_up(end + nbytes)
        self.sizes, self.total = sizes, end
        self.order = order
        self._prefix = _FIXED.pack(MAGIC, VERSION, len(sizes), self.header_len, order, end, len(raw)) + raw
        self._sums = struct.Struct(f"<{len(sizes)}Q")

    def renamed(self, name: str) -> "FileLayout":
        """This layout for another object whose name has as many UTF-8 bytes: the same
        offsets and header length, only the name differs (cheaper than building it)."""
        other = object.__new__(FileLayout)
        other.__dict__.update(self.__dict__)
        other._prefix = self.prefix(name)
        return other

    def prefix(self, name: str | None = None) -> bytes:
        """The header's bytes before the checksums: this object's, or (``name``) those of
        another object whose name has as many UTF-8 bytes."""
        if name is None:
            return self._prefix
        raw = name.encode()
        if len(raw) != len(self._prefix) - _FIXED.size:
            raise UsageError(f"a name of {len(raw)} bytes for a layout of {len(self._prefix) - _FIXED.size}")
        return self._prefix[:_FIXED.size] + raw

    def pad_before(self, i: int) -> int:
        """Zero bytes between part ``i - 1`` and part ``i``."""
        return 0 if i == 0 else self.offsets[i] - self.offsets[i - 1] - self.sizes[i - 1]

    def header(self, checksums: list[int]) -> bytes:
        head = self._prefix + self._sums.pack(*checksums)
        return head + bytes(self.header_len - len(head))

    def checksums(self, head) -> tuple[int, ...]:
        """The parts' checksums from ``head`` (the file's first ``header_len`` bytes), if
        it is this file's intact header; :class:`OtherOrder` if it names this object
        with its parts in the other order; else :class:`CorruptObject`."""
        view = memoryview(head)
        n = len(self._prefix)
        pad = bytes(view[n + self._sums.size:])  # NOTE: compared whole: any() over 4 KiB took 18 us
        if len(view) != self.header_len or view[:n] != self._prefix or pad != bytes(len(pad)):
            self._other_order(view)
            magic, version = bytes(view[:4]), bytes(view[4:6])
            raise CorruptObject(f"{self._name()}: bad header (magic {magic!r}, version {version.hex()})")
        return self._sums.unpack_from(view, n)

    def judge(self, head, size: int) -> Exception:
        """The error for a file of ``size`` bytes (not ``total``) whose first bytes are
        ``head``: it is intact but another object if its header names this object and
        says it is ``size`` bytes long, else corrupt."""
        view = memoryview(head)
        self._other_order(view)
        if len(view) >= _FIXED.size:
            magic, version, _, _, _, length, name_len = _FIXED.unpack_from(view)
            named = bytes(view[_FIXED.size:_FIXED.size + name_len]) == self._prefix[_FIXED.size:]
            if magic == MAGIC and version == VERSION and named and length == size:
                return UnexpectedObject(f"{self._name()}: an intact object of {size} bytes, expected {self.total}")
        return CorruptObject(f"{self._name()}: {size} bytes, expected {self.total}")

    def _other_order(self, view) -> None:
        """Raise :class:`OtherOrder` if ``view`` starts with a header of this object whose
        parts are in the other order."""
        if len(view) < _FIXED.size:
            return
        magic, version, _, _, order, _, name_len = _FIXED.unpack_from(view)
        name = self._prefix[_FIXED.size:]
        if (magic == MAGIC and version == VERSION and order != self.order and order < len(ORDERS)
                and name_len == len(name) and bytes(view[_FIXED.size:_FIXED.size + name_len]) == name):
            raise OtherOrder(order)

    def _name(self) -> str:
        return self._prefix[_FIXED.size:].decode(errors="replace")


def part_name(part: Part) -> str:
    return part.field.rsplit("/", 1)[1]


def file_field(plan: PagePlan, parts: list[Part]) -> str:
    """The field of a file holding ``parts`` (consecutive head groups, then ``rep``)."""
    groups = [int(part_name(p)[1:].split("of")[0]) for p in parts if part_name(p) != "rep"]
    rep = "+rep" if any(part_name(p) == "rep" for p in parts) else ""
    if not groups:
        return f"{plan.prefix}/rep"
    return f"{plan.prefix}/g{groups[0]}-{groups[-1] + 1}of{plan.groups}{rep}"


def writer_files(plan: PagePlan) -> list[tuple[str, int]]:
    """``(field, part count)`` of every file a writer of ``plan``'s geometry can write:
    each tensor-parallel size that divides the head groups, each of its ranks (rank 0's
    with the replicated part)."""
    names = [part_name(p) for p in plan.read_parts]
    rep, g = "rep" in names, plan.groups
    if all(n == "rep" for n in names):
        return [(f"{plan.prefix}/rep", 1)]
    return [(f"{plan.prefix}/g{r * g // s}-{(r + 1) * g // s}of{g}" + ("+rep" if rep and r == 0 else ""),
             g // s + (rep and r == 0))
            for s in range(1, g + 1) if g % s == 0 for r in range(s)]


def longest_name(key_bytes: int, plan: PagePlan) -> int:
    """Bytes of the longest object name ``<key>#<field>`` of a key of ``key_bytes`` bytes
    in ``plan``'s geometry, over every file its writers can write."""
    return key_bytes + 1 + max(len(field.encode()) for field, _ in writer_files(plan))


def header_room(key_bytes: int, plan: PagePlan) -> int:
    """The largest ``header_len`` of a file of a key of ``key_bytes`` bytes in ``plan``'s
    geometry (its name and a checksum per part), over every file its writers can write,
    in any order: head order has a part per head group, slot and layer order one per
    multi-head component, split order one per both (:func:`field_parts`), each with
    ``rep`` where the file has it."""
    def parts(field: str, n: int) -> int:
        if field.endswith("/rep"):
            return n
        rep = field.endswith("+rep")
        return max(n, len(plan.multi) + rep, (n - rep) * len(plan.multi) + rep)
    return max(align_up(_FIXED.size + key_bytes + 1 + len(field.encode()) + 8 * parts(field, n))
               for field, n in writer_files(plan))


def field_groups(tail: str) -> tuple[int, int] | None:
    """The head groups ``(a, b)`` of a file of field ``.../<tail>``; None for ``rep`` alone."""
    m = _FIELD.fullmatch(tail)
    return None if m is None or m.group(1) is None else (int(m.group(1)), int(m.group(2)))


def field_parts(plan: PagePlan, tail: str, order: int = HEAD) -> list[tuple[str, int]] | None:
    """``(part name, bytes)`` of the parts a file of field ``<plan.prefix>/<tail>`` holds
    in ``order``, in file order; ``None`` when ``tail`` is no field of this plan's geometry."""
    m = _FIELD.fullmatch(tail)
    if m is None:
        return None
    sizes = {part_name(p): p.nbytes for p in plan.read_parts}
    rep = sizes.get("rep")
    if m.group(0) == "rep":
        return [("rep", rep)] if rep is not None else None
    a, b, groups = int(m.group(1)), int(m.group(2)), int(m.group(3))
    group_bytes = next((n for name, n in sizes.items() if name != "rep"), None)
    if groups != plan.groups or not 0 <= a < b <= groups or group_bytes is None or (m.group(4) and rep is None):
        return None
    if order == SPLIT:
        parts = [(split_name(c.name, j, groups), n // (b - a))
                 for c, n in zip(plan.multi, plan.component_bytes(a, b)) for j in range(a, b)]
    elif order != HEAD:
        initial = ORDERS[order][0]
        parts = [(f"{initial}.{c.name}.g{a}-{b}", n) for c, n in zip(plan.multi, plan.component_bytes(a, b))]
    else:
        parts = [(f"h{j}of{groups}", group_bytes) for j in range(a, b)]
    return parts + [("rep", rep)] if m.group(4) else parts


def object_name(head) -> str | None:
    """The ``<key>#<field>`` a file's first bytes name, or ``None`` if they are no
    version-4 header (for tools that list a store's objects)."""
    view = memoryview(head)
    if len(view) < _FIXED.size:
        return None
    magic, version, _, _, _, _, name_len = _FIXED.unpack_from(view)
    if magic != MAGIC or version != VERSION or len(view) < _FIXED.size + name_len:
        return None
    return bytes(view[_FIXED.size:_FIXED.size + name_len]).decode(errors="replace")
