"""Fault plumbing shared by the backends: the circuit breaker and the warning rate limiter."""

import logging
from pathlib import Path

import pytest

import kvtier.storage
from kvtier.storage.faults import BackendDown, Breaker, WarningLimiter
from tests.support.pools import SPECS
from tests.support.storage import filled_host


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_refuses_calls_for_the_backoff():
    clock = Clock()
    breaker = Breaker(5.0, clock)
    breaker.check()  # closed
    breaker.trip(TimeoutError("Timeout reading from socket"))
    clock.now += 4.9
    with pytest.raises(BackendDown, match="failing fast for 0.1s more after: TimeoutError: Timeout reading"):
        breaker.check()
    assert breaker.is_open()
    clock.now += 0.1
    breaker.check()
    assert not breaker.is_open()
    off = Breaker(0.0, clock)
    off.trip("down")
    off.check()


def test_limiter_logs_each_kind_once_per_interval_with_a_count(caplog):
    clock = Clock()
    limiter = WarningLimiter(logging.getLogger("kvtier.storage"), interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage"):
        for i in range(100):
            limiter.warn(("write", "OSError", 28), "write failed: %s", f"/d/{i}.tmp")
        limiter.warn(("read", "OSError", 40), "read failed")
        clock.now += 10.0
        limiter.warn(("write", "OSError", 28), "write failed: %s", "/d/last.tmp")
        limiter.warn(("write", "OSError", 28), "write failed: %s", "/d/later.tmp")
        limiter.flush()
    assert [r.getMessage() for r in caplog.records] == [
        "write failed: /d/0.tmp",
        "read failed",
        "write failed: /d/last.tmp (repeated 99 times in the last 10s, not shown)",
        "kvtier storage: ('write', 'OSError', 28) repeated 1 more times, not shown",
    ]


def test_a_failing_disk_warns_once_and_counts_every_fault(tmp_path, caplog):
    host, idx = filled_host(SPECS["asym"], 1)
    store = kvtier.storage.open(f"file://{tmp_path}")
    clock = Clock()
    store._warnings.clock = clock
    keys = kvtier.storage.page_keys(list(range(4)), 4, namespace="m")
    Path(store._stem(keys[0])).parent.write_text("a file where the key's shard directory should be")
    with caplog.at_level(logging.WARNING, logger="kvtier.storage"):
        for _ in range(50):
            assert store.batch_set(keys, host, idx) == [False]
        clock.now += 60
        assert store.batch_set(keys, host, idx) == [False]
    messages = [r.getMessage() for r in caplog.records if r.name == "kvtier.storage"]
    assert len(messages) == 2, messages
    assert "write failed: NotADirectoryError" in messages[0]
    assert "(repeated 49 times in the last 60s, not shown)" in messages[1]  # one object a page
    assert store.stats()["errors"] == 51 and store.stats()["write_failures"] == 51
