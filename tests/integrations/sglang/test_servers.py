"""KVTierStorage with a real Redis server and a real Mooncake master, on loopback
(tests/support/services.py starts them; a missing one skips, or fails under
KVTIER_REQUIRE_SERVICES=1)."""

import os

import pytest

pytest.importorskip("sglang.srt")

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every fault at INFO/WARNING

from kvtier.integrations.sglang.pools import UnsupportedPoolError  # noqa: E402
from tests.support.services import MooncakeMaster, RedisServer  # noqa: E402
from tests.support.sglang_rig import (PAGE_SIZE, STORAGE_BATCH_SIZE, attach, backup, fill_random, kvtier_config,  # noqa: E402
                                      make_pools, prefetch, same_tokens)

PAGES = STORAGE_BATCH_SIZE + 3
TOKENS = list(range(9000, 9000 + PAGES * PAGE_SIZE))


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def mooncake_url():
    master = MooncakeMaster().start()
    yield master.url
    master.stop()


def round_trip(url, kind, write_layout, read_layout, tp_size=1, heads=2):
    """Every rank of ``tp_size`` backs up its pages; one full-width reader (tp 1) of
    ``read_layout`` loads them bit-exactly.

    NOTE: the writers stay attached until the end: a Mooncake client's objects live in
    the memory segment it mounted, which its close takes away."""
    sources, controllers = [], []
    for rank in range(tp_size):
        device, host = make_pools(kind, write_layout, tp_size=tp_size, heads=heads)
        fill_random(host, seed=20 + rank)
        controller = attach(device, host, extra_config=kvtier_config(url), tp_rank=rank, tp_size=tp_size)
        src = host.alloc(PAGES * PAGE_SIZE)
        if not controller.backup_skip:
            assert backup(controller, src, TOKENS) == PAGES * PAGE_SIZE
        sources.append((host, src))
        controllers.append(controller)
    device, host = make_pools(kind, read_layout, heads=heads)
    controller = attach(device, host, extra_config=kvtier_config(url))
    hit, pages, dst = prefetch(controller, host, TOKENS)
    assert (hit, pages) == (PAGES * PAGE_SIZE, PAGES)
    per_rank = heads // tp_size if kind != "mla" else None
    for rank, (source, src) in enumerate(sources[:1] if kind == "mla" else sources):
        heads_a = slice(None) if per_rank is None else slice(rank * per_rank, (rank + 1) * per_rank)
        assert same_tokens(host, dst, source, src, heads_a=heads_a)
    controller.storage_backend.clear()
    assert prefetch(controller, host, TOKENS)[:2] == (0, 0)
    for c in [*controllers, controller]:
        c.detach_storage_backend()


@pytest.mark.parametrize("kind, write_layout, read_layout, tp_size", [
    ("asym", "page_first", "page_first_direct", 1),
    ("asym", "page_first_direct", "page_first", 2),
    ("mha", "layer_first", "page_head", 2),
    ("mla", "page_unified", "layer_first", 1),
])
def test_redis(redis_url, kind, write_layout, read_layout, tp_size):
    round_trip(redis_url, kind, write_layout, read_layout, tp_size, heads=4)


@pytest.mark.parametrize("kind, write_layout, read_layout, tp_size", [
    ("mha", "page_first", "page_first", 1),
    ("mha", "page_head", "page_head", 2),     # zero-copy head groups: TP sizes share pages
    ("mla", "page_first_direct", "page_unified", 2),  # same bytes, same page format
    ("asym", "page_first", "page_first", 1),  # K and V in two allocations: both registered
])
def test_mooncake(mooncake_url, kind, write_layout, read_layout, tp_size):
    round_trip(mooncake_url, kind, write_layout, read_layout, tp_size, heads=4)


def test_mooncake_refuses_at_attach_what_it_cannot_store(mooncake_url):
    device, host = make_pools("mha", "page_first", tp_size=2, heads=4)
    with pytest.raises(UnsupportedPoolError, match="page_head"):
        attach(device, host, extra_config=kvtier_config(mooncake_url), tp_rank=0, tp_size=2)
