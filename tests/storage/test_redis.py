"""Redis backend: a server that dies or hangs mid-run turns into misses (fast, once the
breaker is open), and works again when back; hostile values; options in the URL."""

import os
import signal
import time

import pytest
import torch

import kvtier.storage
from kvtier import HostKVPool
from tests.support.pools import SPECS
from tests.support.services import RedisServer
from tests.support.storage import PeakRSS, filled_host, flat_pages

SPEC = SPECS["asym"]


def keys_for(n, start=0):
    return kvtier.storage.page_keys(list(range(start, start + 4 * n)), 4, namespace="m")


def test_killed_server_gives_misses_then_hits_after_restart():
    server = RedisServer().start()
    try:
        host, idx = filled_host(SPEC, 3)
        # backoff=0: no breaker, so the first call after the restart reconnects
        store = kvtier.storage.open(server.url, socket_timeout=1.0, socket_connect_timeout=0.5, backoff=0)
        keys = keys_for(3)
        assert store.batch_set(keys, host, idx) == [True] * 3
        server.stop()
        assert store.batch_exists(keys) == 0
        assert store.batch_get(keys, host, idx) == [False] * 3
        assert store.batch_set(keys, host, idx) == [False] * 3
        store.delete(keys)
        errors = store.stats()["errors"]
        assert errors >= 4
        server.start()  # same port, empty (no persistence): write again, then read
        assert store.batch_set(keys, host, idx) == [True] * 3
        reader, ridx = filled_host(SPEC, 3, seed=9)
        assert store.batch_get(keys, reader, ridx) == [True] * 3
        assert all(torch.equal(a, b) for a, b in zip(flat_pages(host, idx), flat_pages(reader, ridx)))
        assert store.stats()["errors"] == errors
    finally:
        server.stop()


def test_corrupt_value_is_a_miss_and_is_deleted(redis_server):
    import redis

    host, idx = filled_host(SPEC, 1)
    store = kvtier.storage.open(redis_server.url, prefix="corrupt:")
    key = keys_for(1)
    store.batch_set(key, host, idx)
    raw = redis.Redis.from_url(redis_server.url)
    fields = raw.hkeys(f"corrupt:{key[0]}")
    value = bytearray(raw.hget(f"corrupt:{key[0]}", fields[0]))
    value[100] ^= 1
    raw.hset(f"corrupt:{key[0]}", fields[0], bytes(value))
    assert store.batch_get(key, host, idx) == [False]
    assert store.stats()["corrupt"] == 1 and not raw.hexists(f"corrupt:{key[0]}", fields[0])
    store.clear()


def test_ttl_expires_whole_pages(redis_server):
    host, idx = filled_host(SPEC, 1)
    store = kvtier.storage.open(redis_server.url, prefix="ttl:", ttl=1)
    store.batch_set(keys_for(1), host, idx)
    assert store.batch_exists(keys_for(1)) == 1
    deadline = time.monotonic() + 5
    while store.batch_exists(keys_for(1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.batch_exists(keys_for(1)) == 0
    with pytest.raises(ValueError, match="ttl"):
        kvtier.storage.open(redis_server.url, ttl=-1)


def test_clear_removes_only_its_prefix(redis_server):
    host, idx = filled_host(SPEC, 1)
    a = kvtier.storage.open(redis_server.url, prefix="a:")
    b = kvtier.storage.open(redis_server.url, prefix="b:")
    a.batch_set(keys_for(1), host, idx)
    b.batch_set(keys_for(1), host, idx)
    a.clear()
    assert a.batch_exists(keys_for(1)) == 0 and b.batch_exists(keys_for(1)) == 1
    b.clear()


def test_clear_reads_its_prefix_as_text_not_as_a_pattern(redis_server):
    """SCAN's MATCH reads ``* ? [ ]`` and ``\\`` as a pattern: a prefix holding them is
    matched as it is written, so a clear removes its own keys and no other tenant's
    (before, ``t[1]:`` cleared ``t1:`` and kept its own, and ``t?`` cleared ``tX``); an
    empty prefix, every key of the database, is refused."""
    host, idx = filled_host(SPEC, 1)
    stores = {p: kvtier.storage.open(redis_server.url, prefix=p) for p in ("t[1]:", "t1:", "t?", "tX", "t*\\")}
    for store in stores.values():
        assert store.batch_set(keys_for(1), host, idx) == [True]
    gone = []
    for cleared in ("t[1]:", "t?", "t*\\"):
        stores[cleared].clear()
        gone.append(cleared)
        assert {p: s.batch_exists(keys_for(1)) for p, s in stores.items()} == {p: int(p not in gone) for p in stores}
    for store in stores.values():
        store.clear()
    with pytest.raises(ValueError, match="prefix must not be empty"):
        kvtier.storage.open(redis_server.url, prefix="")


def test_an_emptied_value_is_a_counted_corrupt_miss_and_is_deleted(redis_server):
    """A stored part emptied to zero bytes is a damaged object, not a missing one: counted
    corrupt and deleted, so lookups stop reporting the page (before, it missed uncounted
    and stayed present to every lookup)."""
    import redis

    host, idx = filled_host(SPEC, 1)
    store = kvtier.storage.open(redis_server.url, prefix="emptied:")
    key = keys_for(1)
    store.batch_set(key, host, idx)
    raw = redis.Redis.from_url(redis_server.url)
    field = raw.hkeys(f"emptied:{key[0]}")[0]
    raw.hset(f"emptied:{key[0]}", field, b"")
    assert store.batch_get(key, host, idx) == [False]
    assert (store.stats()["corrupt"], store.stats()["errors"]) == (1, 1)
    assert not raw.hexists(f"emptied:{key[0]}", field)
    store.clear()


def test_redis_cluster_round_trip():
    from tests.support.services import RedisCluster

    cluster = RedisCluster().start()
    try:
        host, idx = filled_host(SPEC, 6)
        store = kvtier.storage.open(cluster.url)
        keys = keys_for(6)
        assert store.batch_set(keys, host, idx) == [True] * 6
        assert store.batch_exists(keys) == 6
        reader, ridx = filled_host(SPEC, 6, seed=3, layout="page_head")
        assert store.batch_get(keys, reader, ridx) == [True] * 6
        assert all(torch.equal(a, b) for a, b in zip(flat_pages(host, idx), flat_pages(reader, ridx)))
        import redis

        spread = [redis.Redis(port=n.port).dbsize() for n in cluster.nodes]
        assert sum(spread) == 6 and sum(1 for n in spread if n) >= 2, spread  # pages spread over the masters
        store.clear()
        assert store.batch_exists(keys) == 0
        store.close()
    finally:
        cluster.stop()


def test_rediss_tls_round_trip():
    server = RedisServer(tls=True).start()
    try:
        host, idx = filled_host(SPEC, 2)
        store = kvtier.storage.open(server.url, client_options={"ssl_ca_certs": server.ca_file})
        assert store.batch_set(keys_for(2), host, idx) == [True, True]
        reader, ridx = filled_host(SPEC, 2, seed=5)
        assert store.batch_get(keys_for(2), reader, ridx) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(flat_pages(host, idx), flat_pages(reader, ridx)))
        untrusting = kvtier.storage.open(server.url, socket_connect_timeout=1.0)  # no CA: the handshake fails
        assert untrusting.batch_exists(keys_for(2)) == 0 and untrusting.stats()["errors"] >= 1
        store.close()
        untrusting.close()
    finally:
        server.stop()


def test_hung_server_fails_fast_for_the_backoff_then_hits_again():
    """A server stopped with SIGSTOP costs one socket timeout; for the backoff after it,
    calls are misses and counted errors without waiting on the network."""
    server = RedisServer().start()
    timeout = 1.0
    try:
        host, idx = filled_host(SPEC, 2)
        store = kvtier.storage.open(server.url, socket_timeout=timeout, socket_connect_timeout=timeout, backoff=3.0)
        keys = keys_for(2)
        assert store.batch_set(keys, host, idx) == [True, True]
        reader, ridx = filled_host(SPEC, 2, seed=9)
        before = [p.clone() for p in flat_pages(reader, ridx)]
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            assert store.batch_get(keys, reader, ridx) == [False, False]  # waits out one socket timeout
            errors = store.stats()["errors"]
            t0 = time.monotonic()
            assert store.batch_get(keys, reader, ridx) == [False, False]
            assert store.batch_exists(keys) == 0
            assert store.batch_set(keys, host, idx) == [False, False]
            elapsed = time.monotonic() - t0
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert elapsed < timeout / 2, f"calls within the backoff took {elapsed:.2f}s: they waited on the server"
        assert store.stats()["errors"] >= errors + 3
        assert all(torch.equal(a, b) for a, b in zip(before, flat_pages(reader, ridx)))
        deadline = time.monotonic() + 30  # the backoff passes, then a call reaches the server again
        while (got := store.batch_get(keys, reader, ridx)) != [True, True] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert got == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(flat_pages(host, idx), flat_pages(reader, ridx)))
        store.close()
    finally:
        server.stop()


def test_an_oversized_value_is_never_fetched(redis_server):
    """A 64 MiB value planted in a page's field is a counted miss; its length is read
    first, so the client never receives it."""
    import redis

    host, idx = filled_host(SPEC, 2)
    store = kvtier.storage.open(redis_server.url, prefix="big:")
    keys = keys_for(2)
    store.batch_set(keys, host, idx)
    raw = redis.Redis.from_url(redis_server.url)
    name = f"big:{keys[0]}"
    field = sorted(raw.hkeys(name))[0]
    size = 64 << 20
    # made by the server itself, so that this process never holds the value either
    raw.eval("redis.call('HSET', KEYS[1], ARGV[1], string.rep('x', tonumber(ARGV[2])))", 1, name, field, size)
    assert raw.hstrlen(name, field) == size
    reader = HostKVPool(SPEC, 8, 4)
    ridx = reader.alloc(8)
    before = [p.clone() for p in flat_pages(reader, ridx)]
    with PeakRSS() as rss:
        assert store.batch_get(keys, reader, ridx) == [False, True]
    assert rss.growth < size // 4, f"peak RSS grew by {rss.growth >> 20} MiB"
    assert torch.equal(flat_pages(reader, ridx)[0], before[0])
    assert torch.equal(flat_pages(reader, ridx)[1], flat_pages(host, idx)[1])
    assert store.stats()["errors"] == 1 and store.stats()["corrupt"] == 0
    raw.delete(f"big:{keys[1]}")
    raw.set(f"big:{keys[1]}", b"not a hash")  # another type at the key: a counted miss too
    assert store.batch_get(keys[1:], reader, ridx[4:]) == [False]
    assert store.stats()["errors"] == 1 + 4  # one per part of the page (4 head groups)
    store.clear()


def test_url_options_apply(redis_server):
    import redis

    url = (f"{redis_server.url}?ttl=60&socket_timeout=0.5&socket_connect_timeout=0.25&backoff=1.5&prefix=opt:"
           f"&io_threads=1")
    store = kvtier.storage.open(url)
    host, idx = filled_host(SPEC, 2)
    keys = keys_for(2)
    assert store.batch_set(keys, host, idx) == [True, True]
    raw = redis.Redis.from_url(redis_server.url)
    assert 0 < raw.ttl(f"opt:{keys[0]}") <= 60
    reader, ridx = filled_host(SPEC, 2, seed=7)
    assert store.batch_get(keys, reader, ridx) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(host, idx), flat_pages(reader, ridx)))
    pool_kwargs = store._client.connection_pool.connection_kwargs
    assert (pool_kwargs["socket_timeout"], pool_kwargs["socket_connect_timeout"]) == (0.5, 0.25)
    assert (store._breaker.backoff, store.io_threads, store.stats()["errors"]) == (1.5, 1, 0)
    store.clear()
    store.close()


@pytest.mark.parametrize("suffix, match", [
    ("/0?ttl=soon", "ttl='soon' is not a int"),
    ("/0?ttl=0", "ttl must be a int >= 1"),
    ("/0?socket_timeout=nan", "socket_timeout must be a number >= 0.001"),
    ("/0?backoff=-1", "backoff must be a number >= 0"),
    ("/0?colour=blue", "unknown URL option 'colour'; supported URL options: backoff, head_groups, io_threads, "
                       "page_size, prefix, socket_connect_timeout, socket_timeout, ttl"),
    ("/0?db=3", "unknown URL option 'db'"),
    ("/99", "DB index is out of range"),
    ("/x", "the path must be /<database index>, a non-negative int; got /x"),
    ("/-1", "got /-1"),
])
def test_bad_options_and_database_index_fail_at_open(redis_server, suffix, match):
    with pytest.raises(ValueError, match=match):
        kvtier.storage.open(redis_server.url.rsplit("/", 1)[0] + suffix)


def test_server_down_at_open_is_a_counted_miss():
    from tests.support.services import free_port

    for url in (f"redis://127.0.0.1:{free_port()}/0", f"redis+cluster://127.0.0.1:{free_port()}"):
        store = kvtier.storage.open(url, socket_connect_timeout=0.5)
        host, idx = filled_host(SPEC, 1)
        assert store.batch_set(keys_for(1), host, idx) == [False]
        assert store.batch_get(keys_for(1), host, idx) == [False]
        assert store.batch_exists(keys_for(1)) == 0
        assert store.stats()["errors"] >= 3
        store.close()
