"""Moving pages down and up the hierarchy: device -> host -> storage backups, and
storage -> host prefetches. A mixin of ``HierarchicalCache``: every method here runs
with, or takes, the cache's lock and uses its tree, pools and workers."""

from __future__ import annotations

from typing import Sequence

import torch

from ..storage.keys import extend_keys
from .handles import MatchResult, PrefetchHandle
from .radix import Node

PREFETCH_CHUNK_PAGES = 8


class TierMoves:
    def _backup(self, node: Node) -> bool:
        """Copy a device node to the host (now) and queue it for storage; lock held."""
        if node.host is not None or node.device is None:
            self._store(node)
            return node.host is not None
        host = self._alloc_host(len(node.key))
        if host is None:
            return False
        self.host_pool.backup_from_device_all_layer(self.device_pool, host, node.device, self.io_backend)
        node.host = host
        self._stats.add(backed_up_tokens=len(node.key))
        self._store(node)
        return True

    def _store(self, node: Node) -> None:
        if self._writer is None or node.stored or node.host is None:
            return
        keys = self._store_keys(node, self._salt_of(node))
        host = node.host
        node.stored = True  # claimed: written once, by this job
        self.tree.lock(node, +1)

        def job():
            ok = self.storage.batch_set(keys, self.host_pool, host)
            with self._lock:
                if not all(ok):
                    node.stored = False
                    self._stats.add(errors=1)
                else:
                    self._stats.add(stored_tokens=len(keys) * self.page_size)
                self.tree.lock(node, -1)

        self._writer.submit(job)

    def _store_keys(self, node: Node, salt) -> list[str]:
        """Storage keys of ``node``'s pages (computed once), chained from its parent's;
        ``salt`` is that of ``node``'s tree."""
        if node.store_keys is None:
            parent_key = self._last_store_key(node.parent, salt)
            node.store_keys = extend_keys(parent_key, node.key, self.page_size, self.namespace, salt, self.hash)
        return node.store_keys

    def _last_store_key(self, node: Node, salt) -> str | None:
        return None if node.parent is None else self._store_keys(node, salt)[-1]

    def _salt_of(self, node: Node):
        while node.parent is not None:
            node = node.parent
        return next(salt for salt, root in self.tree.roots.items() if root is node)

    # -- storage -> host ----------------------------------------------------------------------------------
    def prefetch(self, token_ids: Sequence[int] | torch.Tensor, salt=None) -> PrefetchHandle:
        """Fetch the pages after the device/host hit of ``token_ids`` from storage to the
        host in the background; they become host hits as each chunk lands."""
        if self.storage is None:
            return PrefetchHandle(0, self.prefetch_policy, self.prefetch_timeout)
        match = self.match_prefix(token_ids, salt)
        pages = match.storage_len // self.page_size
        with self._lock:
            host = self._alloc_host(pages * self.page_size) if pages else None
            while host is None and pages:
                pages //= 2  # settle for a shorter prefix when the host is full of locked pages
                host = self._alloc_host(pages * self.page_size) if pages else None
            if pages:
                self.tree.lock(match.last_node, +1)
        handle = PrefetchHandle(pages * self.page_size, self.prefetch_policy, self.prefetch_timeout)
        if pages:
            self._prefetcher.submit(lambda: self._prefetch(handle, match, host))
        return handle

    def _prefetch(self, handle: PrefetchHandle, match: MatchResult, host: torch.Tensor) -> None:
        ps, tokens, start = self.page_size, list(match.tokens), match.cached_len
        with self._lock:
            parent_key = self._last_store_key(match.last_node, match.salt)
        keys = extend_keys(parent_key, tokens[start:start + handle.target], ps, self.namespace, match.salt, self.hash)
        done = 0
        try:
            for c in range(0, len(keys), PREFETCH_CHUNK_PAGES):
                if handle._cancel.is_set():
                    break
                chunk = keys[c:c + PREFETCH_CHUNK_PAGES]
                got = self.storage.batch_get(chunk, self.host_pool, host[c * ps:(c + len(chunk)) * ps])
                n = next((i for i, ok in enumerate(got) if not ok), len(got))
                if n:
                    if not self._adopt_host(tokens[:start + done + n * ps], host[done:done + n * ps], start + done,
                                            match.salt, chunk[:n]):
                        break
                    done += n * ps
                    handle.tokens = done
                    self._stats.add(prefetched_tokens=n * ps)
                if n < len(chunk):
                    break
        finally:
            with self._lock:
                if done < host.numel():
                    self.host_pool.free(host[done:])
                self.tree.lock(match.last_node, -1)
            handle._done.set()

    def _adopt_host(self, tokens, host_slots, start, salt, keys) -> bool:
        """Insert ``tokens[start:]`` as host-resident pages in ``host_slots`` (fetched from
        storage). False, taking nothing, when the pages before ``start`` left the tree
        meanwhile (an earlier batch of this prefetch was evicted)."""
        with self._lock:
            path, matched = self.tree.match(tokens, salt)
            if matched < start:
                return False
            if matched > start:  # someone cached part of it meanwhile: keep theirs
                self.host_pool.free(host_slots[:matched - start])
            if matched < len(tokens):
                parent = path[-1] if path else self.tree.root(salt)
                node = self.tree.add_child(parent, tokens[matched:])
                node.host = host_slots[matched - start:]
                node.stored = True
                node.store_keys = keys[(matched - start) // self.page_size:]
            return True
