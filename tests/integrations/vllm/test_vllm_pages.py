"""The page table behind kvtier's vLLM host tier against a plain reference model
(no vLLM needed): random reserve / commit / pin / unpin / touch / reset / tick
sequences keep the same READY keys in the same LRU order, evict exactly the least
recently used unpinned blocks (never one the same reserve keeps), and never lose or
share a page, for offloaded blocks of one and of several vLLM blocks."""

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvtier.integrations.vllm.pages import ORPHAN_STEPS, PageState, PageTable  # noqa: E402

PAGES = 4  # offloaded blocks the table holds
KEYS = [bytes([i]) * 4 for i in range(7)]


class Reference:
    """What the table should do, written the obvious way."""

    def __init__(self):
        self.state, self.loads, self.lru, self.orphans = {}, {}, [], {}

    def held(self):
        return len(self.state)

    def reserve(self, keys):
        new = [k for k in dict.fromkeys(keys) if k not in self.state]
        room = max(0, len(new) - (PAGES - self.held()))
        victims = [k for k in self.lru if self.loads[k] == 0 and k not in keys][:room]
        if PAGES - self.held() + len(victims) < len(new):
            return None
        for k in victims:
            self._drop(k)
        for k in new:
            self.state[k], self.loads[k] = "storing", 0
        return new, victims

    def commit(self, keys, ok):
        for k in keys:
            if self.state.get(k) != "storing" or k in self.orphans:
                continue
            if ok:
                self.state[k] = "ready"
                self.lru.append(k)
            else:
                self._drop(k)

    def pin(self, keys):
        for k in keys:
            self.loads[k] += 1
            self.lru.remove(k)
            self.lru.append(k)

    def unpin(self, keys):
        for k in keys:
            if k in self.loads and self.loads[k]:
                self.loads[k] -= 1

    def touch(self, keys):
        for k in keys:
            if k in self.lru:
                self.lru.remove(k)
                self.lru.append(k)

    def reset(self):
        for k in list(self.state):
            if self.state[k] == "storing" or self.loads[k]:
                if k in self.lru:
                    self.lru.remove(k)
                self.state[k] = "storing"
                self.orphans[k] = ORPHAN_STEPS
            else:
                self._drop(k)

    def tick(self):
        for k, n in list(self.orphans.items()):
            if n > 1:
                self.orphans[k] = n - 1
            else:
                del self.orphans[k]
                self._drop(k)

    def _drop(self, k):
        del self.state[k], self.loads[k]
        if k in self.lru:
            self.lru.remove(k)


ops = st.lists(st.tuples(st.sampled_from(["reserve", "commit", "fail", "pin", "unpin", "touch", "reset", "tick"]),
                         st.lists(st.sampled_from(KEYS), min_size=1, max_size=3)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops, st.sampled_from([1, 3]))
def test_page_table_matches_reference(steps, per_key):
    table, ref = PageTable(PAGES * per_key, per_key), Reference()
    for op, keys in steps:
        if op == "reserve":
            got, want = table.reserve(keys), ref.reserve(keys)
            assert (got is None) == (want is None)
            if got is not None:
                assert (got.keys, got.evicted) == want
        elif op in ("commit", "fail"):
            table.commit(keys, op == "commit")
            ref.commit(keys, op == "commit")
        elif op == "pin":
            ready = [k for k in keys if ref.state.get(k) == "ready"]
            if ready != keys:
                with pytest.raises(ValueError):
                    table.pin(keys)
                continue
            table.pin(keys)
            ref.pin(keys)
        elif op == "unpin":
            table.unpin(keys)
            ref.unpin(keys)
        elif op == "touch":
            table.touch(keys)
            ref.touch(keys)
        else:
            getattr(table, op)()
            getattr(ref, op)()
        assert table.lru_order() == ref.lru
        pages = {k: table.get(k) for k in KEYS if table.get(k) is not None}
        assert set(pages) == set(ref.state)
        assert all((p.state is PageState.READY) == (ref.state[k] == "ready") for k, p in pages.items())
        held = [int(n) for e in pages.values() for n in e.pages]
        assert all(len(e.pages) == per_key for e in pages.values())
        assert len(set(held)) == len(held)                                    # no page shared
        assert table.free_keys() + len(pages) == PAGES                        # no page lost
