"""Fault handling shared by the backends: a circuit breaker and a warning rate limiter."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Hashable

from ..errors import BackendDown


class Breaker:
    """After a timeout or connection error, refuse calls for ``backoff`` seconds.

    ``check()`` raises :class:`BackendDown` while open; once the backoff has passed,
    calls go through again (and one that fails opens it again). ``backoff=0``
    disables it. Thread-safe.
    """

    def __init__(self, backoff: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff, self.clock = backoff, clock
        self._lock = threading.Lock()
        self._until = 0.0
        self._why = ""

    def is_open(self) -> bool:
        with self._lock:
            return self.clock() < self._until

    def check(self) -> None:
        with self._lock:
            left = self._until - self.clock()
            if left > 0:
                raise BackendDown(f"failing fast for {left:.1f}s more after: {self._why}")

    def trip(self, error: BaseException | str) -> None:
        with self._lock:
            self._until = self.clock() + self.backoff
            self._why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"


class WarningLimiter:
    """Logs the first warning of each kind at once; repeats of the kind within
    ``interval`` seconds are counted, and the next one logged after the interval says
    how many were left out. Kinds are caller-chosen (e.g. ``(op, error type)``), so
    messages that differ only in a path or a byte count still count as repeats."""

    _MAX_KINDS = 256

    def __init__(self, logger: logging.Logger, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval, self.clock = logger, interval, clock
        self._lock = threading.Lock()
        self._kinds: OrderedDict[Hashable, list] = OrderedDict()  # kind -> [window start, left out]

    def warn(self, kind: Hashable, msg: str, *args) -> None:
        with self._lock:
            now = self.clock()
            state = self._kinds.get(kind)
            if state is not None and now - state[0] < self.interval:
                state[1] += 1
                return
            left_out = state[1] if state is not None else 0
            self._kinds[kind] = [now, 0]
            self._kinds.move_to_end(kind)
            while len(self._kinds) > self._MAX_KINDS:
                self._kinds.popitem(last=False)
        if left_out:
            msg += " (repeated %d times in the last %.0fs, not shown)"
            args = (*args, left_out, now - state[0])
        self.logger.warning(msg, *args)

    def flush(self) -> None:
        """Log how many repeats of each kind are still unreported."""
        with self._lock:
            pending = [(kind, n) for kind, (_, n) in self._kinds.items() if n]
            self._kinds.clear()
        for kind, n in pending:
            self.logger.warning("kvtier storage: %s repeated %d more times, not shown", kind, n)
