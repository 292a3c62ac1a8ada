"""Request threads, an evictor and prefix splitters on one cache, with slow and failing
loads; bounded in count and time."""

import random
import threading
import time

import pytest

from tests.support.cache_engine import PAGE, make_cache, serve, serve_acquire
from tests.support.cache_faults import LoadFaults
from tests.support.cache_invariants import drained


def _prompt(rng) -> list[int]:
    ids = [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
    return [(p * 10 + i) * PAGE + j for i, p in enumerate(ids) for j in range(PAGE)]


def _run(threads, seconds=60):
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds)
    assert not any(t.is_alive() for t in threads), "a thread hung"


@pytest.mark.parametrize("request_kind", [serve, serve_acquire], ids=["match-lock-load", "acquire-commit"])
def test_concurrent_requests_keep_kv_and_accounting_exact(request_kind):
    cache = make_cache(device_tokens=64, host_tokens=48)
    errors, deadline = [], time.monotonic() + 30

    def requests(seed):
        rng = random.Random(seed)
        try:
            for _ in range(40):
                if time.monotonic() > deadline:
                    return
                request_kind(cache, _prompt(rng))  # checks every reused page bit for bit
        except BaseException as e:
            errors.append(e)

    def evictor():
        rng = random.Random(99)
        while time.monotonic() < deadline and any(t.is_alive() for t in workers):
            (cache.evict_device if rng.random() < 0.6 else cache.evict_host)(rng.randrange(4, 24))
            time.sleep(0.001)

    workers = [threading.Thread(target=requests, args=(s,)) for s in range(4)]
    _run(workers + [threading.Thread(target=evictor)])
    cache.flush()
    assert not errors, errors[0]
    cache.check_integrity(engine_device_slots=0)
    stats = cache.stats()
    assert stats["matches"] == 160 and stats["device_hit_tokens"] + stats["host_hit_tokens"] > 0
    assert drained(cache)
    cache.close()


def test_splits_during_slow_and_failing_loads():
    cache = make_cache(device_tokens=64, host_tokens=48, write_policy="write_back")
    loads = LoadFaults(cache)
    # NOTE: every fifth load fails, whatever the threads' timing: a failure injected at
    # random times by the splitter could take every load of a run (then none had loaded)
    loads.delay, loads.fail_every = 0.002, 5
    errors, stop = [], threading.Event()

    def requests(seed):
        rng = random.Random(seed)
        try:
            for _ in range(30):
                serve_acquire(cache, _prompt(rng))   # checks reused and committed KV bit for bit
        except BaseException as e:
            errors.append(e)

    def splitter():
        rng = random.Random(7)
        while not stop.is_set():
            prompt = _prompt(rng)
            cache.match_prefix(prompt[:PAGE * rng.randrange(1, 4)])   # cuts nodes, some mid-load
            (cache.evict_device if rng.random() < 0.5 else cache.evict_host)(rng.randrange(4, 16))
            time.sleep(0.001)

    workers = [threading.Thread(target=requests, args=(s,)) for s in range(4)]
    side = threading.Thread(target=splitter)
    side.start()
    _run(workers)
    stop.set()
    side.join(10)
    cache.flush()
    assert not errors, errors[0]
    cache.check_integrity(engine_device_slots=0)
    assert cache.stats()["loaded_tokens"] > 0 and cache.stats()["load_errors"] == loads.calls // 5
    assert drained(cache)
    cache.close()


def test_requests_over_faulty_storage_shared_by_two_caches(tmp_path):
    import kvtier.storage
    from tests.support.cache_faults import FaultyStore

    store = FaultyStore(kvtier.storage.open(f"file://{tmp_path}"))
    caches = [make_cache(device_tokens=32, host_tokens=32, storage=store, prefetch_policy="wait_complete",
                         storage_timeout=0.05) for _ in range(2)]
    errors, stop = [], threading.Event()

    def requests(seed):
        rng = random.Random(seed)
        try:
            for _ in range(25):
                serve_acquire(caches[seed % 2], _prompt(rng))   # every reused page checked bit for bit
        except BaseException as e:
            errors.append(e)

    def saboteur():
        rng = random.Random(11)
        while not stop.is_set():
            for fault in ("raise_exists", "raise_get", "raise_set", "short_get"):
                setattr(store, fault, rng.random() < 0.3)
            store.exists_delay = 0.1 if rng.random() < 0.1 else 0.0
            time.sleep(0.005)

    side = threading.Thread(target=saboteur)
    side.start()
    _run([threading.Thread(target=requests, args=(s,)) for s in range(4)])
    stop.set()
    side.join(10)
    assert not errors, errors[0]
    assert sum(c.stats()["errors"] for c in caches) > 0      # the faults did happen
    for cache in caches:
        cache.flush()
        cache.check_integrity(engine_device_slots=0)
        assert drained(cache)
        cache.close()
