"""A hypothesis state machine over hybrid caches: every reuse checked byte for byte in
every group, the cache's invariants after every step, under failing loads, faulty
storage, locks, evictions of every tier and group, and engines that keep only the
window they need."""

import logging
import shutil
import tempfile
from array import array

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvtier.storage
from tests.support.cache_faults import FaultyStore, LoadFaults
from tests.support.cache_hybrid_engine import HybridEngine, make_cache
from tests.support.pools import HYBRID_SPECS

PAGE = 4
# prompts built from page ids: pages of the same id are the same tokens, so prompts share prefixes
prompts = st.lists(st.integers(0, 3), min_size=1, max_size=7).map(
    lambda ids: [t for i, p in enumerate(ids) for t in ((p * 10 + i) * PAGE + j for j in range(PAGE))])
STORE_FAULTS = ("raise_exists", "raise_get", "raise_set", "short_get")


class _Crashes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record) -> None:
        self.records.append(record)


class HybridCacheMachine(RuleBasedStateMachine):
    @initialize(name=st.sampled_from(["mimo", "oss", "all_swa", "long_window"]),
                policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
                with_storage=st.booleans(), retention=st.sampled_from([None, 8]))
    def setup(self, name, policy, with_storage, retention):
        spec = HYBRID_SPECS[name]
        self.dir = tempfile.mkdtemp(prefix="kvtier-hybrid-props-")
        self.store = FaultyStore(kvtier.storage.open(f"file://{self.dir}")) if with_storage else None
        sizes = {g.name: (48 if g.attention.is_full else 24) for g in spec.groups}
        host = {g.name: (40 if g.attention.is_full else 20) for g in spec.groups}
        self.cache = make_cache(spec, PAGE, sizes, host, self.store, write_policy=policy,
                                prefetch_policy="wait_complete", storage_timeout=0.05, retention_interval=retention)
        self.engine = HybridEngine(self.cache)
        self.loads = LoadFaults(self.cache)
        self.leases = []
        self.crashes = _Crashes()  # a job that raised on a worker thread (it would leave its waiters hanging)
        logging.getLogger("kvtier.cache").addHandler(self.crashes)

    def teardown(self):
        if hasattr(self, "crashes"):
            logging.getLogger("kvtier.cache").removeHandler(self.crashes)
        if hasattr(self, "cache"):
            self.cache.close()
            if self.store is not None:
                self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(tokens=prompts, keep=st.sampled_from(["all", "tail"]), resume=st.integers(0, 8))
    def serve(self, tokens, keep, resume):
        # checks every group's bytes of what it reuses; ``resume``: a resume point ``resume`` pages in
        self.engine.serve(tokens, keep=keep, resume_at=(resume * self.engine.ps,) if resume else ())

    @rule(tokens=prompts)
    def the_rules_shortcut_agrees_with_its_search(self, tokens):
        """A match's device and host hits, with the shortcut for a hit whose windows are
        held at its end and with the page-by-page search alone, are the same."""
        state = self.cache._state
        with self.cache._lock:
            shortcut = state.peek(array("q", tokens), b"")[1:3]
            state._windows_held = lambda path, pages: False  # the search alone
            try:
                searched = state.peek(array("q", tokens), b"")[1:3]
            finally:
                del state._windows_held
        assert shortcut == searched

    @rule(tokens=prompts)
    def lock(self, tokens):
        self.leases.append(self.cache.lock(self.cache.match_prefix(tokens)))

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 10))
    def unlock(self, i):
        self.cache.unlock(self.leases.pop(i % len(self.leases)))

    @rule(n=st.integers(1, 60))
    def evict_device(self, n):
        self.cache.evict_device(n)

    @rule(n=st.integers(1, 60))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @rule(n=st.integers(1, 6))
    def crowd_a_sliding_pool(self, n):
        """An engine takes sliding slots for a while: the cache evicts windows for them."""
        for g in self.engine.sliding:
            got = self.cache.alloc_device(n * PAGE, group=g)
            if got is not None:
                self.cache.free_device(got, group=g)

    @rule(n=st.integers(1, 2))
    def fail_loads(self, n):
        self.loads.fail = n

    @precondition(lambda self: self.store is not None)
    @rule(fault=st.sampled_from(STORE_FAULTS), on=st.booleans())
    def storage_fault(self, fault, on):
        setattr(self.store, fault, on)

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.flush()
        assert not self.crashes.records, self.crashes.records[0].getMessage()
        self.cache.check_integrity(engine_device_slots=0)
        for g, held in self.cache.stats()["sliding_pages"].items():  # the engine holds no sliding slot
            pool = self.cache.device_pool[g]                         # between requests: none leaked
            assert pool.available_size() + held["device"] * PAGE == pool.size


TestHybridCacheMachine = HybridCacheMachine.TestCase
TestHybridCacheMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
