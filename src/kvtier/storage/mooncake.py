"""``mooncake://master_host:port?metadata=...&protocol=tcp``: Mooncake Store, zero-copy.

The host pool's one allocation is registered with the Mooncake client once; pages
then move straight between pool memory and the store with
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``, using the
spans of the pool's page buffer metadata. Object keys carry the page format
(the byte order inside the spans), so a reader with another layout never reads
another layout's bytes.

- ``page_head`` pools store one object per head group (and one for replicated
  single-head components), so tensor-parallel shards of any size share pages:
  ``<prefix><key>#<fingerprint>/p<page size>/<format>/h<j>of<G>``.
- Other layouts store one object per page: ``...#.../<format>/page`` (full specs
  only; a shard must use ``page_head``).
- A marker ``<prefix><key>`` (1 byte) is written last, so ``batch_exists`` works
  with no geometry bound; with one (``spec=``, ``page_size=`` and ``layout=``) it
  also checks that geometry's objects.
- In names, ``%`` and ``#`` of a key are escaped (``%25``, ``%23``), so ``#`` ends
  the key part: ``delete(["a"])`` removes ``a`` and ``a#...``, never ``a/b``'s objects.

Options (keywords or URL query): ``metadata`` (metadata server URL, e.g.
``http://host:port/metadata``), ``protocol`` (``tcp`` or ``rdma``),
``local_hostname``, ``global_segment_size``, ``local_buffer_size``, ``rdma_devices``,
``prefix``, ``layout``, ``connect_timeout``, ``backoff``.
A failed zero-copy read may have written part of the page: the page is reported as
a miss (``False``) and must not be used, exactly as for any miss.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from urllib.parse import urlsplit

import torch

from ..errors import UsageError
from ..layout import LAYOUTS, Layout, get_layout
from ..pools import HostKVPool
from .base import Storage, _check_keys
from .faults import Breaker
from .options import Opt, check_options
from .zerocopy import escape_key, page_objects, spans

_NOT_FOUND = -704  # OBJECT_NOT_FOUND in Mooncake's error codes
_OTHER_SIZE = -600  # INVALID_PARAMS: what a read of an object larger than its buffer answers


def _service_fault(code: int) -> bool:
    """Whether a Mooncake error code says the service cannot be used now (an internal
    error, a transfer or RPC failure, its metadata and HA states, a segment or client it
    lost), which opens the breaker. Any other code is about one object (a store full
    for now, another size under the name, a replica not ready): that object's miss or
    failed write, counted, while every other object is served."""
    return code == -1 or code in (-101, -103) or -999 <= code <= -800 or -1099 <= code <= -1000


class MooncakeStorage(Storage):
    scheme = "mooncake"
    OPTIONS = {**Storage.OPTIONS, "prefix": Opt(str), "metadata": Opt(str, none_ok=True),
               "protocol": Opt(str, choices=("tcp", "rdma")), "local_hostname": Opt(str),
               "global_segment_size": Opt(int, 1), "local_buffer_size": Opt(int, 0), "rdma_devices": Opt(str),
               "layout": Opt(str, none_ok=True, choices=tuple(LAYOUTS)), "connect_timeout": Opt(float, 0.001),
               "backoff": Opt(float, 0)}

    def __init__(self, url: str, *, prefix: str = "kvtier/", metadata: str | None = None, protocol: str = "tcp",
                 local_hostname: str = "127.0.0.1", global_segment_size: int = 256 << 20,
                 local_buffer_size: int = 64 << 20, rdma_devices: str = "", layout: str | None = None,
                 connect_timeout: float = 2.0, backoff: float = 5.0, **options) -> None:
        super().__init__(**options)
        check_options(self.OPTIONS, prefix=prefix, metadata=metadata, protocol=protocol,
                      local_hostname=local_hostname, global_segment_size=global_segment_size,
                      local_buffer_size=local_buffer_size, rdma_devices=rdma_devices, layout=layout,
                      connect_timeout=connect_timeout, backoff=backoff)
        if (layout is None) != (self._spec is None):
            raise UsageError("layout= binds a mooncake store together with spec= and page_size=: give all three "
                             f"or none (got layout={layout!r}, spec bound: {self._spec is not None})")
        self._layout: Layout | None = None if layout is None else get_layout(layout)
        if self._bound is not None:
            page_objects(self._spec, self._layout, self._bound, False)  # a shard needs a split-heads layout
        parts = urlsplit(url)
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            host = port = None
        if not host or not port:
            raise UsageError(f"mooncake URL {url!r} needs the master's host:port")
        if parts.query:
            raise UsageError(f"mooncake URL {url!r}: URL options are read by kvtier.storage.open(); "
                             "pass keywords here")
        self.prefix = prefix
        self._config = {
            "local_hostname": local_hostname,
            "metadata_server": metadata or "P2PHANDSHAKE",
            "global_segment_size": global_segment_size,
            "local_buffer_size": local_buffer_size,
            "protocol": protocol,
            "rdma_devices": rdma_devices,
            "master_server_addr": f"{host}:{port}",
        }
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError:  # pragma: no cover - depends on the environment
            raise UsageError("mooncake:// needs Mooncake Store: pip install mooncake-transfer-engine "
                             "(or mooncake-transfer-engine-non-cuda on CPU machines)") from None
        self._cls = MooncakeDistributedStore
        self._lock = threading.Lock()
        self._store = None
        self._closed = False
        self._connect_timeout = connect_timeout
        self._breaker = Breaker(backoff)
        self._suspect = False  # an RPC failed: probe the master before the next call
        self._registered: dict[int, HostKVPool] = {}  # region data_ptr -> pool (kept alive while registered)
        self._marker = torch.ones(64, dtype=torch.uint8)
        self._client()

    # -- connection ----------------------------------------------------------------------
    def client(self):
        """The connected ``mooncake.store.MooncakeDistributedStore`` this store calls, for
        a tool that drives the same Mooncake Store beside it (``kvtier bench storage``
        times its raw ``batch_put_from`` / ``batch_get_into`` against this store's);
        ``None`` when this store is closed or the master cannot be reached (counted as an
        error, as for any call). The store still owns it: do not close it or unregister
        the buffers it registered, and keep other objects outside ``prefix``, which
        :meth:`clear` removes."""
        return self._client()

    # NOTE: Mooncake's setup() retries an unreachable master for minutes while holding
    # the GIL, so a thread cannot bound it, and its RPCs to a master that is gone block
    # for seconds each. A plain TCP connect to the master (and to an HTTP metadata
    # server) first turns "down" into a quick, counted failure; after any failure the
    # breaker makes calls misses at once for ``backoff`` seconds, then probes again.
    def _client(self):
        """The set-up client for one operation, or None (counted as an error)."""
        if self._closed:
            return None
        if self._breaker.is_open():
            self._stats.add(errors=1)
            return None
        try:
            with self._lock:
                if self._store is None or self._suspect:
                    for host, port in self._endpoints():
                        socket.create_connection((host, port), timeout=self._connect_timeout).close()
                    self._suspect = False
                if self._store is None and not self._closed:
                    self._store = self._setup()
                return self._store
        except Exception as e:
            self._failed("connect", e)
            return None

    def _setup(self):
        store = self._cls()
        c = self._config
        rc = store.setup(c["local_hostname"], c["metadata_server"], c["global_segment_size"],
                         c["local_buffer_size"], c["protocol"], c["rdma_devices"], c["master_server_addr"])
        if rc != 0:
            raise RuntimeError(f"setup returned {rc}")
        if store.register_buffer(self._marker.data_ptr(), self._marker.numel()) != 0:
            raise RuntimeError("register_buffer failed for the marker buffer")
        return store

    def _failed(self, op: str, error: BaseException | str) -> None:
        self._suspect = True
        self._breaker.trip(error)
        self._fault(op, error if isinstance(error, BaseException) else RuntimeError(error))

    def _codes(self, op: str, call: str, codes: list[int]) -> None:
        """A call's error codes: the breaker opens for a service fault; an object's own
        (see :func:`_service_fault`) is one counted error, its page a miss or unstored."""
        if not codes:
            return
        message = f"{call} codes {sorted(set(codes))}"
        if any(_service_fault(rc) for rc in codes):
            self._failed(op, message)
        else:
            self._fault(op, RuntimeError(message))

    def _endpoints(self) -> list[tuple[str, int]]:
        host, port = self._config["master_server_addr"].rsplit(":", 1)
        out = [(host, int(port))]
        meta = urlsplit(self._config["metadata_server"])
        if meta.scheme in ("http", "https") and meta.hostname:
            out.append((meta.hostname, meta.port or (443 if meta.scheme == "https" else 80)))
        return out

    def _register(self, store, pool: HostKVPool) -> None:
        """Register every allocation holding the pool (one, or one per component for a
        pool that wraps an engine's separate K and V buffers)."""
        with self._lock:
            for ptr, nbytes in pool.regions:
                if ptr in self._registered:
                    continue
                rc = store.register_buffer(ptr, nbytes)
                if rc != 0:
                    raise RuntimeError(f"register_buffer of a host pool region ({nbytes} bytes) returned {rc}")
                self._registered[ptr] = pool

    # -- objects -------------------------------------------------------------------------
    def _check_pool(self, host_pool: HostKVPool) -> None:
        super()._check_pool(host_pool)
        if self._layout is not None and host_pool.layout != self._layout.name:
            raise UsageError(f"this store is bound to layout {self._layout.name!r}; the pool has {host_pool.layout!r}")

    def _marker_name(self, key: str) -> str:
        return self.prefix + escape_key(key)

    def _batch(self, keys, pool, host_indices, writing):
        keys, pages = self._check_pages(keys, pool, host_indices, writing=writing)
        objects = page_objects(pool.spec, get_layout(pool.layout), self._plan(pool), writing)
        names, ptrs, sizes, owners = [], [], [], []
        for i, (key, page) in enumerate(zip(keys, pages)):
            for suffix, pieces in objects:
                p, s = spans(pool, page * pool.page_size, pieces)
                names.append(f"{self._marker_name(key)}#{suffix}")
                ptrs.append(p)
                sizes.append(s)
                owners.append(i)
        return keys, names, ptrs, sizes, owners

    # -- the contract ----------------------------------------------------------------------
    def batch_set(self, keys, host_pool, host_indices) -> list[bool]:
        keys, names, ptrs, sizes, owners = self._batch(keys, host_pool, host_indices, writing=True)
        stored = [False] * len(keys)
        store = self._client()
        if store is None or not keys:
            return stored
        t0 = time.perf_counter()
        try:
            self._register(store, host_pool)
            rcs = store.batch_put_from_multi_buffers(names, ptrs, sizes)
            stored = [True] * len(keys)
            for i, rc in zip(owners, rcs):
                stored[i] = stored[i] and rc == 0
            self._codes("set", "batch_put_from_multi_buffers", [rc for rc in rcs if rc != 0])
            done = [k for k, ok in zip(keys, stored) if ok]
            if done:
                marks = store.batch_put_from([self._marker_name(k) for k in done],
                                             [self._marker.data_ptr()] * len(done), [1] * len(done))
                self._codes("set", "marker put", [rc for rc in marks if rc != 0])
        except Exception as e:
            self._failed("set", e)
            stored = [False] * len(keys)
        nbytes = sum(sum(s) for i, s in zip(owners, sizes) if stored[i])
        self._stats.add(bytes_written=nbytes, pages_written=sum(stored), write_failures=len(keys) - sum(stored))
        self._stats.timed("set", time.perf_counter() - t0)
        return stored

    def batch_get(self, keys, host_pool, host_indices) -> list[bool]:
        keys, names, ptrs, sizes, owners = self._batch(keys, host_pool, host_indices, writing=False)
        loaded = [False] * len(keys)
        store = self._client()
        if store is not None and keys:
            t0 = time.perf_counter()
            try:
                self._register(store, host_pool)
                rcs = store.batch_get_into_multi_buffers(names, ptrs, sizes)
                loaded = [True] * len(keys)
                for i, rc, s in zip(owners, rcs, sizes):
                    loaded[i] = loaded[i] and rc == sum(s)
                self._codes("get", "batch_get_into_multi_buffers",
                            [rc for rc in rcs if rc < 0 and rc not in (_NOT_FOUND, _OTHER_SIZE)])
                # NOTE: an object of another size under a page's name (a name fixes the size) is
                # corrupt or foreign: counted and deleted, page and marker, as the other stores do;
                # kept, it would miss on every read, and a put of the page would find it there
                other = sorted({i for i, rc, s in zip(owners, rcs, sizes)
                                if rc == _OTHER_SIZE or (rc >= 0 and rc != sum(s))})
                if other:
                    self._stats.add(corrupt=len(other), errors=len(other))
                    self._warnings.warn(("corrupt",), "kvtier storage %s: %d objects of another size than their "
                                        "names say; deleting them", self.scheme, len(other))
                    self.delete([keys[i] for i in other])
            except Exception as e:
                self._failed("get", e)
                loaded = [False] * len(keys)
            self._stats.timed("get", time.perf_counter() - t0)
        nbytes = sum(sum(s) for i, s in zip(owners, sizes) if loaded[i])
        self._stats.add(hits=sum(loaded), misses=len(keys) - sum(loaded), bytes_read=nbytes)
        return loaded

    def batch_exists(self, keys) -> int:
        present = self.exists_each(keys)
        return next((i for i, p in enumerate(present) if not p), len(present))

    def exists_each(self, keys) -> list[bool]:
        keys = _check_keys(keys)
        store = self._client()
        if store is None or not keys:
            return [False] * len(keys)
        t0 = time.perf_counter()
        names = [self._marker_name(k) for k in keys]  # markers: any geometry
        per_key = 1
        if self._bound is not None:  # and the bound geometry's objects
            suffixes = [s for s, _ in page_objects(self._spec, self._layout, self._bound, False)]
            per_key += len(suffixes)
            names = [n for m in names for n in (m, *(f"{m}#{s}" for s in suffixes))]
        try:
            rcs = store.batch_is_exist(names)
        except Exception as e:
            self._failed("exists", e)
            return [False] * len(keys)
        finally:
            self._stats.timed("exists", time.perf_counter() - t0)
        if any(rc < 0 for rc in rcs):
            self._failed("exists", f"batch_is_exist codes {sorted({rc for rc in rcs if rc < 0})}")
        return [all(rc == 1 for rc in rcs[i * per_key:(i + 1) * per_key]) for i in range(len(keys))]

    def delete(self, keys) -> None:
        keys = _check_keys(keys)
        store = self._client()
        if store is None or not keys:
            return
        try:
            alternatives = "|".join(re.escape(self._marker_name(k)) for k in keys)
            if store.remove_by_regex(f"^({alternatives})(#.*)?$", True) < 0:
                self._failed("delete", "remove_by_regex failed")
        except Exception as e:
            self._failed("delete", e)

    def clear(self) -> None:
        store = self._client()
        if store is None:
            return
        try:
            if store.remove_by_regex(f"^{re.escape(self.prefix)}", True) < 0:
                self._failed("clear", "remove_by_regex failed")
        except Exception as e:
            self._failed("clear", e)

    def close(self) -> None:
        super().close()
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
            if store is None:
                return
            for ptr in list(self._registered):
                store.unregister_buffer(ptr)
            self._registered.clear()
            store.close()
