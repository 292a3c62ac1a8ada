"""A hypothesis state machine against a reference model of what was ever inserted,
with failing loads, failing and slow storage, double releases and close."""

import shutil
import tempfile

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvtier.storage
from kvtier import CacheClosedError
from tests.support.cache_engine import PAGE, make_cache, serve, serve_acquire
from tests.support.cache_faults import FaultyStore, LoadFaults

# prompts built from page ids: pages of the same id are the same tokens, so prompts share prefixes
prompts = st.lists(st.integers(0, 3), min_size=1, max_size=5).map(
    lambda ids: [t for i, p in enumerate(ids) for t in ((p * 10 + i) * PAGE + j for j in range(PAGE))])
STORE_FAULTS = ("raise_exists", "raise_get", "raise_set", "short_get", "slow_exists")


class CacheMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
                with_storage=st.booleans())
    def setup(self, policy, with_storage):
        self.dir = tempfile.mkdtemp(prefix="kvtier-props-")
        self.store = FaultyStore(kvtier.storage.open(f"file://{self.dir}")) if with_storage else None
        self.cache = make_cache(device_tokens=32, host_tokens=24, write_policy=policy, storage=self.store,
                                prefetch_policy="wait_complete", storage_timeout=0.05)
        self.loads = LoadFaults(self.cache)
        self.inserted: set[tuple[int, ...]] = set()   # reference model: every cached page chain
        self.locked = []                              # (lease, {node: (device, host)} at lock time)
        self.closed = False

    def teardown(self):
        if hasattr(self, "cache"):
            self.cache.close()
            if self.store is not None:
                self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _bound(self, tokens) -> int:
        """Longest page prefix of ``tokens`` ever inserted: no cache hit can exceed it."""
        n = 0
        while n + PAGE <= len(tokens) and tuple(tokens[:n + PAGE]) in self.inserted:
            n += PAGE
        return n

    def _record(self, tokens, out):
        if out["inserted"]:
            self.inserted |= {tuple(tokens[:n]) for n in range(PAGE, len(tokens) + 1, PAGE)}

    @precondition(lambda self: not self.closed)
    @rule(tokens=prompts)
    def serve(self, tokens):
        out = serve(self.cache, tokens)
        assert out["match"].cached_len <= self._bound(tokens)
        self._record(tokens, out)

    @precondition(lambda self: not self.closed)
    @rule(tokens=prompts)
    def serve_acquire(self, tokens):
        out = serve_acquire(self.cache, tokens)
        assert out["reused"] <= self._bound(tokens)
        self._record(tokens, out)

    @precondition(lambda self: not self.closed)
    @rule(tokens=prompts)
    def lock(self, tokens):
        m = self.cache.match_prefix(tokens)
        lease = self.cache.lock(m)
        self.locked.append((lease, {id(n): (n, n.dev_pages, n.host) for n in m.path}))

    @precondition(lambda self: self.locked and not self.closed)
    @rule(i=st.integers(0, 10))
    def unlock(self, i):
        lease, _ = self.locked.pop(i % len(self.locked))
        self.cache.unlock(lease)

    @precondition(lambda self: not self.closed)
    @rule(tokens=prompts)
    def release_twice(self, tokens):
        got = self.cache.acquire(tokens)
        self.cache.release(got)
        with pytest.raises(ValueError, match="already released"):
            self.cache.release(got)

    @precondition(lambda self: not self.closed)
    @rule(n=st.integers(1, 40))
    def evict_device(self, n):
        self.cache.evict_device(n)

    @precondition(lambda self: not self.closed)
    @rule(n=st.integers(1, 40))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @precondition(lambda self: not self.closed)
    @rule(n=st.integers(1, 2))
    def fail_loads(self, n):
        self.loads.fail = n

    @precondition(lambda self: self.store is not None and not self.closed)
    @rule(fault=st.sampled_from(STORE_FAULTS), on=st.booleans())
    def storage_fault(self, fault, on):
        if fault == "slow_exists":
            self.store.exists_delay = 0.1 if on else 0.0
        else:
            setattr(self.store, fault, on)

    @precondition(lambda self: not self.closed and not self.locked)
    @rule()
    def close(self):
        self.cache.close()
        self.closed = True

    @precondition(lambda self: self.closed)
    @rule(tokens=prompts)
    def call_after_close(self, tokens):
        for call in (lambda: self.cache.acquire(tokens), self.cache.flush, lambda: self.cache.evict_host(4),
                     lambda: self.cache.insert(tokens, torch.arange(len(tokens) - len(tokens) % PAGE))):
            with pytest.raises(CacheClosedError):
                call()

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache") or self.closed:
            return
        self.cache.flush()
        self.cache.check_integrity(engine_device_slots=0)
        for _, snapshot in self.locked:   # locked pages keep every copy they had
            for node, device, host in snapshot.values():
                assert self.cache.tree.attached(node)
                if device is not None:
                    assert node.dev_pages is not None and node.dev_pages[-1] == device[-1]
                if host is not None:
                    assert node.host is not None


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
