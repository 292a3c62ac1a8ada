"""A hypothesis state machine against a reference model of what was ever inserted."""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine import PAGE, make_cache, serve
from invariants import check_invariants

# prompts built from page ids: pages of the same id are the same tokens, so prompts share prefixes
prompts = st.lists(st.integers(0, 3), min_size=1, max_size=5).map(
    lambda ids: [t for i, p in enumerate(ids) for t in ((p * 10 + i) * PAGE + j for j in range(PAGE))])


class CacheMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]))
    def setup(self, policy):
        self.cache = make_cache(device_tokens=32, host_tokens=24, write_policy=policy)
        self.inserted: set[tuple[int, ...]] = set()   # reference model: every cached page chain
        self.locked = []                              # (match, {node: (device, host)} at lock time)

    def teardown(self):
        self.cache.close()

    def _bound(self, tokens) -> int:
        """Longest page prefix of ``tokens`` ever inserted: no cache hit can exceed it."""
        n = 0
        while n + PAGE <= len(tokens) and tuple(tokens[:n + PAGE]) in self.inserted:
            n += PAGE
        return n

    @rule(tokens=prompts)
    def serve(self, tokens):
        out = serve(self.cache, tokens)
        assert out["match"].cached_len <= self._bound(tokens)
        if out["inserted"]:
            self.inserted |= {tuple(tokens[:n]) for n in range(PAGE, len(tokens) + 1, PAGE)}

    @rule(tokens=prompts)
    def lock(self, tokens):
        m = self.cache.match_prefix(tokens)
        self.cache.lock(m)
        self.locked.append((m, {id(n): (n, n.device, n.host) for n in m.last_node.path()}))

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 10))
    def unlock(self, i):
        m, _ = self.locked.pop(i % len(self.locked))
        self.cache.unlock(m)

    @rule(n=st.integers(1, 40))
    def evict_device(self, n):
        self.cache.evict_device(n)

    @rule(n=st.integers(1, 40))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        check_invariants(self.cache)
        for m, snapshot in self.locked:   # locked pages keep every copy they had
            for node, device, host in snapshot.values():
                assert self.cache.tree.attached(node)
                if device is not None:
                    assert node.device is not None and torch.equal(node.device[-1:], device[-1:])
                if host is not None:
                    assert node.host is not None


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
