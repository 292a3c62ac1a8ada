"""Stored object format of the Redis backend (one object per page part): a checked
header, then the payload. Files use ``kvtier.storage.pagefile``.

    offset  size  field
    0       4     magic b"KVT1"
    4       2     format version (1)
    6       2     header length (16-byte aligned, so the payload can be viewed as any dtype)
    8       8     payload length
    16      8     xxh3-64 checksum of the payload
    24      2     name length
    26      n     name: "<key>#<field>" in UTF-8 (the object's own identity)
    26+n    pad   zeros up to the header length

A reader checks every field against what it asked for. An object whose own
header or checksum fails — wrong magic, version or name, a size that disagrees
with its header's length, a checksum that does not match — is corrupt: a miss,
never KV, and the backend deletes it. An intact object of another length than the
reader expects (or one too large to read at all) is only a miss: nothing about it
says it is broken, so it is left alone.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np
import xxhash

from ..errors import CorruptObject, UnexpectedObject

MAGIC = b"KVT1"
VERSION = 1
_FIXED = struct.Struct("<4sHHQQH")
_ALIGN = 16


#: The longest object name (``<key>#<field>``, UTF-8) a header can hold.
MAX_NAME_BYTES = 0xFFFF


class Partial(NamedTuple):
    """An object a backend did not read whole because its size was wrong: its first
    bytes (at most the expected header, possibly none) and its true size."""

    head: bytes | memoryview
    size: int


def header_size(name: str) -> int:
    n = _FIXED.size + len(name.encode())
    return -(-n // _ALIGN) * _ALIGN


def write_header(name: str, blob: np.ndarray) -> None:
    """Fill the header of ``blob`` (uint8: ``header_size(name)`` bytes, then the payload)."""
    raw_name = name.encode()
    size = header_size(name)
    payload = blob[size:]
    head = _FIXED.pack(MAGIC, VERSION, size, payload.nbytes, xxhash.xxh3_64_intdigest(payload), len(raw_name))
    blob[:size] = np.frombuffer(head + raw_name + bytes(size - len(head) - len(raw_name)), dtype=np.uint8)


def _check_header(name: str, head: memoryview, total: int, payload_len: int) -> tuple[int, int]:
    """``(header length, checksum)`` of an object of ``total`` bytes whose first bytes are
    ``head``, if its header is intact, names ``name`` and promises ``payload_len`` bytes."""
    raw_name = name.encode()
    own_size = -(-(_FIXED.size + len(raw_name)) // _ALIGN) * _ALIGN  # header_size(name)
    expected = own_size + payload_len
    if len(head) < _FIXED.size:
        if total > len(head):  # not read: nothing to judge it by
            raise UnexpectedObject(f"{name}: {total} bytes, expected {expected}; not read")
        raise CorruptObject(f"{name}: {total} bytes, shorter than a header")
    magic, version, size, length, checksum, name_len = _FIXED.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise CorruptObject(f"{name}: bad magic/version {bytes(magic)!r}/{version}")
    if size != own_size or head[_FIXED.size:_FIXED.size + name_len] != raw_name:
        raise CorruptObject(f"{name}: header names another object")
    if total != size + length:
        raise CorruptObject(f"{name}: {total - size} payload bytes, its header says {length}")
    if length != payload_len:
        raise UnexpectedObject(f"{name}: an intact header for {length} payload bytes, expected {payload_len}")
    return size, checksum


def decode(name: str, blob: bytes | bytearray | memoryview | Partial, payload_len: int) -> memoryview:
    """The payload of ``blob`` after checking it is the intact object ``name`` of
    ``payload_len`` bytes. Raises :class:`CorruptObject` when its own header or
    checksum says it is broken, :class:`UnexpectedObject` when it is another object."""
    if isinstance(blob, Partial):
        _check_header(name, memoryview(blob.head), blob.size, payload_len)
        raise UnexpectedObject(f"{name}: {blob.size} bytes, expected {header_size(name) + payload_len}")
    view = memoryview(blob)
    size, checksum = _check_header(name, view, len(view), payload_len)
    payload = view[size:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptObject(f"{name}: checksum mismatch")
    return payload
