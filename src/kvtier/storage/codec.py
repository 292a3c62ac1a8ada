"""Stored object format of the copy backends: a checked header, then the payload.

    offset  size  field
    0       4     magic b"KVT1"
    4       2     format version (1)
    6       2     header length (16-byte aligned, so the payload can be viewed as any dtype)
    8       8     payload length
    16      8     xxh3-64 checksum of the payload
    24      2     name length
    26      n     name: "<key>#<field>" in UTF-8 (the object's own identity)
    26+n    pad   zeros up to the header length

A reader checks every field against what it asked for; any mismatch — wrong
magic, version, name or length, a truncated payload, a checksum that does not
match — makes the object corrupt: a miss, never KV.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

MAGIC = b"KVT1"
VERSION = 1
_FIXED = struct.Struct("<4sHHQQH")
_ALIGN = 16


class CorruptObject(Exception):
    """A stored object failed a header or checksum check."""


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


def decode(name: str, blob: bytes | bytearray | memoryview, payload_len: int) -> memoryview:
    """The payload of ``blob`` after checking it is the intact object ``name`` of
    ``payload_len`` bytes; raises :class:`CorruptObject` otherwise."""
    view = memoryview(blob)
    if len(view) < _FIXED.size:
        raise CorruptObject(f"{name}: {len(view)} bytes, shorter than a header")
    magic, version, size, length, checksum, name_len = _FIXED.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptObject(f"{name}: bad magic/version {magic!r}/{version}")
    if size != header_size(name) or bytes(view[_FIXED.size:_FIXED.size + name_len]) != name.encode():
        raise CorruptObject(f"{name}: header names another object")
    if length != payload_len or len(view) != size + length:
        raise CorruptObject(f"{name}: payload {len(view) - size} bytes, header says {length}, expected {payload_len}")
    payload = view[size:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptObject(f"{name}: checksum mismatch")
    return payload
