"""``check_integrity`` raises a named error (not an ``assert``), and ``KVTIER_CHECK=1``
runs it after every call that changes state."""

import subprocess
import sys
import threading

import pytest

import kvtier
import kvtier.storage
from kvtier.cache import IntegrityError
from kvtier.cache.residency import DeviceCopy, HostCopy
from kvtier.cache.state import CacheState
from tests.support import ROOT
from tests.support.cache_engine import make_cache, serve

A = list(range(100, 112))            # 3 pages
B = list(range(200, 208))            # 2 pages


def served():
    cache = make_cache()
    serve(cache, A)
    serve(cache, B)
    cache.flush()
    return cache


def node_of(cache, first_token):
    return next(n for n in cache.tree.nodes() if n.key[0] == first_token)


def share_a_device_page(cache):
    a, b = node_of(cache, A[0]), node_of(cache, B[0])
    b.device = DeviceCopy(a.device.pages[:2].copy())


def share_a_host_slot(cache):
    node_of(cache, B[0]).host = HostCopy(node_of(cache, A[0]).host.slots[:8])


def drop_a_parent_device_copy(cache):
    serve(cache, A + B)                                   # a child below A's node
    node_of(cache, A[0]).device = None


def leak_a_host_slot(cache):
    cache.host_pool.alloc(4)


def misplace_a_node(cache):
    serve(cache, A[:8] + B)                               # splits A's node: a copy of B's pages below its first two
    next(n for n in cache.tree.nodes() if n.key[0] == B[0] and n.parent.key).depth += 4


CORRUPTIONS = [
    (share_a_device_page, "a device page is held by two nodes"),
    (misplace_a_node, "depth 20, not its parent's 8 plus its key"),
    (share_a_host_slot, "a host slot is held by two nodes"),
    (drop_a_parent_device_copy, "device not prefix-closed"),
    (leak_a_host_slot, "host slots leaked"),
]


def test_the_error_is_named_and_exported():
    assert issubclass(IntegrityError, RuntimeError)
    assert kvtier.IntegrityError is IntegrityError is kvtier.errors.IntegrityError


@pytest.mark.parametrize("corrupt, message", CORRUPTIONS)
def test_a_corrupted_state_raises_integrity_error(corrupt, message):
    cache = served()
    cache.check_integrity(engine_device_slots=0)
    corrupt(cache)
    with pytest.raises(IntegrityError, match=message):
        cache.check_integrity()


def test_leaked_device_slots_are_named():
    cache = served()
    cache.alloc_device(4)
    cache.check_integrity(engine_device_slots=4)
    with pytest.raises(IntegrityError, match="device slots leaked"):
        cache.check_integrity(engine_device_slots=0)


def test_a_node_of_a_partial_page_is_named():
    cache = served()
    node = node_of(cache, B[0])
    node.key = node.key[:6]
    with pytest.raises(IntegrityError, match="not a positive number of whole pages"):
        cache.check_integrity()


def test_the_check_holds_under_python_O():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from tests.support.cache_engine import make_cache, serve; "
            "from kvtier import IntegrityError; c = make_cache(); serve(c, list(range(8))); c.flush(); "
            "c.host_pool.alloc(4)\n"
            "try:\n    c.check_integrity()\nexcept IntegrityError as e:\n    print('raised:', e)")
    out = subprocess.run([sys.executable, "-O", "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "raised: host slots leaked", out.stderr


@pytest.mark.parametrize("corrupt, message", CORRUPTIONS)
def test_with_kvtier_check_the_next_call_catches_a_corruption(monkeypatch, corrupt, message):
    monkeypatch.setenv("KVTIER_CHECK", "1")
    cache = served()
    corrupt(cache)
    with pytest.raises(IntegrityError, match=message):
        cache.evict_device(0)


def count_checks(monkeypatch):
    calls = []
    inner = CacheState.check_integrity
    monkeypatch.setattr(CacheState, "check_integrity", lambda self, *a: calls.append(a) or inner(self, *a))
    return calls


def test_with_kvtier_check_every_changing_call_checks_once(monkeypatch):
    monkeypatch.setenv("KVTIER_CHECK", "1")
    cache = make_cache()
    calls = count_checks(monkeypatch)
    m = cache.match_prefix(A)
    lease = cache.lock(m)
    slots = cache.alloc_device(12)
    cache.insert(A, slots)
    cache.unlock(lease)
    cache.flush()
    assert len(calls) == 6 and set(calls) == {()}        # never with the engine's slots
    cache.peek(A)
    cache.stats()
    assert len(calls) == 6                                # neither changes anything
    got = cache.acquire(A)
    cache.release(got)
    cache.evict_device(4)
    cache.evict_host(4)
    cache.load_back(cache.match_prefix(A))
    assert len(calls) == 12


def test_without_kvtier_check_no_call_checks(monkeypatch):
    monkeypatch.delenv("KVTIER_CHECK", raising=False)
    cache = make_cache()
    calls = count_checks(monkeypatch)
    serve(cache, A)
    cache.release(cache.acquire(A))
    cache.evict_device(64)
    cache.flush()
    assert calls == []


def test_the_constructor_argument_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_CHECK", "1")
    off = make_cache(check=False)
    monkeypatch.delenv("KVTIER_CHECK")
    on = make_cache(check=True)
    calls = count_checks(monkeypatch)
    off.match_prefix(A)
    assert calls == []
    on.match_prefix(A)
    assert calls == [()]
    with pytest.raises(ValueError, match="check must be a bool or None, got 'yes'"):
        make_cache(check="yes")


class GatedGets:
    """A storage whose ``batch_get`` waits for ``gate`` (a prefetch stays in flight)."""

    def __init__(self, inner):
        self.inner, self.gate, self.started = inner, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch_get(self, *args):
        self.started.set()
        self.gate.wait(10)
        return self.inner.batch_get(*args)


def test_a_prefetch_in_flight_is_not_a_host_leak(tmp_path):
    store = kvtier.storage.open(f"file://{tmp_path}")
    first = make_cache(storage=store)
    serve(first, A)
    first.flush()
    gated = GatedGets(store)
    cache = make_cache(storage=gated, check=True)
    handle = cache.prefetch(A)
    assert gated.started.wait(10)
    assert cache.stats()["host_fetching_tokens"] == 12 and cache.host_pool.available_size() == 64 - 12
    cache.evict_host(0)                                   # checks, with the slots outside the tree
    gated.gate.set()
    cache.flush()
    assert handle.done() and handle.tokens == 12 and cache.stats()["host_fetching_tokens"] == 0
    assert cache.peek(A).host_len == 12
    cache.check_integrity(engine_device_slots=0)
    cache.close()
    first.close()
    store.close()
