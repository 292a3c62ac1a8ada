"""Several request threads and an evictor on one cache; bounded in count and time."""

import random
import threading
import time

from engine import PAGE, make_cache, serve
from invariants import check_invariants


def test_concurrent_requests_keep_kv_and_accounting_exact():
    cache = make_cache(device_tokens=64, host_tokens=48)
    errors, deadline = [], time.monotonic() + 30

    def requests(seed):
        rng = random.Random(seed)
        try:
            for _ in range(40):
                if time.monotonic() > deadline:
                    return
                ids = [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
                tokens = [(p * 10 + i) * PAGE + j for i, p in enumerate(ids) for j in range(PAGE)]
                serve(cache, tokens)        # checks every reused page bit for bit
        except BaseException as e:
            errors.append(e)

    def evictor():
        rng = random.Random(99)
        while time.monotonic() < deadline and any(t.is_alive() for t in workers):
            (cache.evict_device if rng.random() < 0.6 else cache.evict_host)(rng.randrange(4, 24))
            time.sleep(0.001)

    workers = [threading.Thread(target=requests, args=(s,)) for s in range(4)]
    for t in workers:
        t.start()
    ev = threading.Thread(target=evictor)
    ev.start()
    for t in workers + [ev]:
        t.join(timeout=60)
    cache.flush()
    assert not errors, errors[0]
    check_invariants(cache)
    stats = cache.stats()
    assert stats["matches"] == 160 and stats["device_hit_tokens"] + stats["host_hit_tokens"] > 0
    cache.close()
