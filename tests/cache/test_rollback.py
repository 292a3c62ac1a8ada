"""Failing loads, failing, malformed and slow storage, closing: every fault rolls back,
counts one error and never hands out unfilled KV or leaks a slot."""

import threading

import pytest

import kvtier.storage
from kvtier import CacheClosedError
from tests.support.cache_engine import NAMESPACE, PAGE, check_prefix, make_cache, serve
from tests.support.cache_faults import FaultyStore, LoadFaults
from tests.support.cache_invariants import drained

A = list(range(100, 116))  # 4 pages


def hits(m):
    return (m.device_len, m.host_len, m.storage_len)


def on_host_only(fail=0, gate=None):
    """A cache holding A on the host only, with its loads' faults to set."""
    cache = make_cache()
    serve(cache, A)
    cache.flush()
    cache.evict_device(64)
    faults = LoadFaults(cache)
    faults.fail, faults.gate = fail, gate
    return cache, faults


def settled(cache) -> bool:
    cache.check_integrity(engine_device_slots=0)
    return drained(cache)


def test_a_failed_load_leaves_no_device_hit():
    cache, _ = on_host_only(fail=1)
    got = cache.acquire(A)                                   # the load fails: nothing is reused
    assert (got.device_hit, got.host_hit, got.device_indices.numel()) == (0, 0, 0)
    cache.release(got)
    assert hits(cache.match_prefix(A)) == (0, 16, 0)          # back to host-only, not a device hit
    again = cache.acquire(A)
    assert (again.device_hit, again.host_hit) == (0, 16)
    check_prefix(cache, A, again.device_indices)
    cache.release(again)
    stats = cache.stats()
    assert (stats["errors"], stats["load_errors"]) == (1, 1)
    assert settled(cache)


def test_a_failed_load_surfaces_on_the_handle_and_on_requests_that_waited_for_it():
    cache, faults = on_host_only(fail=1, gate=threading.Event())
    first = cache.acquire(A, wait=False)
    faults.started.wait(10)
    second = cache.acquire(A, wait=False)                    # a device hit on pages still loading
    assert second.device_hit == 16
    faults.gate.set()
    assert first.load.wait(10) and second.load.wait(10)
    assert first.load.error is not None and second.load.error is not None
    for got in (first, second):
        cache.release(got)
    assert hits(cache.match_prefix(A)) == (0, 16, 0)
    assert settled(cache)



def test_a_commit_while_its_load_is_in_flight_waits_and_refuses_a_failed_one():
    """An engine that commits before its prefix's load has settled (it did not wait on
    every layer) gets the load's outcome first: the commit waits for it, and a failed
    load refuses the commit, so the KV computed over a prefix that never arrived is not
    cached (before, the commit was taken while the load ran, and the later failure
    left the pages computed over it a hit)."""
    import torch

    from tests.support.cache_engine import compute

    cache, faults = on_host_only(fail=1, gate=threading.Event())
    tokens = A + list(range(500, 508))  # A (host only) and two pages of its own
    got = cache.acquire(tokens, wait=False)
    assert faults.started.wait(10) and not got.load.done()
    slots = cache.alloc_device(8)
    compute(cache, tokens, torch.cat([got.device_indices, slots]), 16)
    threading.Timer(0.2, faults.gate.set).start()  # fails once the commit is waiting
    with pytest.raises(ValueError, match="failed to load"):
        cache.commit(got, tokens, slots)
    cache.release(got)
    cache.free_device(slots)
    assert hits(cache.match_prefix(tokens)) == (0, 16, 0)  # A on the host as before; its tail not cached
    assert settled(cache)

def test_a_split_during_a_load_leaks_nothing():
    cache, faults = on_host_only(gate=threading.Event())
    m = cache.match_prefix(A)
    lease = cache.lock(m)
    handle = cache.load_back(m)
    faults.started.wait(10)
    assert hits(cache.match_prefix(A[:8])) == (8, 0, 0)     # splits the node being loaded
    faults.gate.set()
    assert handle.wait(10) and handle.error is None
    check_prefix(cache, A, handle.device_indices)
    cache.unlock(lease)
    assert settled(cache)


def test_a_failed_storage_write_unpins_and_counts(store):
    faulty = FaultyStore(store)
    faulty.raise_set = True
    cache = make_cache(storage=faulty)
    serve(cache, A)
    cache.flush()
    stats = cache.stats()
    assert (stats["stored_tokens"], stats["store_errors"], stats["errors"]) == (0, 1, 1)
    assert store.batch_exists(kvtier.storage.page_keys(A, PAGE, NAMESPACE)) == 0
    assert drained(cache)
    faulty.raise_set = False                                 # the pages are written when next backed up
    serve(cache, A)
    cache.flush()
    assert cache.stats()["stored_tokens"] == 16


def test_storage_exists_faults_are_misses(store):
    first = make_cache(storage=store)
    serve(first, A)
    first.flush()
    faulty = FaultyStore(store)
    cache = make_cache(storage=faulty, storage_timeout=0.2)
    for fault in ("raise", "negative", "too_many", "slow"):
        faulty.raise_exists = fault == "raise"
        faulty.exists_answer = {"negative": -1, "too_many": 10 ** 6}.get(fault)
        faulty.exists_gate = threading.Event() if fault == "slow" else None
        assert hits(cache.match_prefix(A)) == (0, 0, 0), fault
        got = cache.acquire(A)
        assert got.device_indices.numel() == 0
        cache.release(got)
        if faulty.exists_gate is not None:
            faulty.exists_gate.set()
    cache.flush()                                            # the slow call has returned
    stats = cache.stats()
    assert stats["storage_exists_errors"] >= 8 and stats["errors"] == stats["storage_exists_errors"]
    healthy = make_cache(storage=faulty)                     # the default timeout: no race with a busy machine
    assert hits(healthy.match_prefix(A)) == (0, 0, 16)      # the same storage, healthy again


@pytest.mark.parametrize("fault", ["raise_get", "short_get"])
def test_storage_read_faults_are_misses(store, fault):
    first = make_cache(storage=store)
    serve(first, A)
    first.flush()
    faulty = FaultyStore(store)
    setattr(faulty, fault, True)
    cache = make_cache(storage=faulty, prefetch_policy="wait_complete")
    got = cache.acquire(A)
    assert (got.storage_hit, got.device_indices.numel()) == (0, 0)
    cache.release(got)
    assert cache.stats()["storage_read_errors"] == 1
    assert cache.host_pool.available_size() == cache.host_pool.size
    cache.check_integrity(engine_device_slots=0)


def test_a_slow_store_pins_only_host_copies(store):
    faulty = FaultyStore(store)
    faulty.set_gate = threading.Event()
    cache = make_cache(storage=faulty)
    serve(cache, A)
    assert faulty.set_started.wait(10)                       # the write of A is running, and hangs
    assert cache.evict_device(64) == 16                      # the device copy is free to go
    assert hits(cache.match_prefix(A)) == (0, 16, 0)         # and the host copy still serves
    assert cache.evict_host(64) == 0                         # the host copy is what is being written
    faulty.set_gate.set()
    cache.flush()
    assert cache.stats()["stored_tokens"] == 16
    assert drained(cache)


def test_backups_run_off_the_callers_thread_and_lock():
    cache = make_cache()
    gate, started, seen = threading.Event(), threading.Event(), []
    inner = cache.host_pool.backup_from_device_all_layer

    def slow_backup(*args):
        seen.append(threading.current_thread())
        started.set()
        gate.wait(10)
        return inner(*args)

    cache.host_pool.backup_from_device_all_layer = slow_backup
    serve(cache, A)                                          # returns while the backup waits
    assert started.wait(10)
    other = threading.Thread(target=cache.match_prefix, args=(A,))
    other.start()
    other.join(5)
    assert not other.is_alive(), "match_prefix blocked behind a backup"
    assert seen and seen[0] is not threading.current_thread()
    freed = []
    evictor = threading.Thread(target=lambda: freed.append(cache.evict_device(64)))
    evictor.start()
    evictor.join(0.3)
    assert evictor.is_alive() and not freed                  # a page being backed up stays until its copy lands
    gate.set()
    evictor.join(10)
    assert freed == [16]
    assert hits(cache.match_prefix(A)) == (0, 16, 0)         # demoted to the copy that landed
    got = cache.acquire(A)                                   # and the copy holds the right bytes
    check_prefix(cache, A, got.device_indices)
    cache.release(got)


def test_every_call_after_close_raises(store):
    cache = make_cache(storage=store)
    serve(cache, A)
    m = cache.match_prefix(A)
    cache.close()
    cache.close()                                            # closing twice is fine
    calls = [lambda: cache.acquire(A), lambda: cache.insert(A, cache.device_pool.alloc(16)),
             cache.flush, cache.stats, lambda: cache.match_prefix(A), lambda: cache.lock(m),
             lambda: cache.load_back(m), lambda: cache.prefetch(A), lambda: cache.alloc_device(4),
             lambda: cache.evict_device(4), lambda: cache.evict_host(4)]
    for call in calls:
        done = []
        t = threading.Thread(target=lambda: done.append(_raises(call)))
        t.start()
        t.join(5)
        assert done == [True], "a call after close() hung or did not raise CacheClosedError"


def _raises(call) -> bool:
    try:
        call()
    except CacheClosedError:
        return True
    return False


def test_a_storage_that_keeps_failing_warns_once_per_interval(store, caplog):
    faulty = FaultyStore(store)
    faulty.raise_exists = True
    cache = make_cache(storage=faulty)
    with caplog.at_level("WARNING", logger="kvtier.cache"):
        for _ in range(50):
            assert hits(cache.match_prefix(A)) == (0, 0, 0)
    assert cache.stats()["storage_exists_errors"] == 50
    assert len([r for r in caplog.records if "batch_exists raised" in r.getMessage()]) <= 1
