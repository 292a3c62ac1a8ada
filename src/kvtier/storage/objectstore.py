"""The shared machinery of the copy backends (file, Redis): each page part is one
checked object ``(key, field) -> header + payload``."""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from ..errors import UsageError
from ..pools import HostKVPool
from .base import _check_keys
from .codec import MAX_NAME_BYTES, CorruptObject, UnexpectedObject, decode, header_size, write_header
from .objects import pack_part, unpack_part
from .threaded import BATCH_BYTES, ThreadedStorage



class ObjectStorage(ThreadedStorage):
    """A copy backend: each page part is one object ``(key, field) -> header + payload``.

    Subclasses implement the primitives below on their medium; this class does
    validation, packing, checksums, batching, statistics and fault handling.
    Objects are packed into (and read into) the per-thread staging arena.
    """

    #: Payload bytes one worker moves per step: one ``_get``/``_put`` call, then its checks
    #: and copies; round-trip backends keep it large.
    CHUNK_BYTES = BATCH_BYTES

    # -- primitives ---------------------------------------------------------------------
    @abstractmethod
    def _put(self, items: list[tuple[str, str, np.ndarray]]) -> list[bool]:
        """Store ``(key, field, blob)`` objects (blob: uint8, header + payload); success per item."""

    @abstractmethod
    def _get(self, items: list[tuple[str, str]], dest: list[np.ndarray]) -> Iterable:
        """Stored objects per ``(key, field)``, in order: ``None`` if absent (or a fault the
        backend counted). ``dest[i]`` is a buffer of the expected object size; a backend
        reads into it and gives the bytes read. It never reads more than that: an object
        of another size comes as :class:`~kvtier.storage.codec.Partial` (at most its
        header, and its true size), or whole if it is smaller. A list, or a generator
        that reads each object when asked for it: a local backend does that, so that
        each object's checksum runs while the object is still in the CPU cache."""

    @abstractmethod
    def _has(self, items: list[tuple[str, str]]) -> list[bool]:
        """Whether each ``(key, field)`` object exists."""

    @abstractmethod
    def _has_any(self, keys: list[str]) -> list[bool]:
        """Whether any object of each key exists (used when no geometry is bound)."""

    @abstractmethod
    def _remove(self, items: list[tuple[str, str]]) -> None:
        """Remove single objects (corrupt ones)."""


    # -- the contract ----------------------------------------------------------------------
    def exists_each(self, keys: Sequence[str]) -> list[bool]:
        keys = _check_keys(keys)
        if not keys:
            return []
        t0 = time.perf_counter()
        try:
            if self._bound is None:
                return [p is True for p in self._has_any(keys)]
            fields = [p.field for p in self._bound.read_parts]
            found = self._has([(k, f) for k in keys for f in fields])
            return [all(found[i * len(fields):(i + 1) * len(fields)]) for i in range(len(keys))]
        except Exception as e:  # a storage fault is a miss, never an exception for the caller
            self._fault("exists", e)
            return [False] * len(keys)
        finally:
            self._stats.timed("exists", time.perf_counter() - t0)

    def _checked(self, keys, host_pool, host_indices, writing: bool):
        keys, pages = self._check_pages(keys, host_pool, host_indices, writing=writing)
        plan = self._plan(host_pool)
        parts = plan.write_parts if writing else plan.read_parts
        longest = max((len(k.encode()) for k in keys), default=0) + 1 + max(len(p.field.encode()) for p in parts)
        if longest > MAX_NAME_BYTES:
            raise UsageError(f"object names '<key>#<field>' would be up to {longest} bytes, over the header's "
                             f"{MAX_NAME_BYTES}; use shorter keys")
        views = {part.field: plan.part_views(host_pool, part) for part in parts}
        return keys, pages, parts, views

    def batch_set(self, keys: Sequence[str], host_pool: HostKVPool, host_indices: torch.Tensor) -> list[bool]:
        keys, pages, parts, views = self._checked(keys, host_pool, host_indices, writing=True)
        stored = [True] * len(keys)
        t0 = time.perf_counter()

        def set_chunk(chunk: range) -> None:
            names = [(i, part, f"{keys[i]}#{part.field}") for i in chunk for part in parts]
            sizes = [header_size(name) + part.nbytes for _, part, name in names]
            items = []
            for (i, part, name), blob in zip(names, self._carve(self._arena(sum(sizes)), sizes)):
                pack_part(views[part.field], pages[i], blob[header_size(name):])
                write_header(name, blob)
                items.append((keys[i], part.field, blob))
            try:
                ok = self._put(items)
            except Exception as e:
                self._fault("set", e)
                ok = [False] * len(items)
            for (i, part, _), good in zip(names, ok):
                stored[i] = stored[i] and bool(good)
                if good:
                    self._stats.add(bytes_written=part.nbytes)

        self._run(set_chunk, len(keys), sum(p.nbytes for p in parts))
        self._stats.add(pages_written=sum(stored), write_failures=len(keys) - sum(stored))
        self._stats.timed("set", time.perf_counter() - t0)
        return stored

    def batch_get(self, keys: Sequence[str], host_pool: HostKVPool, host_indices: torch.Tensor) -> list[bool]:
        keys, pages, parts, views = self._checked(keys, host_pool, host_indices, writing=False)
        loaded = [False] * len(keys)
        t0 = time.perf_counter()

        def get_chunk(chunk: range) -> None:
            items = [(keys[i], p.field) for i in chunk for p in parts]
            sizes = [header_size(f"{k}#{f}") + p.nbytes for (k, f), p in zip(items, parts * len(chunk))]
            blobs = self._fetch(items, self._carve(self._arena(sum(sizes)), sizes))
            for n, i in enumerate(chunk):
                payloads = self._decode(items[n * len(parts):(n + 1) * len(parts)], blobs, parts)
                if payloads is None:
                    continue
                for part, payload in zip(parts, payloads):  # every part checked before any is copied
                    unpack_part(views[part.field], pages[i], payload)
                loaded[i] = True
                self._stats.add(bytes_read=sum(p.nbytes for p in parts))

        self._run(get_chunk, len(keys), sum(p.nbytes for p in parts))
        hits = sum(loaded)
        self._stats.add(hits=hits, misses=len(keys) - hits)
        self._stats.timed("get", time.perf_counter() - t0)
        return loaded

    # -- internals ---------------------------------------------------------------------------
    def _fetch(self, items, dest) -> Iterator:
        """``_get``'s objects one by one, exactly ``len(items)`` of them; a fault of the
        backend (counted) makes the objects not yet given ``None``."""
        given = 0
        try:
            for blob in self._get(items, dest):
                if given == len(items):
                    break
                given += 1
                yield blob
        except Exception as e:
            self._fault("get", e)
        for _ in range(len(items) - given):
            yield None

    def _decode(self, items, blobs: Iterator, parts) -> list[memoryview] | None:
        """Checked payloads of one page's parts, taken from ``blobs`` (exactly one per part,
        checked as it comes), or None. After a part fails, the page's other parts are
        taken but not checked. A corrupt object is counted and deleted; an unexpected one
        (intact, another size) is counted and kept."""
        payloads: list | None = []
        for (key, field), part in zip(items, parts):
            blob = next(blobs)
            if payloads is None:
                continue
            payload = None if blob is None else self._check(key, field, blob, part)
            if payload is None:
                payloads = None
            else:
                payloads.append(payload)
        return payloads

    def _check(self, key: str, field: str, blob, part) -> memoryview | None:
        """The payload of one object, or None (counted; a corrupt object is deleted)."""
        try:
            return decode(f"{key}#{field}", blob, part.nbytes)
        except UnexpectedObject as e:
            self._fault("get", e)
        except CorruptObject as e:
            self._stats.add(corrupt=1, errors=1)
            self._warnings.warn(("corrupt",), "kvtier storage %s: %s; deleting it", self.scheme, e)
            try:
                self._remove([(key, field)])
            except Exception as err:
                self._fault("remove", err)
        return None
