"""L3 storage: ``open(url)`` picks a backend by URL scheme; ``page_keys`` names pages.

| URL | backend |
|---|---|
| ``file:///path`` | :class:`kvtier.storage.file.FileStorage` (default, embedded) |
| ``redis://host:port/db``, ``rediss://...``, ``redis+cluster://host:port`` | Redis / Valkey |
| ``mooncake://master_host:port?metadata=...&protocol=tcp`` | Mooncake Store, zero-copy |

Every backend option may be given as a keyword or in the URL query
(``file:///d?capacity_bytes=1000000``, ``redis://h:6379/0?ttl=60&socket_timeout=0.5``);
see each backend's ``OPTIONS``.
"""

from __future__ import annotations

import importlib
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import UsageError
from .base import Storage
from .keys import page_keys
from .objectstore import ObjectStorage
from .options import merge_options

# scheme -> "module:Class"; imported on use so that optional clients stay optional.
BACKENDS = {
    "file": "kvtier.storage.file:FileStorage",
    "redis": "kvtier.storage.redis:RedisStorage",
    "rediss": "kvtier.storage.redis:RedisStorage",
    "redis+cluster": "kvtier.storage.redis:RedisStorage",
    "mooncake": "kvtier.storage.mooncake:MooncakeStorage",
}


def open(url: str, **options) -> Storage:  # noqa: A001 - the contract's name
    """A storage backend for ``url``; ``options`` are the backend's keyword options
    (e.g. ``spec=`` and ``page_size=``, ``capacity_bytes=`` for files, ``ttl=`` for Redis),
    which the URL query may carry too. Unknown or invalid options raise ``ValueError``."""
    if not isinstance(url, str) or "://" not in url:
        raise UsageError(f"storage url must look like scheme://..., got {url!r}; schemes: {', '.join(BACKENDS)}")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in BACKENDS:
        raise UsageError(f"unknown storage scheme {scheme!r}; supported: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[scheme].split(":")
    backend = getattr(importlib.import_module(module), cls)
    parts = urlsplit(url)
    options = merge_options(f"{scheme}:// storage", backend.OPTIONS, backend.KEYWORDS, parts.query, options)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UsageError(f"file URL {url!r} names host {parts.netloc!r}; use file:///absolute/path")
        if not parts.path:
            raise UsageError(f"file URL {url!r} has no path; use file:///absolute/path")
        return backend(unquote(parts.path), **options)
    return backend(urlunsplit(parts._replace(query="")), **options)


__all__ = ["BACKENDS", "ObjectStorage", "Storage", "open", "page_keys"]
