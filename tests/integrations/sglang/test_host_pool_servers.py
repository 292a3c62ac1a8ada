"""kvtier host pools with a real Mooncake master on loopback: kvtier's ``mooncake://``
backend and sglang's own Mooncake backend (tests/support/services.py starts the master; a
missing one skips, or fails under KVTIER_REQUIRE_SERVICES=1)."""

import os

import pytest

pytest.importorskip("sglang")

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every fault at INFO/WARNING

import torch  # noqa: E402

from kvtier.integrations.sglang import KVTierMHAHostPool, install_host_pool, uninstall_host_pool  # noqa: E402
from tests.support.services import MooncakeMaster  # noqa: E402
from tests.support.sglang_rig import (PAGE_SIZE, attach, backup, bits, device_pool, fill_random,  # noqa: E402
                                      kvtier_config, pools, prefetch, sglang_pool, token_major)

PAGES = 6
TOKENS = list(range(11000, 11000 + PAGES * PAGE_SIZE))


@pytest.fixture(scope="module")
def master():
    server = MooncakeMaster().start()
    yield server
    server.stop()


@pytest.fixture
def installed():
    install_host_pool()
    yield
    uninstall_host_pool()


def same_heads(reader, dst, writer, src, reader_heads, writer_heads):
    return all(torch.equal(bits(token_major(reader, n)[dst][:, :, reader_heads]),
                           bits(token_major(writer, n)[src][:, :, writer_heads])) for n in ("k", "v"))


def test_kvtier_mooncake_shares_asymmetric_page_head_pages_across_tp_sizes(master, installed):
    """Prefill at tp 2 writes zero-copy head groups; decode at tp 1 and tp 4 reads them."""
    heads, writers, controllers = 8, [], []
    for rank in range(2):
        device, host = pools("page_head", head_num=heads // 2)
        assert type(host) is KVTierMHAHostPool
        fill_random(host, seed=50 + rank)
        controller = attach(device, host, extra_config=kvtier_config(master.url), tp_rank=rank, tp_size=2)
        src = host.alloc(PAGES * PAGE_SIZE)
        assert backup(controller, src, TOKENS) == PAGES * PAGE_SIZE
        writers.append((host, src))
        controllers.append(controller)  # NOTE: a writer's objects live in its mounted segment: keep it attached
    for tp_size in (1, 4):
        per = heads // tp_size
        for rank in range(tp_size):
            device, host = pools("page_head", head_num=per)
            controller = attach(device, host, extra_config=kvtier_config(master.url), tp_rank=rank, tp_size=tp_size)
            hit, pages, dst = prefetch(controller, host, TOKENS)
            assert (hit, pages) == (PAGES * PAGE_SIZE, PAGES)
            for w, (whost, wsrc) in enumerate(writers):
                lo, hi = max(rank * per, 4 * w), min((rank + 1) * per, 4 * w + 4)
                if lo < hi:
                    assert same_heads(host, dst, whost, wsrc, slice(lo - rank * per, hi - rank * per),
                                      slice(lo - 4 * w, hi - 4 * w))
            controllers.append(controller)
    for c in controllers:
        c.detach_storage_backend()


def sglang_mooncake(master) -> dict:
    return {"master_server_address": f"127.0.0.1:{master.rpc_port}",
            "metadata_server": f"http://127.0.0.1:{master.http_port}/metadata", "protocol": "tcp",
            "global_segment_size": 64 << 20, "check_server": False, "local_hostname": "127.0.0.1"}


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_sglangs_mooncake_backend_mixes_sglang_and_kvtier_asymmetric_pools(master, layout):
    """sglang's own Mooncake backend, zero-copy: pages an sglang pool wrote are read by
    a kvtier pool, and the other way round (the same spans, the same bytes)."""
    device = device_pool(head_num=4, head_dim=16, v_head_dim=8)
    theirs = sglang_pool(layout, device)
    install_host_pool()
    try:
        ours = pools(layout, head_num=4)[1]
    finally:
        uninstall_host_pool()
    assert type(ours) is KVTierMHAHostPool
    attached = []
    for writer, reader, salt in ((theirs, ours, 0), (ours, theirs, 1)):
        tokens = [t + salt * 100000 for t in TOKENS]
        fill_random(writer, seed=60 + salt)
        wc = attach(device, writer, backend="mooncake", extra_config=sglang_mooncake(master))
        src = writer.alloc(PAGES * PAGE_SIZE)
        assert backup(wc, src, tokens) == PAGES * PAGE_SIZE
        rc = attach(device, reader, backend="mooncake", extra_config=sglang_mooncake(master))
        hit, pages, dst = prefetch(rc, reader, tokens)
        assert (hit, pages) == (PAGES * PAGE_SIZE, PAGES)
        assert same_heads(reader, dst, writer, src, slice(None), slice(None))
        attached += [wc, rc]
    for c in attached:
        c.detach_storage_backend()


def test_sglangs_mooncake_split_heads_shares_asymmetric_pages_from_tp2_to_tp4(master, installed):
    """The failure that started kvtier: sglang's own Mooncake backend with tp_lcm_size,
    prefill at tp 2 writing head groups (get_split_heads_page_buffer_meta by 2),
    decode at tp 4 reading its own heads, for head_dim != v_head_dim."""
    heads, writers, attached = 8, [], []
    config = {**sglang_mooncake(master), "tp_lcm_size": 4}
    for rank in range(2):
        device, host = pools("page_head", head_num=heads // 2)
        fill_random(host, seed=70 + rank)
        controller = attach(device, host, backend="mooncake", extra_config=config, tp_rank=rank, tp_size=2)
        assert controller.storage_config.should_split_heads
        src = host.alloc(PAGES * PAGE_SIZE)
        assert backup(controller, src, TOKENS) == PAGES * PAGE_SIZE
        writers.append((host, src))
        attached.append(controller)
    for rank in range(4):
        device, host = pools("page_head", head_num=heads // 4)
        controller = attach(device, host, backend="mooncake", extra_config=config, tp_rank=rank, tp_size=4)
        hit, pages, dst = prefetch(controller, host, TOKENS)
        assert (hit, pages) == (PAGES * PAGE_SIZE, PAGES)
        whost, wsrc = writers[rank // 2]
        first = rank % 2 * 2
        assert same_heads(host, dst, whost, wsrc, slice(None), slice(first, first + 2))
        attached.append(controller)
    for c in attached:
        c.detach_storage_backend()
