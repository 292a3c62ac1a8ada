"""Topology-free page keys: a chain of hashes over token ids, salted by namespace.

Key ``i`` is ``hash(key_{i-1}, tokens of page i)``; key 0 hashes the namespace and
the tenant salt first, so different models or tenants never share a key. The key
text is ``<namespace>/<hex digest>``; it holds no rank, layout or dtype — those go
into object names (see ``kvtier.storage.objects``).
"""

from __future__ import annotations

import hashlib
import re
from typing import Callable, Sequence

import numpy as np
import torch

from .._checks import positive_int
from ..errors import UsageError

_DOMAIN = b"kvtier-page-v1"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


try:
    from xxhash import xxh3_128_digest as _xxh3_128  # called in C: no Python frame per page
except ImportError:  # pragma: no cover - a dependency, but this module imports without it
    def _xxh3_128(data: bytes) -> bytes:
        raise UsageError("hash 'xxh3' needs the Python package xxhash: pip install xxhash")


HASHES: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256, "xxh3": _xxh3_128}


def namespace_tag(namespace: str) -> str:
    """Filesystem- and URL-safe form of a namespace (``meta-llama/Llama-3`` -> ``meta-llama%2FLlama-3``)."""
    return _SAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), namespace)


def _token_array(token_ids) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise UsageError(f"token_ids must be a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype("<i8", copy=False)


def page_keys(token_ids: Sequence[int] | np.ndarray | torch.Tensor, page_size: int, namespace: str = "default",
              salt: str | bytes | None = None, hash: str = "sha256") -> list[str]:
    """One key per *full* page of ``token_ids``; key ``i`` depends on pages ``0..i``.

    ``namespace`` names the model (and deployment); ``salt`` separates tenants within
    it; ``hash`` is ``"sha256"`` (default) or ``"xxh3"`` (128-bit, needs ``xxhash``).
    """
    return extend_keys(None, token_ids, page_size, namespace, salt, hash)


def canonical_salt(salt) -> bytes:
    """A tenant salt as bytes: ``None`` -> ``b""``, ``str`` -> UTF-8; anything else
    (an int, a bool: no tenant's name) raises ``ValueError``. The tree and the storage
    keys take this one form, so ``None``/``""``/``b""`` are one tenant."""
    if salt is None:
        return b""
    if isinstance(salt, str):
        return salt.encode("utf-8")
    if isinstance(salt, (bytes, bytearray, memoryview)):
        return bytes(salt)
    raise UsageError(f"salt must be None, str or bytes, got {type(salt).__name__}")


def extend_keys(parent: str | None, token_ids, page_size: int, namespace: str = "default",
                salt: str | bytes | None = None, hash: str = "sha256") -> list[str]:
    """Keys of the full pages of ``token_ids`` that follow the page whose key is
    ``parent`` (``None``: they start the sequence). ``extend_keys(keys[i - 1], pages
    i.., ...)`` equals ``page_keys(all pages, ...)[i:]``, so a prefix tree can key
    each new page without rehashing its ancestors."""
    positive_int("page_size", page_size)
    if not isinstance(namespace, str) or not namespace:
        raise UsageError(f"namespace must be a non-empty str, got {namespace!r}")
    if hash not in HASHES:
        raise UsageError(f"unknown hash {hash!r}; supported: {', '.join(HASHES)}")
    tokens = _token_array(token_ids)
    prefix = namespace_tag(namespace) + "/"
    if parent is None:
        salt_bytes = canonical_salt(salt)
        ns = namespace.encode()
        digest = HASHES[hash](b"\0".join([_DOMAIN, hash.encode(), len(ns).to_bytes(4, "little") + ns, salt_bytes]))
    else:
        digest = bytes.fromhex(parent.rsplit("/", 1)[1])
    # NOTE: one bytes object for all pages, sliced per page: a numpy slice and its
    # tobytes() per page cost more than the hash itself at the simulator's one-token pages.
    fn = HASHES[hash]
    data = tokens.tobytes()
    step = page_size * tokens.itemsize
    keys = []
    for start in range(0, len(tokens) // page_size * step, step):
        digest = fn(digest + data[start:start + step])
        keys.append(prefix + digest.hex())
    return keys
