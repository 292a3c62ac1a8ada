"""A named background thread draining a queue of jobs: event-driven, never polling."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from typing import Callable

from ..errors import CacheClosedError

log = logging.getLogger("kvtier.cache")
_STOP = object()


class Worker:
    """``inline=True`` runs each job on the submitting thread instead (no overlap, no
    timing: what a deterministic replay needs)."""

    def __init__(self, name: str, inline: bool = False) -> None:
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._closing = threading.Lock()  # submit vs close: no job lands behind the stop
        self._closed = False
        self._inline = inline
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if inline:
            return
        self._thread.start()
        # NOTE: a daemon thread killed inside a torch op at interpreter exit aborts the
        # process; finishing the queue at exit avoids that when close() was never called.
        atexit.register(self.close)

    @property
    def inline(self) -> bool:
        """Whether jobs run on the submitting thread (``submit`` returns when they ran)."""
        return self._inline

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; ``CacheClosedError`` once :meth:`close` was called."""
        with self._closing:
            if self._closed:
                raise CacheClosedError(f"{self.name} is closed")
            if not self._inline:
                self._queue.put(job)
                return
        try:
            job()
        except Exception:
            log.exception("kvtier %s: job failed", self.name)

    def depth(self) -> int:
        """Jobs queued or running."""
        return self._queue.unfinished_tasks

    def join_queue(self) -> None:
        self._queue.join()

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop; waits at most ``timeout`` seconds for that
        (a job hung in a storage call is left to finish on its daemon thread)."""
        with self._closing:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        atexit.unregister(self.close)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                job()
            except Exception:  # a job reports its own errors; this keeps the worker alive
                log.exception("kvtier %s: job failed", self.name)
            finally:
                self._queue.task_done()
