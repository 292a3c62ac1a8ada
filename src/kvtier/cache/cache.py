"""``HierarchicalCache``: prefix matching across device, host and storage, and the policies
that move pages between them. Background threads (``kvtier.cache.workers``) do the
slow parts: per-layer loads, storage writes, storage prefetches.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import torch

from ..pools import DeviceKVPool, HostKVPool
from ..storage.keys import extend_keys
from ..transfer import check_io_backend
from .handles import Acquired, LoadHandle, MatchResult
from .eviction import Eviction
from .radix import RadixTree
from .stats import CacheStats
from .tiers import TierMoves
from .workers import Worker

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
SELECTIVE_HITS = 2  # write_through_selective backs a page up on its second hit


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; supported: {', '.join(choices)}")


def _tokens(token_ids) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return list(token_ids)


class HierarchicalCache(TierMoves, Eviction):
    """Prefix cache over a device pool (L1), a host pool (L2) and optional storage (L3).

    Thread-safe: one lock guards the tree and the allocators; copies to and from
    storage and per-layer loads run on worker threads outside it.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, storage=None, *,
                 write_policy: str = "write_through", prefetch_policy: str = "best_effort",
                 namespace: str = "default", prefetch_timeout: float = 1.0, io_backend: str = "direct",
                 allocator=None, hash: str = "sha256") -> None:
        _check_choice("write_policy", write_policy, WRITE_POLICIES)
        _check_choice("prefetch_policy", prefetch_policy, PREFETCH_POLICIES)
        check_io_backend(io_backend)
        if not isinstance(device_pool, DeviceKVPool) or not isinstance(host_pool, HostKVPool):
            raise ValueError("device_pool must be a DeviceKVPool and host_pool a HostKVPool")
        if device_pool.spec != host_pool.spec or device_pool.page_size != host_pool.page_size:
            raise ValueError(f"device pool ({device_pool.spec.fingerprint()}, page_size {device_pool.page_size}) "
                             f"and host pool ({host_pool.spec.fingerprint()}, page_size {host_pool.page_size}) differ")
        self.device_pool, self.host_pool, self.storage = device_pool, host_pool, storage
        self.allocator = allocator or device_pool
        self.page_size = host_pool.page_size
        self.write_policy, self.prefetch_policy = write_policy, prefetch_policy
        self.prefetch_timeout, self.io_backend = prefetch_timeout, io_backend
        self.namespace, self.hash = namespace, hash
        self.tree = RadixTree(self.page_size)
        self._lock = threading.RLock()
        self._stats = CacheStats(device_pool.spec.bytes_per_token)
        self._loader = Worker("kvtier-load")
        self._writer = Worker("kvtier-store") if storage is not None else None
        self._prefetcher = Worker("kvtier-prefetch") if storage is not None else None

    # -- matching ----------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor, salt=None) -> MatchResult:
        """The longest cached prefix of ``token_ids`` (whole pages), tier by tier."""
        tokens = _tokens(token_ids)
        with self._lock:
            path, matched = self.tree.match(tokens, salt)
            device_nodes = [n for n in path if n.device is not None]
            device_len = sum(len(n.key) for n in device_nodes)
            for node in path:
                node.hits += 1
                if self.write_policy == "write_through_selective" and node.hits >= SELECTIVE_HITS:
                    self._backup(node)
            device = (torch.cat([n.device for n in device_nodes]) if device_nodes
                      else torch.empty(0, dtype=torch.int64, device=self.device_pool.index_device))
            last = path[-1] if path else self.tree.root(salt)
            last_key = self._last_store_key(last, salt) if self.storage is not None else None
        storage_len = self._storage_hit(tokens, matched, last_key, salt)
        self._stats.matched(device_len, matched - device_len, storage_len)
        return MatchResult(device, device_len, matched - device_len, storage_len, last, tuple(path),
                           tuple(tokens), salt)

    def _storage_hit(self, tokens, matched, last_key, salt) -> int:
        if self.storage is None:
            return 0
        usable = len(tokens) - len(tokens) % self.page_size
        if usable <= matched:
            return 0
        keys = extend_keys(last_key, tokens[matched:usable], self.page_size, self.namespace, salt, self.hash)
        return self.storage.batch_exists(keys) * self.page_size

    # -- locking -----------------------------------------------------------------------------------
    def lock(self, match: MatchResult) -> None:
        """Keep the matched pages from eviction until :meth:`unlock`."""
        with self._lock:
            self.tree.lock(match.last_node, +1)

    def unlock(self, match: MatchResult) -> None:
        with self._lock:
            self.tree.lock(match.last_node, -1)

    @contextlib.contextmanager
    def locked(self, match: MatchResult):
        """``with cache.locked(match): ...``"""
        self.lock(match)
        try:
            yield match
        finally:
            self.unlock(match)

    # -- one request's prefix, from whichever tier holds it -----------------------------------
    def acquire(self, token_ids: Sequence[int] | torch.Tensor, salt=None, wait: bool = True) -> Acquired:
        """Match ``token_ids``, prefetch a storage hit to the host (per ``prefetch_policy``),
        lock the prefix and load its host part to the device. With ``wait`` the load is
        finished on return; otherwise wait on ``acquired.load`` layer by layer.
        Call :meth:`release` when the request is done with it."""
        first = match = self.match_prefix(token_ids, salt)
        if first.storage_len:  # storage -> host, then it is a host hit like any other
            self.prefetch(token_ids, salt).wait()
            match = self.match_prefix(token_ids, salt)
        self.lock(match)
        load = self.load_back(match)
        if wait:
            load.wait()
        reused = len(load)
        device_hit = min(first.device_len, reused)
        host_hit = min(first.host_len, reused - device_hit)
        return Acquired(match, load, device_hit, host_hit, reused - device_hit - host_hit)

    def release(self, acquired: Acquired) -> None:
        self.unlock(acquired.match)

    # -- host -> device -------------------------------------------------------------------------------
    def load_back(self, match: MatchResult) -> LoadHandle:
        """Bring the host hit of ``match`` to the device, layer by layer, in the background.

        The handle's ``device_indices`` cover the device hit and every host page that
        got device slots (all of them unless the device is full of locked pages).
        """
        with self._lock:
            path = match.last_node.path() if self.tree.attached(match.last_node) else []
            depends = tuple({id(n.loading): n.loading for n in path if n.loading is not None}.values())
            slots, host_slots, loaded_nodes = [], [], []
            for node in path:
                if node.device is None:
                    if node.host is None:
                        break
                    got = self._alloc_device(len(node.key))
                    if got is None:
                        break
                    node.device = got
                    host_slots.append(node.host)
                    loaded_nodes.append(node)
                slots.append(node.device)
            device = (torch.cat(slots) if slots
                      else torch.empty(0, dtype=torch.int64, device=self.device_pool.index_device))
            handle = LoadHandle(device, self.device_pool.spec.layer_num, depends)
            if not loaded_nodes:
                handle._finish()
                return handle
            last = loaded_nodes[-1]
            for node in loaded_nodes:
                node.loading = handle
            self.tree.lock(last, +1)
        host_idx, dev_idx = torch.cat(host_slots), torch.cat([n.device for n in loaded_nodes])
        self._stats.add(loaded_tokens=host_idx.numel())
        self._loader.submit(lambda: self._load(handle, host_idx, dev_idx, loaded_nodes, last))
        return handle

    def _load(self, handle, host_idx, dev_idx, nodes, last) -> None:
        error = None
        device = self.device_pool.device
        # NOTE: on CUDA the copies go on a side stream, and each layer records an event
        # that wait_layer() makes the caller's stream wait on (no host synchronization).
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for layer in range(self.device_pool.spec.layer_num):
                    self.host_pool.load_to_device_per_layer(self.device_pool, host_idx, dev_idx, layer,
                                                            self.io_backend)
                    if stream is not None:
                        handle._record_cuda_event(layer, stream)
                    handle._layer_done(layer)
        except BaseException as e:  # surfaced on the handle; the pages stay on the host
            error = e
            self._stats.add(errors=1)
        with self._lock:
            for node in nodes:
                if node.loading is handle:
                    node.loading = None
            self.tree.lock(last, -1)
        handle._finish(error)

    # -- inserting ------------------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int] | torch.Tensor, device_indices: torch.Tensor, salt=None) -> int:
        """Record KV the engine computed: ``device_indices[i]`` holds token ``i``.

        Only full pages are cached. Returns how many leading tokens were already cached
        on the device. The cache owns the slots of the full pages from there on; slots in
        ``device_indices[:returned]`` that the caller allocated itself (rather than got
        from :meth:`match_prefix` / :meth:`load_back`) are duplicates for it to free.
        """
        tokens = _tokens(token_ids)
        usable = len(tokens) - len(tokens) % self.page_size
        if not isinstance(device_indices, torch.Tensor) or device_indices.dim() != 1 \
                or device_indices.numel() < usable:
            n = device_indices.numel() if isinstance(device_indices, torch.Tensor) else device_indices
            raise ValueError(f"device_indices must be a 1-D tensor of at least {usable} slots (the full pages of "
                             f"{len(tokens)} tokens), got {n}")
        with self._lock:
            path, matched = self.tree.match(tokens[:usable], salt)
            already, offset = 0, 0
            for node in path:  # device copies are prefix-closed: device nodes come first
                if node.device is None:  # host-only: adopt the caller's freshly computed slots
                    node.device = device_indices[offset:offset + len(node.key)].clone()
                elif already == offset:
                    already += len(node.key)
                offset += len(node.key)
            new = []
            if matched < usable:
                parent = path[-1] if path else self.tree.root(salt)
                node = self.tree.add_child(parent, tokens[matched:usable])
                node.device = device_indices[matched:usable].clone()
                new.append(node)
            if self.write_policy == "write_through":
                for node in path + new:
                    self._backup(node)
        self._stats.add(inserted_tokens=usable - matched)
        return already

    # -- lifecycle -----------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait until every queued load, storage write and prefetch has finished."""
        for worker in (self._loader, self._writer, self._prefetcher):
            if worker is not None:
                worker.join_queue()

    def stats(self) -> dict:
        with self._lock:
            tiers = {"device_tokens": sum(len(n.key) for n in self.tree.nodes() if n.device is not None),
                     "host_tokens": sum(len(n.key) for n in self.tree.nodes() if n.host is not None)}
        queues = {w.name: w.depth() for w in (self._loader, self._writer, self._prefetcher) if w is not None}
        out = {**self._stats.snapshot(), **tiers, "queue_depths": queues}
        if self.storage is not None:
            out["storage"] = self.storage.stats()
        return out

    def close(self) -> None:
        """Finish queued work and join every thread."""
        for worker in (self._loader, self._writer, self._prefetcher):
            if worker is not None:
                worker.close()

    def __enter__(self) -> "HierarchicalCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
