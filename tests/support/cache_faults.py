"""Fault injection for cache tests: loads that fail or wait at a gate, and a store
whose calls raise, answer wrongly or hang."""

from __future__ import annotations

import threading
import time


class LoadFaults:
    """Wraps ``host_pool.load_to_device_layers`` of a cache (its loads' copies): ``fail``
    (how many upcoming calls raise), ``fail_every`` (every n-th call raises; 0: none)
    and ``gate`` (each call waits for it), recording threads."""

    def __init__(self, cache) -> None:
        self.pool = cache.host_pool
        self.inner = self.pool.load_to_device_layers
        self.fail = 0
        self.fail_every = 0
        self.calls = 0
        self.delay = 0.0                   # seconds each call sleeps
        self.gate: threading.Event | None = None
        self.started = threading.Event()
        self.pool.load_to_device_layers = self

    def __call__(self, *args, **kwargs):
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test gate never opened"
        if self.delay:
            time.sleep(self.delay)
        self.calls += 1
        if self.fail or (self.fail_every and self.calls % self.fail_every == 0):
            self.fail = max(0, self.fail - 1)
            raise OSError("injected load failure")
        return self.inner(*args, **kwargs)


class FaultyStore:
    """A real store behind switchable faults; every switch is off by default."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.raise_exists = self.raise_get = self.raise_set = False
        self.exists_answer = None          # e.g. -1 or 10**6: a malformed batch_exists answer
        self.short_get = False             # batch_get answers one result too few
        self.set_gate: threading.Event | None = None
        self.exists_gate: threading.Event | None = None
        self.exists_delay = 0.0            # seconds each batch_exists sleeps
        self.set_started = threading.Event()

    def batch_exists(self, keys):
        if self.exists_gate is not None:
            self.exists_gate.wait(10)
        if self.exists_delay:
            time.sleep(self.exists_delay)
        if self.raise_exists:
            raise ConnectionError("injected exists failure")
        if self.exists_answer is not None:
            return self.exists_answer
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, host_pool, host_indices):
        if self.raise_get:
            raise ConnectionError("injected get failure")
        got = self.inner.batch_get(keys, host_pool, host_indices)
        return got[:-1] if self.short_get else got

    def batch_set(self, keys, host_pool, host_indices):
        self.set_started.set()
        if self.set_gate is not None:
            self.set_gate.wait(10)
        if self.raise_set:
            raise ConnectionError("injected set failure")
        return self.inner.batch_set(keys, host_pool, host_indices)

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()
