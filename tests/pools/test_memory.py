"""Pool allocations: page-aligned always; large CPU pools 2 MiB-aligned and advised onto
huge pages on Linux (unless KVTIER_HUGEPAGES=0); the bytes a pool holds are its own."""

import sys

import pytest
import torch

from kvtier import DeviceKVPool, HostKVPool, KVSpec
from kvtier.pools import memory
from kvtier.pools.memory import HUGE_MIN_BYTES, HUGE_PAGE, PAGE, pool_bytes

SPEC = KVSpec.mha(2, 2, 8, v_head_dim=4)


@pytest.mark.parametrize("make", [HostKVPool, DeviceKVPool])
def test_small_pools_start_on_a_page(make):
    for size in (4, 64, 1024):
        pool = make(SPEC, size, 4)
        assert pool.raw.data_ptr() % PAGE == 0
        for buf in pool.buffers.values() if hasattr(pool, "buffers") else ():
            assert buf.data_ptr() % PAGE == 0


def test_a_large_cpu_pool_is_on_huge_pages(monkeypatch):
    advised = []
    monkeypatch.setattr(memory, "_advise_huge", lambda address, n: advised.append((address, n)) or True)
    raw = pool_bytes(HUGE_MIN_BYTES + 12345, device=torch.device("cpu"))
    assert raw.numel() == HUGE_MIN_BYTES + 12345 and raw.data_ptr() % HUGE_PAGE == 0
    if sys.platform == "linux":
        assert advised == [(raw.data_ptr(), HUGE_MIN_BYTES)]  # whole huge pages only
    monkeypatch.setenv("KVTIER_HUGEPAGES", "0")
    advised.clear()
    raw = pool_bytes(HUGE_MIN_BYTES, device=torch.device("cpu"))
    assert advised == [] and raw.data_ptr() % PAGE == 0


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_the_advice_reaches_the_kernel_and_the_memory_works():
    raw = pool_bytes(HUGE_MIN_BYTES, device=torch.device("cpu"))
    if memory._madvise() is None:
        pytest.skip("this libc has no madvise")
    # the kernel takes the advice or refuses it (THP off: EINVAL); either way the bytes are ours
    memory._advise_huge(raw.data_ptr(), HUGE_PAGE)
    raw[::4096] = 7
    raw[-1] = 9
    assert torch.all(raw[:-1:4096] == 7) and int(raw[-1]) == 9


def test_pool_views_stay_inside_the_allocation_and_hold_their_bytes():
    pool = HostKVPool(SPEC, 64, 4, layout="page_head")
    pool.raw.fill_(0)
    for i, buf in enumerate(pool.buffers.values()):
        buf.view(-1).view(torch.uint8).fill_(i + 1)
    counts = torch.bincount(pool.raw, minlength=3).tolist()
    assert counts[1:3] == [b.numel() * b.element_size() for b in pool.buffers.values()]
    start, end = pool.raw.data_ptr(), pool.raw.data_ptr() + pool.raw.numel()
    for buf in pool.buffers.values():
        assert start <= buf.data_ptr() and buf.data_ptr() + buf.numel() * buf.element_size() <= end
