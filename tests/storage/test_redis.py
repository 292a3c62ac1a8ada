"""Redis backend: a server that dies mid-run turns into misses, and works again when back."""

import time

import pytest
import torch

import kvtier.storage
from helpers import SPECS
from services import RedisServer
from storage_helpers import filled_host, flat_pages

SPEC = SPECS["asym"]


def keys_for(n, start=0):
    return kvtier.storage.page_keys(list(range(start, start + 4 * n)), 4, namespace="m")


def test_killed_server_gives_misses_then_hits_after_restart():
    server = RedisServer().start()
    try:
        host, idx = filled_host(SPEC, 3)
        store = kvtier.storage.open(server.url, socket_timeout=1.0, socket_connect_timeout=0.5)
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


def test_redis_cluster_round_trip():
    from services import RedisCluster

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
