"""What ``HierarchicalCache`` hands back: match results, locks, and handles on
background work."""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass, field

import torch

from ..errors import CacheClosedError, LoadError  # noqa: F401 (re-exported: their home before errors.py)


@dataclass(frozen=True, init=False)
class MatchResult:
    """The cached prefix of a prompt, tier by tier (all lengths in tokens, whole pages).

    ``device_indices``: ``(device_len,)`` device slots of the device hit. Some of them
    may still be arriving from the host for another request: call
    :meth:`HierarchicalCache.load_back` and wait on its handle before reading them.
    The next ``host_len`` tokens are on the host, the ``storage_len`` after those in
    storage. Only safe to act on while locked (:meth:`HierarchicalCache.lock`).
    ``peeked``: from :meth:`HierarchicalCache.peek`, which changes nothing; such a
    result cannot be locked or loaded (its last node may be matched only in part).
    ``groups`` (hybrid specs): per sliding group, ``(device_len,)`` device slots of
    that group's pool holding the window before ``device_len``, ``-1`` elsewhere;
    the full groups all use ``device_indices``.
    """

    device_indices: torch.Tensor
    device_len: int
    host_len: int
    storage_len: int
    last_node: object = field(repr=False)   # deepest matched node (the tenant's root when none)
    path: tuple = field(repr=False, default=())
    tokens: array = field(repr=False, default=None)  # an empty array('q') when not given
    salt: bytes = field(repr=False, default=b"")
    peeked: bool = field(repr=False, default=False)
    groups: dict | None = field(repr=False, default=None)

    def __init__(self, device_indices: torch.Tensor, device_len: int, host_len: int, storage_len: int,
                 last_node: object, path: tuple = (), tokens: array | None = None, salt: bytes = b"",
                 peeked: bool = False, groups: dict | None = None) -> None:
        # NOTE: one update of the instance's dict, where a frozen dataclass's own __init__
        # calls object.__setattr__ per field: 1.5 -> 0.5 us, a tenth of a full hit's budget
        vars(self).update(device_indices=device_indices, device_len=device_len, host_len=host_len,
                          storage_len=storage_len, last_node=last_node, path=path,
                          tokens=array("q") if tokens is None else tokens, salt=salt, peeked=peeked, groups=groups)

    @classmethod
    def made(cls, device_indices: torch.Tensor, device_len: int, host_len: int, storage_len: int,
             last_node: object, path: tuple, tokens: array, salt: bytes, groups: dict | None) -> "MatchResult":
        """A result with every field given (not peeked): what ``__init__`` makes, without
        the call through the type and its defaults (0.6 -> 0.4 us, a full hit's 2%)."""
        self = object.__new__(cls)
        self.__dict__.update(device_indices=device_indices, device_len=device_len, host_len=host_len,
                             storage_len=storage_len, last_node=last_node, path=path, tokens=tokens, salt=salt,
                             peeked=False, groups=groups)
        return self

    @property
    def cached_len(self) -> int:
        """Tokens whose KV the device can have without recomputation (device + host)."""
        return self.device_len + self.host_len


class Lease:
    """One lock on a prefix (its deepest node), released exactly once: what
    :meth:`HierarchicalCache.lock` returns and :meth:`~HierarchicalCache.unlock`
    takes (an :class:`Acquired` holds one too). ``owner``: the state of the cache
    that took it."""

    __slots__ = ("node", "owner", "released")

    def __init__(self, node, owner) -> None:
        self.node, self.owner, self.released = node, owner, False

    def __repr__(self) -> str:
        return f"Lease({self.node}, {'released' if self.released else 'held'})"


#: the condition of every handle finished when made (no layer is waited for on it)
_SETTLED = threading.Condition(threading.Lock())


class LoadHandle:
    """Host -> device loading of a match's host hit, one layer at a time, in the background.

    ``device_indices`` holds the device slots of the whole prefix (the device hit, then
    the loaded pages); ``wait_layer(i)`` returns once layer ``i`` of every page in it
    has arrived or the load has failed, ``wait()`` once all layers have. After
    waiting, check :attr:`error`: when set, the KV in ``device_indices`` is not
    usable (the failed pages are back to host-only; match again).
    """

    def __init__(self, device_indices: torch.Tensor, layer_num: int, depends: tuple["LoadHandle", ...] = (),
                 groups: dict | None = None, finished: bool = False) -> None:
        self.device_indices = device_indices
        self.groups = groups  # hybrid: per sliding group, the window's slots (MatchResult.groups)
        # NOTE: a flag per layer under one condition, not an Event per layer: 48 Events took
        # 94 us to make and 24 to set, for every acquire and commit (most handles are
        # finished as soon as they are made: a device hit, a commit). Such a handle
        # (``finished``) is never waited on, and shares one condition: making its own
        # took 3.8 of a handle's 4.5 us
        self._ready = [False] * layer_num
        self._finished = finished
        self._cond = _SETTLED if finished else threading.Condition(threading.Lock())
        self._depends = depends
        self._cuda_events: list = [None] * layer_num
        self._cuda = False  # whether any layer recorded a CUDA event
        self._error: BaseException | None = None

    def __len__(self) -> int:
        return self.device_indices.numel()

    @property
    def error(self) -> BaseException | None:
        """Why this load, or one it waits on, failed; ``None`` if it did not (yet)."""
        if self._error is not None:
            return self._error
        return next((d.error for d in self._depends if d.error is not None), None)

    def _layer_done(self, layer: int) -> None:
        with self._cond:
            self._ready[layer] = True
            self._cond.notify_all()

    def _record_cuda_event(self, layer: int, stream) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        self._cuda_events[layer] = event
        self._cuda = True

    def _finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._error = error
            self._finished = True
            self._cond.notify_all()

    def _arrived(self, layer: int) -> bool:
        return self._ready[layer] or self._finished  # the index first: a bad layer raises

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` is on the device; False on timeout. On CUDA it
        returns once the copy is queued, and makes the current stream wait for it."""
        if not all(d.wait_layer(layer, timeout) for d in self._depends):
            return False
        if not self._arrived(layer):
            with self._cond:
                if not self._cond.wait_for(lambda: self._arrived(layer), timeout):
                    return False
        if self._cuda_events[layer] is not None:
            torch.cuda.current_stream().wait_event(self._cuda_events[layer])
        return True

    def wait(self, timeout: float | None = None) -> bool:
        # NOTE: a finished handle with nothing to wait on (a device hit's, a commit's) answers
        # at once: asking each layer took a third of an acquire of a 4K-token device hit
        if self._finished and not self._depends and not self._cuda:
            return True
        return all(self.wait_layer(layer, timeout) for layer in range(len(self._ready)))

    def done(self) -> bool:
        return (self._finished or all(self._ready)) and all(d.done() for d in self._depends)


class PrefetchHandle:
    """Storage -> host prefetch of the pages after a prompt's device/host hit.

    ``tokens`` counts tokens already brought to the host (and visible to
    ``match_prefix``); ``target`` is what storage said it holds. ``wait()`` applies
    the cache's stop policy: ``best_effort`` returns at once, ``wait_complete``
    blocks until done (at most ``storage_timeout`` seconds), ``timeout`` blocks at
    most ``prefetch_timeout`` seconds.
    """

    def __init__(self, target: int, policy: str, timeout: float) -> None:
        self.target = target
        self.tokens = 0
        self._policy, self._timeout = policy, timeout
        self._done = threading.Event()
        self._cancel = threading.Event()
        if target == 0:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop after the chunk in flight; pages already fetched stay cached."""
        self._cancel.set()

    def wait(self) -> int:
        """Tokens prefetched so far, after waiting as the stop policy says."""
        if self._policy != "best_effort" and not self._done.wait(self._timeout):
            self.cancel()
        return self.tokens


@dataclass(frozen=True)
class Acquired:
    """A prompt's cached prefix brought to the device for one request (locked until
    :meth:`HierarchicalCache.release`, which consumes it). ``device_indices`` holds
    its KV once ``load`` is done; the ``*_hit`` counts say which tier each reused
    token came from."""

    match: MatchResult
    load: LoadHandle
    device_hit: int
    host_hit: int
    storage_hit: int
    lease: Lease = field(repr=False, default=None)

    @property
    def device_indices(self) -> torch.Tensor:
        return self.load.device_indices

    @property
    def groups(self) -> dict | None:
        """Hybrid specs: per sliding group, the slots of the window before the reused
        prefix (``-1`` elsewhere), as :attr:`MatchResult.groups`."""
        return self.load.groups

    @property
    def released(self) -> bool:
        return self.lease is None or self.lease.released


@dataclass(frozen=True)
class Committed:
    """What :meth:`HierarchicalCache.commit` did: the request's new lease on its
    whole cached sequence (``acquired.device_indices`` are the slots now holding
    it, which may differ from the caller's where another request cached the same
    pages first), how many tokens it added to the tree, and how many of the
    caller's slots it freed as duplicates."""

    acquired: Acquired
    cached_tokens: int
    freed_tokens: int
