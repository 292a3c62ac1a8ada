"""The threads that move bytes: per-layer loads, backups, storage writes, prefetches.

Each job copies outside the cache's lock and settles its mark through
``CacheState`` with the lock held; whatever fails is rolled back there. The
workers are one thread each.

NOTE: loads run on one thread, in submission order. A load that depends on pages
another load is filling was submitted after it, so when that earlier load fails
and cancels it, the later job has not started copying yet.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from array import array

import numpy as np
import torch

from ..errors import CacheClosedError, LoadError
from ..storage.faults import WarningLimiter
from ..storage.keys import extend_keys
from .guard import StorageGuard
from .handles import PrefetchHandle
from .inflight import InFlight
from .sides import HOLE
from .state import CacheState
from .workers import Worker

log = logging.getLogger("kvtier.cache")
_warnings = WarningLimiter(log)
PREFETCH_CHUNK_PAGES = 8
#: Storage writes queued behind the one running, as a fraction of the host pool's
#: tokens: past it, further writes are dropped (counted), not queued. A whole host
#: pool's worth is the natural bound: the host holds no more, so writes queued past it
#: would find their pages evicted when their turn came. (One write is always queued
#: when none is, however large.)
STORE_BACKLOG_FRACTION = 1.0
#: Layers a load copies per call off a CUDA stream, in turn, the last length repeated:
#: the first layer alone (a caller waiting on layer 0 waits for one layer's copy), then
#: longer runs. A run is one copy that reads each token's layers side by side where the
#: host page holds them so (``page_first``, ``page_head``) instead of gathering short
#: rows far apart layer by layer. Reference spec, 256 random pages, every layer loaded
#: (GB/s; ``load_to_device_layers`` per run): a layer at a time 13.2 (``page_first``),
#: 12.8 (``page_head``), 19.5 (``layer_first``); runs (1, 2, 4, 8) 16.8, 14.2, 21.1;
#: (1, 4, 16) 17.6, 15.4, 20.8; (1, 16) 18.8, 16.5, 21.7. ``kvtier bench overlap``
#: (a stand-in attention per layer waiting on each layer): load and compute together
#: 34.7 against 40.8 ms (512 tokens) and 94.7 against 109.5 (1,024) a layer at a time.
LAYER_RUNS = (1, 4, 16)


def layer_runs(layers: int, lengths=LAYER_RUNS, weights=None) -> list[range]:
    """``range(layers)`` cut into consecutive runs of ``lengths`` layers (the last length
    repeated). With ``weights`` (each layer's bytes in this load), a run of length ``n``
    ends at the first layer that brings its bytes to ``n`` times the heaviest layer's,
    so a caller waits on as many bytes before each run as with equal layers.

    NOTE: for a hybrid model, whose sliding layers load a window of a few pages while
    its full layers load the whole prefix: runs counted in layers gave MiMo-V2-Flash's
    9 full layers (of 48) runs of 1, 0, 3, 3 and 2; weighted, they get 1, 4 and 4.
    Alternated runs of ``kvtier bench transfer --spec mimo-v2-flash`` (its load runs
    are these): page_head 0.59x of the limit -> 0.65-0.66x, page_first 0.67-0.71x ->
    0.70-0.71x, layer_first and page_first_direct 0.80-0.82x -> 0.82-0.83x."""
    if weights is not None and len(weights) != layers:
        raise ValueError(f"layer_runs: {len(weights)} weights for {layers} layers")
    unit = max(weights, default=0) if weights is not None else 0
    out, at, k = [], 0, 0
    while at < layers:
        n = lengths[min(k, len(lengths) - 1)]
        if unit <= 0:
            end = min(layers, at + n)
        else:
            end, total = at, 0
            while end < layers and total < n * unit:
                total += weights[end]
                end += 1
        out.append(range(at, end))
        at, k = end, k + 1
    return out


class Mover:
    def __init__(self, state: CacheState, guard: StorageGuard | None, *, io_backend: str,
                 synchronous: bool = False, layer_num: int | None = None, grouped=None) -> None:
        self.state, self.guard, self.io_backend = state, guard, io_backend
        # hybrid: the model's layer count (a load goes layer by layer over every group) and
        # the store seen per group (``GroupedStorage``)
        self.layer_num = state.device_pool.spec.layer_num if layer_num is None else layer_num
        self.grouped = grouped
        self.loader = Worker("kvtier-load", synchronous)
        self.backer = Worker("kvtier-backup", synchronous)
        self.writer = Worker("kvtier-store", synchronous) if guard is not None else None
        self.prefetcher = Worker("kvtier-prefetch", synchronous) if guard is not None else None
        self._jobs = {"load": (self.loader, self._load), "backup": (self.backer, self._backup),
                      "store": (self.writer, self._store)}
        cuda = state.device_pool.device.type == "cuda"
        self._streams = {k: torch.cuda.Stream(state.device_pool.device) for k in ("load", "backup")} if cuda else {}
        self._store_backlog = max(state.page_size, int(state.host_pool.size * STORE_BACKLOG_FRACTION))
        self._queued_store_tokens = 0  # tokens of the writes queued, not started (under the cache's lock)
        state.schedule = self.schedule

    @property
    def workers(self) -> list[Worker]:
        """In the order work flows: a backup queues a storage write."""
        return [w for w in (self.loader, self.prefetcher, self.backer, self.writer) if w is not None]

    # -- scheduling (lock held) ----------------------------------------------------------------------
    def schedule(self, mark: InFlight) -> None:
        """Queue the job for ``mark``; if the cache is closed, roll it back now. A storage
        write that would queue more than the backlog allows is dropped, counted: when
        storage is slower than the writes arriving, the queue stays bounded and the
        pages stay host-only (a later backup may write them)."""
        worker, job = self._jobs[mark.kind]
        if mark.kind == "store":
            tokens = sum(len(n.key) for n in mark.nodes)
            if self._queued_store_tokens and self._queued_store_tokens + tokens > self._store_backlog:
                mark.clear()
                self.state.stats.add(store_dropped_tokens=tokens)
                return
            # NOTE: counted out as counted in (not by the nodes' keys then: a node that left
            # the mark may be split meanwhile, and its key shortened)
            mark.queued = tokens
            self._queued_store_tokens += tokens
        if mark.kind == "backup" and self._streams:
            # NOTE: the engine may still be writing these slots on its stream: the copy waits for it.
            mark.ready = torch.cuda.Event()
            mark.ready.record(torch.cuda.current_stream(self.state.device_pool.device))
        try:
            worker.submit(lambda: job(mark))
        except CacheClosedError as e:
            self._abort(mark, e)

    def _abort(self, mark: InFlight, error: BaseException) -> None:
        if mark.kind == "load":
            self.state.fail_load(mark)
            mark.handle._finish(error)
        elif mark.kind == "backup":
            mark.cancelled = True
            self.state.finish_backup(mark, ok=True)
        else:
            self._dequeue(mark)
            mark.clear()

    def _dequeue(self, mark: InFlight) -> None:
        """A store leaves the backlog (lock held)."""
        self._queued_store_tokens -= mark.queued
        mark.queued = 0

    # -- jobs ----------------------------------------------------------------------------------------------
    def _stream(self, kind: str):
        stream = self._streams.get(kind)
        return (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()), stream

    def _load(self, mark: InFlight) -> None:
        state, handle = self.state, mark.handle
        with state.lock:
            if mark.cancelled:  # a load it depended on failed first (fail_load took its pages back)
                state.unlock_node(mark.pin)
                mark.done.set()
                handle._finish(LoadError("a load this one depended on failed"))
                return
        error = None
        scope, stream = self._stream("load")
        try:
            host, dev = self._group_indices(mark) if mark.side is not None else (None, None)
            with scope:
                # NOTE: on a CUDA stream one layer a call, each with its event; else in runs of
                # growing length (layer_runs; a hybrid model's weighed by its layers' bytes),
                # each layer done once its run is copied
                if stream is not None:
                    runs = layer_runs(self.layer_num, (1,))
                elif self.loader.inline:  # run on the caller's thread: no one waits on a layer before the end
                    runs = [range(self.layer_num)]
                else:
                    weights = state.sides.groups_host.layer_bytes(host) if mark.side is not None else None
                    runs = layer_runs(self.layer_num, LAYER_RUNS, weights)
                for layers in runs:
                    if mark.side is not None:
                        state.sides.groups_host.load_to_device_layers(state.sides.groups_device, host, dev, layers,
                                                                      self.io_backend)
                    else:
                        state.host_pool.load_to_device_layers(state.device_pool, mark.host, mark.device, layers,
                                                              self.io_backend)
                    for layer in layers:
                        if stream is not None:
                            handle._record_cuda_event(layer, stream)
                        handle._layer_done(layer)
        except Exception as e:
            error = e
            _warnings.warn(("load", type(e)), "kvtier: load of %d tokens failed: %r", mark.host.numel(), e)
        try:
            with state.lock:
                (state.fail_load if error is not None else state.finish_load)(mark)
        finally:  # a request waiting on the handle never hangs, whatever settling did
            handle._finish(error)

    def _backup(self, mark: InFlight) -> None:
        ok = True
        if not mark.cancelled:
            scope, stream = self._stream("backup")
            try:
                with scope:
                    if mark.ready is not None:
                        stream.wait_event(mark.ready)
                    if mark.side is not None:
                        host, dev = self._group_indices(mark)
                        self.state.sides.groups_host.backup_from_device_all_layer(self.state.sides.groups_device,
                                                                                  host, dev, self.io_backend)
                    else:
                        self.state.host_pool.backup_from_device_all_layer(self.state.device_pool, mark.host,
                                                                          mark.device, self.io_backend)
                if stream is not None:
                    stream.synchronize()  # the device copy stays pinned until the bytes have landed
            except Exception as e:
                ok = False
                _warnings.warn(("backup", type(e)), "kvtier: backup of %d tokens failed: %r", mark.host.numel(), e)
        with self.state.lock:
            self.state.finish_backup(mark, ok)

    def _group_indices(self, mark: InFlight) -> tuple[dict, dict]:
        """A hybrid transfer's ``(host, device)`` slots per group: the full pages in
        every full group, each sliding group's own; groups with nothing left out."""
        host, dev = {}, {}
        if mark.host.numel():
            for name in self.state.sides.full:
                host[name], dev[name] = mark.host, mark.device
        side_dev, side_host = mark.side
        for name, slots in side_host.items():
            if slots.numel():
                host[name], dev[name] = slots, side_dev[name]
        return host, dev

    def _store(self, mark: InFlight) -> None:
        with self.state.lock:
            self._dequeue(mark)
            job = self.state.start_store(mark)
        if job is None:
            ok = False
        elif self.grouped is not None:
            keys, slots, sides = job
            host = {name: slots for name in self.state.sides.full}
            pages = {name: range(len(keys)) for name in self.state.sides.full}
            for name, (picked, side_slots) in sides.items():
                if picked:
                    host[name], pages[name] = side_slots, picked
            ok = self.guard.set_groups(self.grouped, keys, self.state.sides.groups_host, host, pages)
        else:
            ok = self.guard.set(job[0], self.state.host_pool, job[1])
        with self.state.lock:
            self.state.finish_store(mark, ok)

    # -- storage -> host --------------------------------------------------------------------------------------
    def prefetch(self, tokens: array, salt: bytes, last, start: int, pages: int, parent_key: str | None,
                 policy: str, timeout: float) -> PrefetchHandle:
        """Fetch ``pages`` pages of ``tokens`` after ``start`` (the resident prefix
        ending at node ``last``) into the host pool, in the background."""
        state, ps = self.state, self.state.page_size
        with state.lock:
            host = state.alloc_fetch(pages * ps) if pages else None
            while host is None and pages:
                pages //= 2  # settle for a shorter prefix when the host is full of locked pages
                host = state.alloc_fetch(pages * ps) if pages else None
            if pages:
                state.lock_node(last)
        handle = PrefetchHandle(pages * ps, policy, timeout)
        if not pages:
            return handle
        try:
            self.prefetcher.submit(lambda: self._prefetch(handle, tokens, salt, last, start, host, parent_key))
        except CacheClosedError:
            with state.lock:
                state.free_fetch(host)
                state.unlock_node(last)
            raise
        return handle

    def _chunks(self, handle, tokens, salt, start: int, parent_key):
        """A prefetch's storage keys, ``(first page, keys)`` a chunk at a time, until it is
        cancelled (lazily: a failure to make them surfaces in the job's own ``try``)."""
        state = self.state
        keys = extend_keys(parent_key, tokens[start:start + handle.target], state.page_size, state.namespace, salt,
                           state.hash)
        for c in range(0, len(keys), PREFETCH_CHUNK_PAGES):
            if handle._cancel.is_set():
                return
            yield c, keys[c:c + PREFETCH_CHUNK_PAGES]

    def _prefetch(self, handle, tokens, salt, last, start, host, parent_key) -> None:
        state, ps, done = self.state, self.state.page_size, 0
        try:
            for c, chunk in self._chunks(handle, tokens, salt, start, parent_key):
                got = self.guard.get(chunk, state.host_pool, host[c * ps:(c + len(chunk)) * ps])
                n = next((i for i, ok in enumerate(got) if not ok), len(got))
                if n:
                    with state.lock:
                        adopted = state.adopt_host(tokens[:start + done + n * ps], host[done:done + n * ps],
                                                   start + done, salt, chunk[:n])
                    if not adopted:
                        break
                    done += n * ps
                    handle.tokens = done
                    state.stats.add(prefetched_tokens=n * ps)
                if n < len(chunk):
                    break
        finally:
            with state.lock:
                if done < host.numel():
                    state.free_fetch(host[done:])
                state.unlock_node(last)
            handle._done.set()

    # -- storage -> host, hybrid ------------------------------------------------------------------------------
    def prefetch_groups(self, tokens: array, salt: bytes, last, start: int, pages: int, parent_key: str | None,
                        target: int, policy: str, timeout: float) -> PrefetchHandle:
        """:meth:`prefetch` for a hybrid spec: the full pages after ``start`` tokens
        and, per sliding group, only the pages of the window before ``target``
        tokens; all host pages are taken before anything is read (or nothing is)."""
        state, ps = self.state, self.state.page_size
        first = start // ps
        need = {g: np.array([i - first for i in state.sides.window_pages(g, target) if i >= first], dtype=np.int64)
                for g in state.sides.names}
        with state.lock:
            host = state.alloc_fetch(pages * ps) if pages else None
            side = {} if host is not None else None
            for g, idx in need.items():
                got = state.alloc_side("host", g, idx.size) if side is not None else None
                if got is None:
                    break
                side[g] = np.full(pages, HOLE, dtype=np.int64)
                side[g][idx] = got
                state.sides.fetching[g] += idx.size * ps
            if side is None or len(side) < len(need):
                self._free_fetched(host, side or {}, 0)
                return PrefetchHandle(0, policy, timeout)
            state.lock_node(last)
        handle = PrefetchHandle(pages * ps, policy, timeout)
        try:
            self.prefetcher.submit(lambda: self._prefetch_groups(handle, tokens, salt, last, start, host, side,
                                                                 parent_key))
        except CacheClosedError:
            with state.lock:
                self._free_fetched(host, side, 0)
                state.unlock_node(last)
            raise
        return handle

    def _free_fetched(self, host, side: dict, done: int) -> None:
        """Give back what a hybrid prefetch holds after its first ``done`` pages (lock held)."""
        state, ps = self.state, self.state.page_size
        if host is not None and done * ps < host.numel():
            state.free_fetch(host[done * ps:])
        for g, pages in side.items():
            state.sides.fetching[g] -= state.free_side("host", g, pages[done:]) * ps

    def _prefetch_groups(self, handle, tokens, salt, last, start, host, side, parent_key) -> None:
        state, ps, done = self.state, self.state.page_size, 0
        full = state.sides.full
        # the pages each sliding group fetches (a window's few, ascending): a chunk takes its own by bisection
        fetched = {g: np.flatnonzero(pages >= 0).tolist() for g, pages in side.items()}
        try:
            for c, chunk in self._chunks(handle, tokens, salt, start, parent_key):
                k = len(chunk)
                slots = {name: host[c * ps:(c + k) * ps] for name in full}
                picked = {name: range(k) for name in full}
                for g, pages in side.items():
                    at = fetched[g]
                    lo, hi = bisect.bisect_left(at, c), bisect.bisect_left(at, c + k)
                    if lo < hi:
                        picked[g] = [i - c for i in at[lo:hi]]
                        slots[g] = state.sides.slots(pages[at[lo:hi]])
                got = self.guard.get_groups(self.grouped, chunk, state.sides.groups_host, slots, picked)
                n = k  # the chunk's pages before the first that some group missed (picked: ascending)
                for name, answers in got.items():
                    if not all(answers):
                        n = min(n, picked[name][answers.index(False)])
                if n:
                    with state.lock:
                        adopted = state.adopt_host(tokens[:start + (c + n) * ps], host[c * ps:(c + n) * ps],
                                                   start + c * ps, salt, chunk[:n],
                                                   {g: pages[c:c + n] for g, pages in side.items()})
                    if not adopted:  # it took none of them: the finally gives them back
                        break
                    done = c + n
                    handle.tokens = done * ps
                    state.stats.add(prefetched_tokens=n * ps)
                if n < k:
                    break
        finally:
            with state.lock:
                self._free_fetched(host, side, done)
                state.unlock_node(last)
            handle._done.set()

    # -- lifecycle ------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait until no job is queued or running (jobs may queue others), storage
        queries included."""
        workers = self.workers + (self.guard.workers if self.guard is not None else [])
        while any(w.depth() for w in workers):
            for worker in workers:
                worker.join_queue()

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        if self.guard is not None:
            self.guard.close()
