"""``HierarchicalCache``: prefix matching across device, host and storage, and the
policies that move pages between them.

The cache is a facade over two parts: :class:`~kvtier.cache.state.CacheState` (the
tree, slot ownership and every tier transition; no threads, always under the lock)
and :class:`~kvtier.cache.mover.Mover` (the worker threads and the storage). Every
public method checks its arguments before any state moves.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Sequence

import numpy as np
import torch

from .._checks import is_int, non_negative_int, positive_number
from ..errors import CacheClosedError, UsageError
from ..pools import DeviceKVPool, HostKVPool, HybridDevicePool, HybridHostPool
from ..pools.indices import first_flagged, page_numbers
from ..spec import KVSpec
from ..storage.groups import GroupedStorage
from ..storage.keys import extend_keys
from ..transfer import check_io_backend
from .guard import StorageGuard
from .handles import Acquired, Committed, Lease, LoadHandle, MatchResult, PrefetchHandle
from .mover import Mover
from .protocols import DeviceAllocator, Storage
from .sides import Sides
from .state import CacheState
from .stats import CacheStats
from .tokens import canonical_salt, token_array

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
SELECTIVE_HITS = 2  # write_through_selective backs a page up on its second hit
_STALLED_ROUNDS = 1  # eviction that waited for backups gives up after this many rounds freeing nothing


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"unknown {what} {value!r}; supported: {', '.join(choices)}")


def _checks_on(check: bool | None) -> bool:
    """``check``, or when it is ``None`` whether ``KVTIER_CHECK=1`` is set (read once, here)."""
    if check is None:
        return os.environ.get("KVTIER_CHECK") == "1"
    if not isinstance(check, bool):
        raise UsageError(f"check must be a bool or None, got {check!r}")
    return check


def _hybrid_pools(device_pool, host_pool, page_size: int, retention_interval):
    """``(device pool, host pool, sides)`` the cache state runs on: for a hybrid spec
    the first full group's pools (every full group shares their slots) and the
    sliding groups; a uniform one's single pools and ``None``."""
    if not isinstance(device_pool, HybridDevicePool) or not isinstance(host_pool, HybridHostPool):
        raise UsageError("a hybrid cache takes a HybridDevicePool and a HybridHostPool, got "
                         f"{type(device_pool).__name__} and {type(host_pool).__name__}")
    spec = device_pool.spec
    if spec != host_pool.spec:
        raise UsageError(f"device pool ({spec.fingerprint()}) and host pool ({host_pool.spec.fingerprint()}) differ")
    full = [g.name for g in spec.groups if g.attention.is_full]
    if spec.is_uniform:
        return device_pool[full[0]], host_pool[full[0]], None
    for what, pools in (("device", device_pool), ("host", host_pool)):
        sizes = {name: pools[name].size for name in full}
        if len(set(sizes.values())) > 1:
            raise UsageError(f"the full groups share the cache's {what} slots, so their {what} pools need one size; "
                             f"got {sizes}")
    if retention_interval is not None and (not is_int(retention_interval) or retention_interval <= 0
                                           or retention_interval % page_size):
        raise UsageError(f"retention_interval must be a positive multiple of page_size {page_size} or None, "
                         f"got {retention_interval!r}")
    sides = Sides(spec, device_pool, host_pool, page_size, retention_interval)
    if not full:  # all sliding: the tree's pages hold no KV of their own, only placeholder slots
        device = DeviceKVPool(_PLACEHOLDER, _placeholder_size(device_pool, page_size), page_size, device="meta")
        host = HostKVPool(_PLACEHOLDER, _placeholder_size(host_pool, page_size), page_size, device="meta")
        return device, host, sides
    return device_pool[full[0]], host_pool[full[0]], sides


#: An all-sliding model's cache holds its tree's tokens in shape-only pools of this
#: spec (no memory), ``ALL_SLIDING_TOKENS_PER_SLOT`` tokens per slot of its largest
#: sliding pool: a window of ``W`` tokens is what makes a prefix resumable, and a
#: prefix is usually several windows long.
_PLACEHOLDER = KVSpec.k_only(1, 1, 1, dtype=torch.float16)
ALL_SLIDING_TOKENS_PER_SLOT = 8


def _placeholder_size(pools, page_size: int) -> int:
    biggest = max(pool.size for _, pool in pools)
    return max(page_size, biggest * ALL_SLIDING_TOKENS_PER_SLOT // page_size * page_size)


#: the public methods that change state: with checks on, each is checked after it returns
_CHECKED: list[str] = []


def _checked(method):
    """Mark a public method that changes state (the method itself is unchanged)."""
    _CHECKED.append(method.__name__)
    return method


def _checking(cache: "HierarchicalCache", bound):
    """``bound`` followed by the cache's invariant check, for a call that returns."""
    @functools.wraps(bound)
    def call(*args, **kwargs):
        out = bound(*args, **kwargs)
        cache._check_now()
        return out
    return call



def _check_allocated(pool, pages: np.ndarray, page_size: int, whose: str = "") -> None:
    """``UsageError`` unless every page of ``pages`` (int64 numpy) is allocated in ``pool``:
    a slot the caller frees twice is the caller's mistake, not a broken invariant."""
    free = pool.first_unallocated(pages)
    if free >= 0:
        slot = int(pages[free]) * page_size
        raise UsageError(f"free_device: {whose}slot {slot} is not allocated (freed already?); only free slots you own")


_NOTHING_HELD = contextlib.nullcontext([])  # _placeholders_back without placeholders (empty, never filled)


class HierarchicalCache:
    """Prefix cache over a device pool (L1), a host pool (L2) and optional storage (L3).

    Thread-safe: one lock guards the tree and the allocators; loads, backups,
    storage writes and prefetches run on worker threads outside it
    (``synchronous=True`` runs them on the calling thread instead: no overlap,
    but replays that do not depend on thread timing, as ``kvtier simulate`` needs).

    Token ids (every ``token_ids`` argument): a 1-D sequence of ints, a 1-D integer
    tensor or numpy array, or a ``(1, n)`` one; anything else is a ``ValueError``.
    A tenant ``salt`` is ``None``, ``str`` or ``bytes``, compared as bytes
    (``None`` == ``""`` == ``b""``). After :meth:`close`, every call raises
    :class:`CacheClosedError`.

    Hybrid models (a :class:`~kvtier.hybrid.HybridSpec` with sliding-window groups,
    docs/hybrid.md): pass a :class:`HybridDevicePool` and a :class:`HybridHostPool`. The
    full groups share every slot this API names (``device_indices``, ``alloc_device``;
    for a model with no full group these are placeholders holding no KV, and
    ``commit``/``insert`` take ``None`` for them);
    each sliding group has its own, passed and returned per group (``groups=``), a
    page of ``-1`` where a group holds nothing. A prefix is a hit only when the full
    groups hold all of it and every sliding group its window; sliding pages in no
    resume point's window (the end of each committed sequence, every
    ``retention_interval`` tokens, branch points) are freed when they are committed
    and never reach the host or storage.

    Debug checks: with ``check=True``, or by default when the environment variable
    ``KVTIER_CHECK=1`` is set at construction, every public call that changes state
    (match_prefix, acquire/release/commit, lock/unlock, insert, allocation, eviction,
    load_back, prefetch, flush) runs :meth:`check_integrity` before it returns and
    raises :class:`~kvtier.errors.IntegrityError` on a broken invariant. It walks
    the whole tree: for tests and debugging, not for serving. Work finishing on the
    worker threads is checked by the next such call.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, storage: Storage | None = None, *,
                 write_policy: str = "write_through", prefetch_policy: str = "best_effort",
                 namespace: str | None = None, prefetch_timeout: float = 1.0, storage_timeout: float = 5.0,
                 io_backend: str = "direct", allocator: DeviceAllocator | None = None, hash: str = "sha256",
                 synchronous: bool = False, check: bool | None = None,
                 retention_interval: int | None = None) -> None:
        _check_choice("write_policy", write_policy, WRITE_POLICIES)
        _check_choice("prefetch_policy", prefetch_policy, PREFETCH_POLICIES)
        check_io_backend(io_backend)
        sides, user_device, user_host = None, device_pool, host_pool
        if isinstance(device_pool, HybridDevicePool) or isinstance(host_pool, HybridHostPool):
            device_pool, host_pool, sides = _hybrid_pools(device_pool, host_pool, host_pool.page_size,
                                                          retention_interval)
        elif retention_interval is not None:
            raise UsageError("retention_interval keeps sliding-window pages: it needs hybrid pools "
                             "(HybridDevicePool, HybridHostPool)")
        if not isinstance(device_pool, DeviceKVPool) or not isinstance(host_pool, HostKVPool):
            raise UsageError("device_pool must be a DeviceKVPool and host_pool a HostKVPool")
        if device_pool.spec != host_pool.spec or device_pool.page_size != host_pool.page_size:
            raise UsageError(f"device pool ({device_pool.spec.fingerprint()}, page_size {device_pool.page_size}) "
                             f"and host pool ({host_pool.spec.fingerprint()}, page_size {host_pool.page_size}) differ")
        if storage is not None and not isinstance(storage, Storage):
            raise UsageError(f"storage must implement batch_exists/batch_get/batch_set/stats, got {type(storage)}")
        if storage is not None and (not isinstance(namespace, str) or not namespace):
            raise UsageError("a cache with storage needs namespace=: a name for the model whose KV it stores (name or "
                             "path, revision, dtype — e.g. kvtier.integrations.identity.model_namespace(...)), so that "
                             f"no other model reads these pages; got {namespace!r}")
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise UsageError(f"namespace must be a non-empty str, got {namespace!r}")
        if allocator is not None and not isinstance(allocator, DeviceAllocator):
            raise UsageError(f"allocator must implement alloc/free/available_size, got {type(allocator)}")
        for what, t in (("prefetch_timeout", prefetch_timeout), ("storage_timeout", storage_timeout)):
            positive_number(what, t)
        self.device_pool, self.host_pool, self.storage = user_device, user_host, storage
        self._device, self._sides = device_pool, sides
        self._layer_num = user_device.spec.layer_num  # the model's layers (a hybrid load goes over every group)
        self.retention_interval = retention_interval
        self.allocator = allocator or device_pool
        self.page_size = host_pool.page_size
        self.write_policy, self.prefetch_policy = write_policy, prefetch_policy
        self._selective = write_policy == "write_through_selective"
        self.prefetch_timeout, self.storage_timeout, self.io_backend = prefetch_timeout, storage_timeout, io_backend
        self.namespace, self.hash = namespace, hash
        bpt = device_pool.spec.bytes_per_token if sides is None else user_device.spec.full_bytes_per_token
        self._stats = CacheStats(bpt)
        self._state = CacheState(device_pool, host_pool, self.allocator, write_policy=write_policy,
                                 stats=self._stats, namespace=namespace, hash=hash, has_storage=storage is not None,
                                 sides=sides)
        guard = StorageGuard(storage, self._stats, storage_timeout, synchronous) if storage is not None else None
        grouped = GroupedStorage(storage, user_device.spec, self.page_size) \
            if sides is not None and storage is not None else None
        self._mover = Mover(self._state, guard, io_backend=io_backend, synchronous=synchronous,
                            layer_num=self._layer_num, grouped=grouped)
        self._lock = self._state.lock
        self._check = _checks_on(check)
        if self._check:
            # NOTE: the checked methods are wrapped per instance, only when checks are on: a
            # wrapper on the class read the flag in every call, 0.7 us of a full hit's 19
            for name in _CHECKED:
                setattr(self, name, _checking(self, getattr(self, name)))
        self._closed = False

    @property
    def tree(self):
        """The radix tree, for inspection and tests (it changes under other threads)."""
        return self._state.tree

    # -- matching ----------------------------------------------------------------------------------------
    @_checked
    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor, salt=None) -> MatchResult:
        """The longest cached prefix of ``token_ids`` (whole pages), tier by tier.
        Counts as one request in the statistics and the pages' hit counts."""
        # NOTE: canonical_salt's and _check_open's common cases in place, without their
        # calls (0.2 us, a full hit's 1.5%)
        tokens, salt = token_array(token_ids), b"" if salt is None else canonical_salt(salt)
        if self._closed:
            self._check_open()
        # NOTE: the steps a uniform spec without storage skips are tested here, not called:
        # a call that returns at once costs 60-80 ns, a full hit's 10.8 us had eight
        hybrid, stored = self._sides is not None, self.storage is not None
        probe = [] if hybrid else None
        with self._lock:
            if self._selective:  # the slots once the hit's backups are made (the path locked meanwhile)
                path, device_len, host_len = self._state.match(tokens, salt, probe)
                self._hit(path)
                device = self._state.device_slots(path, device_len)
            else:
                path, device_len, host_len, device = self._state.match_slots(tokens, salt, probe)
            parent_key = self._parent_key(path) if stored else None
            last = path[-1] if path else self._state.tree.root(salt)
            groups = self._groups(path, device_len, probe) if hybrid else None
            asked = self._probe_keys(tokens, probe, salt) if hybrid and stored else None
            if not stored:  # the counts are written with the lock held (CacheStats)
                self._stats.matched(device_len, host_len, 0)
        storage_len = 0
        if stored:
            storage_len = self._storage_hit(tokens, device_len + host_len, parent_key, salt, asked)[0]
            with self._lock:
                self._stats.matched(device_len, host_len, storage_len)
        return MatchResult.made(device, device_len, host_len, storage_len, last, tuple(path), tokens, salt, groups)

    def peek(self, token_ids: Sequence[int] | torch.Tensor, salt=None) -> MatchResult:
        """The lengths :meth:`match_prefix` would return now (storage probed the same
        way), changing nothing: no node split, no LRU stamp, no hit count, no
        statistic, no selective backup. A storage fault during the probe is still
        counted as an error. The result is marked ``peeked``: :meth:`lock` and
        :meth:`load_back` refuse it (its last node may be matched only in part);
        ``last_node`` is ``None`` when the tenant has no tree yet."""
        tokens, salt = token_array(token_ids), canonical_salt(salt)
        self._check_open()
        probe = [] if self._sides is not None else None
        with self._lock:
            path, device_len, host_len, used = self._state.peek(tokens, salt, probe)
            parent_key = self._parent_key(path, used)
            device = self._state.device_slots(path, device_len)  # a last node on the device may have more
            last = path[-1] if path else self._state.tree.roots.get(salt)  # no new root for a new tenant
            groups = self._groups(path, device_len)
            asked = self._probe_keys(tokens, probe, salt)
        storage_len = self._storage_hit(tokens, device_len + host_len, parent_key, salt, asked)[0]
        return MatchResult(device, device_len, host_len, storage_len, last, tuple(path), tokens, salt, peeked=True,
                           groups=groups)

    def _ends(self, path, salt: bytes):
        """``(device slots, last node)`` of a matched path (lock held)."""
        return self._state.device_slots(path), (path[-1] if path else self._state.tree.root(salt))

    def _groups(self, path, device_len: int, probe: list | None = None) -> dict | None:
        """Hybrid: the sliding groups' slots of the device hit (lock held); ``probe``: the
        match's, just made (its windows, where found whole on the device, are reused)."""
        if self._sides is None:
            return None
        return self._state.side_slots(path, device_len, probe[0] if probe else None)

    def _hit(self, path) -> None:
        """One request's reuse of ``path`` (lock held): hit counts, selective backups.
        The path is locked meanwhile: a backup's host space may be made by evicting, and
        an eviction that split a node of the path would leave the caller's list without
        its upper piece (the slots read from it then shifted)."""
        if not self._selective or not path:
            return  # hits only decide selective backups
        self._state.lock_node(path[-1])
        try:
            for node in path:
                node.hits += 1
                if node.hits >= SELECTIVE_HITS:
                    self._state.begin_backup(node)
        finally:
            self._state.unlock_node(path[-1])

    def _parent_key(self, path, used: int | None = None) -> str | None:
        """The storage key of the last matched page: the last of ``path[-1]``, or with
        ``used`` the last of its first ``used`` tokens."""
        if self.storage is None or not path:
            return None
        keys = self._state.store_keys(path[-1])
        return keys[-1] if used is None else keys[used // self.page_size - 1]

    def _storage_hit(self, tokens, resident: int, parent_key, salt: bytes, asked=None) -> tuple[int, tuple | None]:
        """``(storage_len, fetch)``: tokens storage adds after the ``resident`` ones
        and, hybrid, what a prefetch of them takes (``_storage_groups``)."""
        if self.storage is None:
            return 0, None
        if self._sides is not None:
            return self._storage_groups(asked, resident)
        usable = len(tokens) - len(tokens) % self.page_size
        if usable <= resident:
            return 0, None
        keys = extend_keys(parent_key, tokens[resident:usable], self.page_size, self.namespace, salt, self.hash)
        return self._mover.guard.exists(keys) * self.page_size, None

    def _probe_keys(self, tokens, probe, salt: bytes):
        """Hybrid, lock held: what the storage lookup after a match needs, or ``None``
        when storage cannot add to it: ``(every page key of the prompt, the node at
        the end of the resident full pages, their count, pages held per group)``."""
        if self.storage is None or self._sides is None:
            return None
        found, ps = probe[0], self.page_size
        usable = len(tokens) // ps
        if usable <= found.pages:
            return None
        state = self._state
        # NOTE: a match split the tree where the resident pages end; a peek did not, and its
        # last node may go on past them (and past where the prompt leaves it): cut there
        nodes, _, _ = state.tree.walk(tokens[:found.pages * ps], salt)
        keys = [k for node in nodes for k in state.store_keys(node)][:found.pages]
        parent = keys[-1] if keys else None
        keys += extend_keys(parent, tokens[found.pages * ps:usable * ps], ps, self.namespace, salt, self.hash)
        last = nodes[-1] if nodes else state.tree.root(salt)
        return keys, last, found.pages, found.held

    def _storage_groups(self, asked, resident: int) -> tuple[int, tuple | None]:
        """Hybrid: the storage hit after ``resident`` resumable tokens, as
        :meth:`GroupedStorage.reusable` finds it with what the tiers hold. It counts
        only when the window it ends with lies in storage or resident pages, and
        beyond the resident full pages (what a prefetch brings):
        ``(tokens, (keys, last node, first page, pages, target tokens))``."""
        if asked is None:
            return 0, None
        keys, last, pages, held = asked
        full = {name: [True] * pages for name in self._sides.full}
        total = self._mover.guard.reusable(self._mover.grouped, keys, {**full, **{g: h.tolist()
                                                                                 for g, h in held.items()}})
        ps = self.page_size
        if total <= pages or total * ps <= resident:
            return 0, None
        for g in self._sides.names:
            window = self._sides.window_pages(g, total * ps)
            if window.start < pages and not held[g][window.start:pages].all():
                return 0, None  # the window reaches below the resident full pages, into a hole
        return total * ps - resident, (keys, last, pages, total - pages, total * ps)

    # -- locking -----------------------------------------------------------------------------------------------
    @_checked
    def lock(self, match: MatchResult) -> Lease:
        """Keep the matched pages from eviction until :meth:`unlock` of the returned
        lease. Each call takes a lock of its own (and returns its own lease)."""
        self._check_match(match)
        with self._lock:
            lease = Lease(match.last_node, self._state)
            self._state.lock_node(lease.node)
        return lease

    @_checked
    def unlock(self, lease: Lease) -> None:
        """Release the lock :meth:`lock` returned ``lease`` for, exactly once; a lease
        already released, one from another cache, or anything else is a
        ``ValueError`` and changes nothing."""
        self._check_open()
        if isinstance(lease, MatchResult):
            raise UsageError("unlock takes the Lease that lock(match) returned, not the MatchResult")
        if not isinstance(lease, Lease):
            raise UsageError(f"unlock takes the Lease that lock(match) returned, got {type(lease).__name__}")
        with self._lock:
            self._end_lease(lease, "unlock", "lease")

    @contextlib.contextmanager
    def locked(self, match: MatchResult):
        """``with cache.locked(match): ...``: locked for the block, which gets ``match``."""
        lease = self.lock(match)
        try:
            yield match
        finally:
            self.unlock(lease)

    def _end_lease(self, lease: Lease, call: str, what: str) -> None:
        """Release ``lease`` (lock held), checked first: ``what`` names its holder."""
        if lease.owner is not self._state:
            raise UsageError(f"{call}: this {what} comes from another cache")
        if lease.released:
            raise UsageError(f"{call}: this {what} was already released (by unlock, release or commit)")
        self._state.unlock_node(lease.node)
        lease.released = True

    def _check_match(self, match) -> None:
        self._check_open()
        if not isinstance(match, MatchResult):
            raise UsageError(f"expected a MatchResult from match_prefix, got {type(match).__name__}")
        if match.peeked:
            raise UsageError("a peek() result cannot be locked or loaded (it may end inside a node); "
                             "use match_prefix")
        if not self._owns(match.last_node, match.salt):
            raise UsageError("this MatchResult comes from another cache")

    def _owns(self, node, salt: bytes) -> bool:
        """Whether ``node`` hangs (or hung) below this cache's root for ``salt``."""
        while node.parent is not None:
            node = node.parent
        return self._state.tree.roots.get(salt) is node

    # -- one request's prefix, from whichever tier holds it -----------------------------------------------------
    @_checked
    def acquire(self, token_ids: Sequence[int] | torch.Tensor, salt=None, wait: bool = True) -> Acquired:
        """Match ``token_ids``, prefetch a storage hit to the host (per ``prefetch_policy``),
        lock the prefix and load its host part to the device: the usual start of a
        request, counted once. With ``wait`` the load is finished on return (if it
        failed, the result reuses nothing); otherwise wait on ``acquired.load`` layer
        by layer and check its ``error``. :meth:`release` (or :meth:`commit`)
        consumes the result exactly once."""
        tokens, salt = token_array(token_ids), canonical_salt(salt)
        self._check_open()
        state = self._state
        probe = [] if self._sides is not None else None
        with self._lock:
            path, device_len, host_len = state.match(tokens, salt, probe)
            parent_key = self._parent_key(path)
            first = path[-1] if path else state.tree.root(salt)
            state.lock_node(first)  # until the final lock: nothing of the hit is evicted meanwhile
            asked = self._probe_keys(tokens, probe, salt)
        try:
            storage_len, fetch = self._storage_hit(tokens, device_len + host_len, parent_key, salt, asked)
            fetched = 0
            if storage_len and fetch is not None:  # hybrid: the full pages and the window it ends with
                fetched = self._prefetch_groups(tokens, salt, fetch).wait()
            elif storage_len:  # storage -> host, then it is a host hit like any other
                fetched = self._mover.prefetch(tokens, salt, first, device_len + host_len,
                                               storage_len // self.page_size, parent_key, self.prefetch_policy,
                                               self._prefetch_wait).wait()
            # device slots for the host part, allocated as alloc_device does (it may wait for write-backs)
            reserved = self._alloc(host_len + fetched) if host_len + fetched else None
            with self._lock:
                # NOTE: other requests may have changed the tree since the first match: the
                # result's fields all come from this one (device_indices has device_len entries);
                # the per-tier counts below keep where the first match found each page
                path, now_device, now_host = state.match(tokens, salt)
                self._hit(path)
                device, last = self._ends(path, salt)
                lease = Lease(last, state)
                state.lock_node(last)
                load, _ = state.begin_load(path, self._layer_num, reserved, now_device)
                # hybrid: the device hit's windows (the load's own when it adds nothing)
                groups = load.groups if len(load) == now_device else self._groups(path, now_device)
        finally:
            with self._lock:
                state.unlock_node(first)
        now_storage = max(0, device_len + host_len + storage_len - now_device - now_host)
        match = MatchResult(device[:now_device], now_device, now_host, now_storage, last, tuple(path), tokens, salt,
                            groups=groups)
        if wait:
            load.wait()
            if load.error is not None:  # the failed pages are host-only again: this request recomputes
                with self._lock:
                    state.unlock_node(lease.node)
                    lease = Lease(state.tree.root(salt), state)
                    state.lock_node(lease.node)
                    self._stats.matched(0, 0, 0)
                empty = LoadHandle(state.device_slots([]), self._layer_num,
                                   groups=None if self._sides is None else state.side_slots([], 0), finished=True)
                return Acquired(match, empty, 0, 0, 0, lease)
        reused = len(load)
        device_hit = min(device_len, reused)
        host_hit = min(host_len, reused - device_hit)
        with self._lock:
            self._stats.matched(device_hit, host_hit, reused - device_hit - host_hit)
        return Acquired(match, load, device_hit, host_hit, reused - device_hit - host_hit, lease)

    @_checked
    def release(self, acquired: Acquired) -> None:
        """Unlock what :meth:`acquire` locked; a second release is a ``ValueError``."""
        self._check_open()
        if not isinstance(acquired, Acquired) or acquired.lease is None:
            raise UsageError(f"release takes the Acquired from acquire, got {type(acquired).__name__}")
        with self._lock:
            self._release(acquired)

    def _release(self, acquired: Acquired) -> None:
        self._end_lease(acquired.lease, "release", "Acquired")

    @_checked
    def commit(self, acquired: Acquired, token_ids: Sequence[int] | torch.Tensor, slots: torch.Tensor,
               groups: dict | None = None, resume_at: Sequence[int] = ()) -> Committed:
        """Cache what the forward computed and move the request's lock onto it.

        ``token_ids`` starts with the acquired prefix; ``slots`` are the device slots
        (from :meth:`alloc_device`) holding the KV of its full pages after that
        prefix: ``len(slots) == full - len(acquired.device_indices)``, ``full`` being
        ``len(token_ids)`` rounded down to whole pages. The cache owns ``slots``
        afterwards: pages another request cached first are freed as duplicates.
        ``acquired`` is consumed; the result's ``acquired`` is the new lease
        (release it when the request ends); wait on its ``load`` before reading
        pages that another request cached first, and check its ``error``.

        Hybrid specs: ``groups`` maps sliding groups to their device slots of the same
        tokens as ``slots`` (from ``alloc_device(n, group=...)``; a page of ``-1``
        where the engine kept nothing). The cache keeps the pages some resume
        point's window needs and frees the others; the lease covers the whole
        sequence, and the result's ``groups`` hold the window before its end.
        ``resume_at``: more points a later request will resume from (token counts,
        whole pages, at most the sequence's), e.g. where this prompt's own reuse would
        stop, so that the same prompt sent again is a hit."""
        self._check_open()
        if not isinstance(acquired, Acquired) or acquired.lease is None:
            raise UsageError(f"commit takes the Acquired from acquire, got {type(acquired).__name__}")
        # NOTE: the KV given was computed over the acquired prefix: a load still in flight
        # (an engine that did not wait on every layer) is settled first, so a load that
        # fails is refused here, and no KV computed over what never arrived is cached
        acquired.load.wait()
        if acquired.load.error is not None:
            raise UsageError(f"commit: the acquired prefix failed to load ({acquired.load.error!r}); release it")
        tokens, ps = token_array(token_ids), self.page_size
        prefix = acquired.device_indices
        reused, full = prefix.numel(), len(tokens) - len(tokens) % ps
        if full < reused or tokens[:reused] != acquired.match.tokens[:reused]:
            raise UsageError(f"commit: token_ids ({len(tokens)} tokens) do not start with the acquired "
                             f"{reused}-token prefix")
        side = self._given(groups, full, reused, "commit")
        resume_at = self._resume_points(resume_at, full, "commit")
        placeholders = slots is None and self._sides is not None and not self._sides.full
        if placeholders:
            slots = self._placeholders(full - reused, "commit")
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.numel() != full - reused:
            got = tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
            raise UsageError(f"commit: slots must be a 1-D tensor of {full - reused} slots (the full pages of "
                             f"{len(tokens)} tokens after the {reused}-token prefix), got {got}")
        all_slots = torch.cat([prefix, slots.to(prefix.device)])
        salt, state = acquired.match.salt, self._state
        # NOTE: the slots are checked out of the lock: other requests need not wait for it
        with self._placeholders_back(slots if placeholders else None) as held:
            pages = self._check_slots(all_slots)
            with self._lock:
                if acquired.lease.owner is not state:
                    raise UsageError("commit: this Acquired comes from another cache")
                if acquired.lease.released:
                    raise UsageError("commit: this Acquired was already released (or committed)")
                del tokens[full:]  # our own copy: whole pages only, without copying again
                walked = state.check_insert(tokens, pages, salt)
                owned = state.check_sides(side, walked) if side is not None else frozenset()
                already, new = state.insert(tokens, pages, salt, walked, side, resume_at, owned)
                self._stats.inserted(new)
                held.clear()  # the tree's now
                if already > reused:  # another request cached these pages first: ours are duplicates
                    state.allocator.free(all_slots[reused:already])
                path = state.match_all(tokens, salt)  # the whole sequence: the engine goes on using its slots
                lease = Lease(path[-1] if path else state.tree.root(salt), state)
                state.lock_node(lease.node)
                self._release(acquired)
                device = state.device_slots(path)
                groups = self._groups(path, full)
                # pages another request cached first may still be arriving from its host copy
                depends = {id(n.loading): n.loading.handle for n in path if n.loading is not None}
        load = LoadHandle(device, self._layer_num, tuple(depends.values()), groups=groups, finished=True)
        match = MatchResult(device, full, 0, 0, lease.node, tuple(path), tokens[:full], salt, groups=groups)
        renewed = Acquired(match, load, acquired.device_hit, acquired.host_hit, acquired.storage_hit, lease)
        return Committed(renewed, new, max(already - reused, 0))

    # -- host -> device -------------------------------------------------------------------------------------------
    @_checked
    def load_back(self, match: MatchResult) -> LoadHandle:
        """Bring the host hit of ``match`` to the device, layer by layer, in the background.

        The handle's ``device_indices`` cover the device hit and every host page that
        got device slots (all of them unless the device is full of locked pages).
        """
        self._check_match(match)
        with self._lock:
            path = match.last_node.path()
            cut = next((i for i, n in enumerate(path) if not n.resident), len(path))
            handle, _ = self._state.begin_load(path[:cut], self._layer_num, None, match.device_len)
        return handle

    # -- storage -> host ------------------------------------------------------------------------------------------
    @_checked
    def prefetch(self, token_ids: Sequence[int] | torch.Tensor, salt=None) -> PrefetchHandle:
        """Fetch the pages after the device/host hit of ``token_ids`` from storage to the
        host in the background; they become host hits as each chunk lands."""
        tokens, salt = token_array(token_ids), canonical_salt(salt)
        self._check_open()
        if self.storage is None:
            return PrefetchHandle(0, self.prefetch_policy, self.prefetch_timeout)
        probe = [] if self._sides is not None else None
        with self._lock:
            path, device_len, host_len = self._state.match(tokens, salt, probe)
            parent_key = self._parent_key(path)
            last = path[-1] if path else self._state.tree.root(salt)
            asked = self._probe_keys(tokens, probe, salt)
        storage_len, fetch = self._storage_hit(tokens, device_len + host_len, parent_key, salt, asked)
        if self._sides is not None:
            if not storage_len:
                return PrefetchHandle(0, self.prefetch_policy, self.prefetch_timeout)
            return self._prefetch_groups(tokens, salt, fetch)
        return self._mover.prefetch(tokens, salt, last, device_len + host_len, storage_len // self.page_size,
                                    parent_key, self.prefetch_policy, self._prefetch_wait)

    def _prefetch_groups(self, tokens, salt: bytes, fetch) -> PrefetchHandle:
        """Hybrid: start the prefetch :meth:`_storage_groups` planned (``fetch``)."""
        keys, at, pages, count, target = fetch
        return self._mover.prefetch_groups(tokens, salt, at, pages * self.page_size, count,
                                           keys[pages - 1] if pages else None, target, self.prefetch_policy,
                                           self._prefetch_wait)

    @property
    def _prefetch_wait(self) -> float:
        """How long a prefetch handle's ``wait()`` blocks at most."""
        return self.storage_timeout if self.prefetch_policy == "wait_complete" else self.prefetch_timeout

    # -- inserting ------------------------------------------------------------------------------------------------
    @_checked
    def insert(self, token_ids: Sequence[int] | torch.Tensor, device_indices: torch.Tensor, salt=None,
               groups: dict | None = None, resume_at: Sequence[int] = ()) -> int:
        """Record KV the engine computed: ``device_indices[i]`` holds token ``i``.

        Only full pages are cached. Returns how many leading tokens were already cached
        on the device. The cache owns the slots of the full pages from there on; slots in
        ``device_indices[:returned]`` that the caller allocated itself (rather than got
        from :meth:`match_prefix` / :meth:`load_back`) are duplicates for it to free.
        Every slot is checked first (range, alignment, dtype, not held by another
        cached page); a bad one is a ``ValueError`` and nothing changes. Hybrid
        specs: ``groups`` and ``resume_at`` as in :meth:`commit`, ``groups`` covering
        the same tokens as ``device_indices`` (at least its full pages).
        """
        tokens, salt = token_array(token_ids), canonical_salt(salt)
        self._check_open()
        usable = len(tokens) - len(tokens) % self.page_size
        if groups is not None and hasattr(groups, "items"):
            groups = {g: t[:usable] if isinstance(t, torch.Tensor) and t.dim() == 1 else t for g, t in groups.items()}
        side = self._given(groups, usable, 0, "insert")
        resume_at = self._resume_points(resume_at, usable, "insert")
        placeholders = device_indices is None and self._sides is not None and not self._sides.full
        if placeholders:
            device_indices = self._placeholders(usable, "insert")
        if not isinstance(device_indices, torch.Tensor) or device_indices.dim() != 1 \
                or device_indices.numel() < usable:
            n = device_indices.numel() if isinstance(device_indices, torch.Tensor) else device_indices
            raise UsageError(f"device_indices must be a 1-D tensor of at least {usable} slots (the full pages of "
                             f"{len(tokens)} tokens), got {n}")
        # NOTE: a prompt of whole pages (the usual insert) skips the slice: a torch op on
        # a fresh tensor took about 5 µs of an 8K-token insert's 50 here
        slots = device_indices if device_indices.numel() == usable else device_indices[:usable]
        del tokens[usable:]  # our own copy: whole pages only, without copying again
        with self._placeholders_back(slots if placeholders else None) as held:
            pages = self._check_slots(slots)  # out of the lock, as in commit
            with self._lock:
                walked = self._state.check_insert(tokens, pages, salt)
                owned = self._state.check_sides(side, walked) if side is not None else frozenset()
                already, new = self._state.insert(tokens, pages, salt, walked, side, resume_at, owned)
                self._stats.inserted(new)
                held.clear()  # the tree's now
        return already

    def _resume_points(self, points, tokens: int, what: str) -> tuple[int, ...]:
        """``points`` checked: ints, whole pages, within ``tokens``; only hybrid caches
        keep windows, so a uniform one ignores them (every prefix resumes)."""
        if type(points) is tuple and not points:  # the default: nothing to check
            return points
        points = tuple(points)
        bad = [p for p in points if not is_int(p) or not 0 < p <= tokens or p % self.page_size]
        if bad:
            raise UsageError(f"{what}: resume_at holds {bad[:4]}, not whole-page token counts in (0, {tokens}]")
        return points if self._sides is not None else ()

    def _placeholders_back(self, slots: torch.Tensor | None):
        """A context that frees ``slots`` (placeholders just allocated) if its block raises
        before the tree takes them (the block then empties the list it is given): a call
        refused after allocating them leaves the pool as it found it. Without slots, a
        context that does nothing (a third of the generator's microsecond per insert)."""
        return _NOTHING_HELD if slots is None else self._freed_on_raise(slots)

    @contextlib.contextmanager
    def _freed_on_raise(self, slots: torch.Tensor):
        held = [slots]
        try:
            yield held
        except BaseException:
            if held:
                with self._lock:
                    self.allocator.free(held[0])
            raise

    def _placeholders(self, n: int, what: str) -> torch.Tensor:
        """An all-sliding cache's own slots for ``n`` tokens of the tree (no KV in them)."""
        slots = self._alloc(n)
        if slots is None:
            raise UsageError(f"{what}: no room for {n} more tokens in the tree (every cached page is locked)")
        return slots

    def _given(self, groups, tokens: int, skip: int, what: str) -> dict | None:
        """Hybrid: the engine's sliding pages for ``tokens`` tokens, checked, the first
        ``skip`` (the cache's own prefix) none; ``ValueError`` for groups on a
        uniform cache."""
        if self._sides is None:
            if groups is not None:
                raise UsageError(f"{what}: groups= is for hybrid (sliding-window) specs; this cache is uniform")
            return None
        given = self._sides.check_given(groups, tokens - skip, what)
        return {g: self._sides.after_holes(skip // self.page_size, pages) for g, pages in given.items()}

    def _check_slots(self, slots: torch.Tensor):
        """The page numbers (numpy) of ``slots``; ``ValueError`` unless they are whole,
        distinct pages of this device pool."""
        return page_numbers(slots, page_size=self.page_size, size=self._device.size, what="device_indices",
                            allowed_devices=(self._device.index_device,), unique=True)

    # -- allocation and eviction -----------------------------------------------------------------------------------
    @_checked
    def alloc_device(self, num_tokens: int, group: str | None = None) -> torch.Tensor | None:
        """Device slots for new KV (whole pages), evicting unlocked cached pages (LRU)
        as needed; ``None`` if even that leaves too few. Hybrid specs: ``group``
        names a sliding group for slots of its pool (the full groups share the
        slots of ``group=None``)."""
        non_negative_int("alloc_device", num_tokens)
        self._check_open()
        if group is not None:
            self._check_group("alloc_device", group)
            with self._lock:
                slots = self._state.alloc("device", num_tokens, group)
        else:
            slots = self._alloc(num_tokens)
        if slots is None:
            self._stats.add(device_alloc_failures=1)
        return slots

    def _alloc(self, num_tokens: int) -> torch.Tensor | None:
        stalled = 0
        while True:
            with self._lock:
                before = self.allocator.available_size()
                slots = self._state.alloc("device", num_tokens)
                progress = self.allocator.available_size() > before
                pending = list(self._state.backups)
            stalled = 0 if progress else stalled + 1
            if slots is not None or not pending or stalled > _STALLED_ROUNDS:
                return slots
            self._wait(pending)  # write-back: the pages go once their host copies land

    @_checked
    def free_device(self, indices: torch.Tensor, group: str | None = None) -> None:
        """Return slots the caller owns (e.g. duplicates reported by :meth:`insert`);
        ``ValueError`` for slots a cached page holds. ``group``: a sliding group's
        slots (hybrid specs)."""
        self._check_open()
        if group is not None:
            self._check_group("free_device", group)
            pool = self._sides.device[group]
            pages = page_numbers(indices, page_size=self.page_size, size=pool.size, what="free_device indices",
                                 allowed_devices=(pool.index_device,), unique=True)
            with self._lock:
                held = first_flagged(self._sides.owned[group], pages, 0, True)
                if held >= 0:
                    raise UsageError(f"free_device: slot {int(pages[held]) * self.page_size} of group {group!r} "
                                     "holds a cached page; only free slots you own")
                _check_allocated(pool, pages, self.page_size, f"group {group!r}'s ")
                pool.free(indices)
            return
        pages = self._check_slots(indices)
        with self._lock:
            owned = self._state.first_owned(pages)  # the pages the slot check made, not made again
            if owned >= 0:
                slot = int(pages[owned]) * self.page_size
                raise UsageError(f"free_device: slot {slot} holds a cached page; only free slots you own")
            if self.allocator is self.device_pool:  # an engine's own allocator judges its slots itself
                _check_allocated(self.device_pool, pages, self.page_size)
            self.allocator.free(indices)

    @_checked
    def _check_group(self, call: str, group) -> None:
        names = () if self._sides is None else self._sides.names
        if group not in names:
            full = "" if self._sides is None else f"; the full groups {list(self._sides.full)} share group=None's"
            raise UsageError(f"{call}: group={group!r} is not a sliding group of this cache "
                             f"(sliding groups: {list(names)}){full}")

    @_checked
    def evict_device(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots (least recently used first, whole
        pages) if unlocked pages allow; a page with a host copy is demoted, not lost."""
        return self._evict("device", num_tokens)

    @_checked
    def evict_host(self, num_tokens: int) -> int:
        return self._evict("host", num_tokens)

    def _evict(self, tier: str, num_tokens: int) -> int:
        non_negative_int(f"evict_{tier}", num_tokens)
        self._check_open()
        freed, stalled = 0, 0
        while True:
            with self._lock:
                got = self._state.evict(tier, num_tokens - freed)
                pending = list(self._state.backups) if tier == "device" else []
            freed += got
            stalled = 0 if got else stalled + 1
            if freed >= num_tokens or not pending or stalled > _STALLED_ROUNDS:
                return freed
            # write-back: a page goes once its host copy lands, and then its parent may go
            self._wait(pending)

    def _wait(self, marks) -> None:
        for mark in marks:
            mark.done.wait(self.storage_timeout)

    # -- lifecycle -------------------------------------------------------------------------------------------------
    @_checked
    def flush(self) -> None:
        """Wait until every queued load, backup, storage write and prefetch has finished."""
        self._check_open()
        self._mover.flush()

    def stats(self) -> dict:
        self._check_open()
        with self._lock:
            counts = self._stats.snapshot()
            nodes = list(self._state.tree.nodes())
            tiers = {"device_tokens": sum(len(n.key) for n in nodes if n.device is not None),
                     "host_tokens": sum(len(n.key) for n in nodes if n.host_ready),
                     "host_fetching_tokens": self._state.fetching}  # prefetches' slots, not in the tree yet
            if self._sides is not None:  # pages held per sliding group and tier
                tiers["sliding_pages"] = {g: {t: sum(int((getattr(n, t).side[g] >= 0).sum()) for n in nodes
                                                     if getattr(n, t) is not None) for t in ("device", "host")}
                                          for g in self._sides.names}
        queues = {w.name: w.depth() for w in self._mover.workers}
        out = {**counts, **tiers, "queue_depths": queues}
        if self.storage is not None:
            try:
                out["storage"] = self.storage.stats()
            except Exception as e:  # a broken backend still lets the cache report
                out["storage"] = {"error": repr(e)}
        return out

    def memory_bytes(self) -> int:
        """Host bytes of the cache's own metadata: every tree node (the roots too) with its
        child map, token-id key and storage keys; each node's copies with their device
        page numbers, host slot tensors and (hybrid) sliding groups' page arrays, a buffer
        that the pieces of a split share counted once; the LRU heaps and their entries;
        the device-page ownership maps. Each object as ``sys.getsizeof`` reports it.
        Not counted: the KV pools and their allocators, the storage backend, the worker
        threads. It walks the whole tree under the lock: for tools and tests, not for
        every step of a serving loop."""
        self._check_open()
        with self._lock:
            return self._state.memory_bytes()

    def check_integrity(self, engine_device_slots: int | None = None) -> None:
        """Raise :class:`~kvtier.errors.IntegrityError` unless the cache's invariants
        hold (see ``CacheState.check_integrity``); ``engine_device_slots``: device
        slots the engine holds outside the cache, to check that none leaked."""
        self._check_open()
        with self._lock:
            self._state.check_integrity(engine_device_slots)

    def _check_now(self) -> None:
        """The debug check after a call (a concurrent :meth:`close` skips it)."""
        with self._lock:
            if not self._closed:
                self._state.check_integrity()

    def close(self) -> None:
        """Finish queued work and join every thread; later calls raise ``CacheClosedError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._mover.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("this HierarchicalCache is closed")

    def __enter__(self) -> "HierarchicalCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
