"""Storage as the cache calls it: every fault is a miss plus a counted error.

A backend may raise, answer with the wrong number of results, or hang. None of that
reaches the engine: ``exists`` runs on a thread of its own with a timeout (with every
such thread still in a hung call, the next ones fail fast instead of piling up),
``get`` and ``set`` run on the caller's workers and turn exceptions and malformed
answers into misses. The cache and the vLLM integration's host tier both call storage
through it, so one policy holds for every storage call kvtier makes.
"""

from __future__ import annotations

import logging
import threading

from .._checks import is_int
from ..errors import CacheClosedError
from ..storage.faults import WarningLimiter
from .protocols import Storage
from .stats import CacheStats
from .workers import Worker

log = logging.getLogger("kvtier.cache")
_warnings = WarningLimiter(log)  # a storage that is down fails every call: say so once per interval


class StorageGuard:
    """``stats`` has ``error(kind)`` (a :class:`CacheStats`, or any counter that does);
    ``concurrency`` is how many ``exists`` calls may run at once, each on its own thread."""

    def __init__(self, storage: Storage, stats: CacheStats, timeout: float, inline: bool = False,
                 concurrency: int = 1) -> None:
        self.storage, self._stats, self.timeout = storage, stats, timeout
        self.workers = [Worker("kvtier-exists" if i == 0 else f"kvtier-exists-{i}", inline)
                        for i in range(concurrency)]
        self._free = list(range(concurrency))  # threads with no exists call running
        self._free_lock = threading.Lock()

    def _take_thread(self) -> int | None:
        with self._free_lock:
            return self._free.pop() if self._free else None

    def _give_thread(self, i: int) -> None:
        with self._free_lock:
            self._free.append(i)

    def exists(self, keys: list[str]) -> int:
        """How many leading ``keys`` storage holds; 0 on any fault or after ``timeout``."""
        if not keys:
            return 0
        n = self._ask(lambda: self.storage.batch_exists(keys), "batch_exists")
        if n is None:
            return 0
        if not is_int(n) or not 0 <= n <= len(keys):
            return self._fault("storage_exists", "answer", f"batch_exists answered {n!r} for {len(keys)} keys")
        return n

    def exists_each(self, keys: list[str]) -> list[bool]:
        """Per key, whether storage holds it; all ``False`` on any fault or after ``timeout``."""
        if not keys:
            return []
        got = self._ask(lambda: self.storage.exists_each(keys), "exists_each")
        if got is None:
            return [False] * len(keys)
        return self._per_key("storage_exists", "exists_each", got, len(keys))

    def reusable(self, grouped, keys: list[str], held) -> int:
        """:meth:`GroupedStorage.reusable` (a hybrid model's lookup), guarded as
        :meth:`exists`: 0 on any fault or after ``timeout``."""
        if not keys:
            return 0
        n = self._ask(lambda: grouped.reusable(keys, held), "reusable")
        return n if is_int(n) and 0 <= n <= len(keys) else 0

    def _ask(self, call, what: str):
        """``call()`` on an exists thread within ``timeout``; ``None`` (counted) on a fault."""
        slot = self._take_thread()
        if slot is None:
            self._fault("storage_exists", "busy", f"every {what} thread is still running a call")
            return None
        answer, done = {}, threading.Event()

        def run() -> None:
            try:
                answer["n"] = call()
            except Exception as e:
                answer["error"] = e
            finally:
                self._give_thread(slot)
                done.set()

        try:
            self.workers[slot].submit(run)
        except CacheClosedError:
            self._give_thread(slot)
            raise
        if not done.wait(self.timeout):
            self._fault("storage_exists", "slow", f"{what} took over {self.timeout}s")
            return None
        if "error" in answer:
            self._fault("storage_exists", type(answer["error"]), f"{what} raised {answer['error']!r}")
            return None
        return answer.get("n")

    def get(self, keys: list[str], host_pool, host_indices) -> list[bool]:
        """Per key, whether its page was filled; a fault is a miss."""
        try:
            got = self.storage.batch_get(keys, host_pool, host_indices)
        except Exception as e:
            self._fault("storage_read", type(e), f"batch_get raised {e!r}")
            return [False] * len(keys)
        return self._per_key("storage_read", "batch_get", got, len(keys))

    def set(self, keys: list[str], host_pool, host_indices) -> bool:
        """Whether every page was written; faults are logged (the caller counts them)."""
        return all(self.set_each(keys, host_pool, host_indices))

    def set_each(self, keys: list[str], host_pool, host_indices) -> list[bool]:
        """Per key, whether its page was written (only ``True`` counts); a fault or an
        answer of another shape is all ``False``, logged (the caller counts them)."""
        try:
            ok = self.storage.batch_set(keys, host_pool, host_indices)
        except Exception as e:
            _warnings.warn(("batch_set", type(e)), "kvtier storage: batch_set raised %r", e)
            return [False] * len(keys)
        if not isinstance(ok, (list, tuple)) or len(ok) != len(keys):
            _warnings.warn(("batch_set", "answer"), "kvtier storage: batch_set answered %r for %d keys", ok, len(keys))
            return [False] * len(keys)
        return [x is True for x in ok]

    def get_groups(self, grouped, keys: list[str], host_pool, host_indices, pages) -> dict[str, list[bool]]:
        """:meth:`GroupedStorage.batch_get` per group; a fault is all misses."""
        try:
            got = grouped.batch_get(keys, host_pool, host_indices, pages)
        except Exception as e:
            self._fault("storage_read", type(e), f"batch_get raised {e!r}")
            return {name: [False] * len(picked) for name, picked in pages.items()}
        return {name: self._per_key("storage_read", "batch_get", got.get(name), len(picked))
                for name, picked in pages.items()}

    def set_groups(self, grouped, keys: list[str], host_pool, host_indices, pages) -> bool:
        """Whether every group's every page was written (:meth:`GroupedStorage.batch_set`)."""
        try:
            ok = grouped.batch_set(keys, host_pool, host_indices, pages)
        except Exception as e:
            _warnings.warn(("batch_set", type(e)), "kvtier storage: batch_set raised %r", e)
            return False
        return all(len(ok.get(name, ())) == len(picked) and all(x is True for x in ok[name])
                   for name, picked in pages.items())

    def _per_key(self, kind: str, op: str, got, n: int) -> list[bool]:
        # NOTE: the types seen once each (a C loop), not an isinstance per answer
        if not isinstance(got, (list, tuple)) or len(got) != n or (n and set(map(type, got)) != {bool}):
            self._fault(kind, "answer", f"{op} answered {got!r:.80} for {n} keys")
            return [False] * n
        return list(got)

    def _fault(self, kind: str, label, why: str) -> int:
        """Count one ``kind`` error; warn (repeats of ``(kind, label)`` rate-limited)."""
        self._stats.error(kind)
        _warnings.warn((kind, label), "kvtier storage: %s", why)
        return 0

    def close(self) -> None:
        for worker in self.workers:
            worker.close(timeout=self.timeout)
