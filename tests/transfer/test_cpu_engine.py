"""The CPU copy engine: staged transposes, run splitting across threads, meta pools.

Every test compares bytes against the device pool it copied from (or the sentinel
content it must leave alone), never only shapes.
"""

import threading
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier import DeviceKVPool, HostKVPool, KVSpec
from kvtier.transfer import copy as copy_mod
from kvtier.transfer import coalesce, cpu
from kvtier.transfer import runs as runs_module
from tests.support.pools import LAYOUT_ORDERS, SPECS, bits, fill_random, random_device_pool, record_copy_threads, slots

FP8 = getattr(torch, "float8_e4m3fn", torch.uint8)


def _counting(monkeypatch):
    """Count staged pages (calls of ``staging_view``) of numpy's path, which this switches to
    (the compiled path, covered by test_native.py, copies without staging)."""
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    calls = []
    real = cpu.staging_view

    def spy(buffer, like):
        calls.append(like.shape)
        return real(buffer, like)

    monkeypatch.setattr(cpu, "staging_view", spy)
    return calls


def _round_trip(spec, layout, page_size, host_pages, src_pages, dst_pages, io_backend="direct", threads=None):
    """Backup ``src_pages`` into ``host_pages``, load them back layer by layer into ``dst_pages``
    of another pool; check the loaded bytes and that no other page of either pool changed."""
    n_dev = max(src_pages + dst_pages) + 2
    src = random_device_pool(spec, n_dev * page_size, page_size, seed=1)
    dst = random_device_pool(spec, n_dev * page_size, page_size, seed=2)
    host = HostKVPool(spec, (max(host_pages) + 2) * page_size, page_size, layout=layout, copy_threads=threads)
    gen = torch.Generator().manual_seed(3)
    for buf in host.buffers.values():
        fill_random(buf, gen)
    host_before = {n: bits(b).clone() for n, b in host.buffers.items()}
    dst_before = {n: [bits(dst.buffer(n, l)).clone() for l in range(spec.layer_num)] for n in spec.names}

    host.backup_from_device_all_layer(src, slots(host_pages, page_size), slots(src_pages, page_size), io_backend)
    page_axis = LAYOUT_ORDERS[layout].index("page")
    for n, buf in host.buffers.items():
        for p in range(host.num_pages):
            if p not in host_pages:
                assert torch.equal(bits(buf).select(page_axis, p), host_before[n].select(page_axis, p)), (n, p)
    for layer in range(spec.layer_num):
        host.load_to_device_per_layer(dst, slots(host_pages, page_size), slots(dst_pages, page_size), layer,
                                      io_backend)
    for n in spec.names:
        for layer in range(spec.layer_num):
            got, want = bits(dst.buffer(n, layer)), dst_before[n][layer].clone()
            want[slots(dst_pages, page_size)] = bits(src.buffer(n, layer))[slots(src_pages, page_size)]
            assert torch.equal(got, want), (n, layer)
    return host


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_staged_backup_is_exact(monkeypatch, spec_name, layout, io_backend):
    """A low staging threshold stages every transposing backup of the small test specs."""
    monkeypatch.setattr(cpu, "STAGE_BELOW_BYTES", 256)  # above each spec's common block
    monkeypatch.setattr(cpu, "STAGE_SOURCE_BYTES", 256)  # below its device page
    calls = _counting(monkeypatch)
    _round_trip(SPECS[spec_name], layout, 16, host_pages=[3, 0, 1, 5], src_pages=[6, 2, 3, 0],
                dst_pages=[1, 7, 4, 0], io_backend=io_backend)
    if io_backend == "direct" and layout in ("page_first", "page_head"):
        assert calls, "the transposing layouts must have gone through staging"


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8, torch.float32], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_reference_sized_pages_stage_by_default(monkeypatch, layout, dtype):
    """Pages as large as the reference spec's per layer (8 heads x 128 dims x 64 tokens of
    bf16 = 128 KiB) are staged at the default thresholds where the layout transposes in
    short blocks (page_head: one head row)."""
    calls = _counting(monkeypatch)
    spec = KVSpec.mha(2, 8, 128, v_head_dim=64, dtype=dtype)
    _round_trip(spec, layout, 64, host_pages=[2, 0, 3], src_pages=[1, 4, 0], dst_pages=[3, 2, 4])
    # page_first shares one token's heads: 8 x 64 V dims = 512 bytes only in fp8
    short_token_rows = torch.tensor([], dtype=dtype).element_size() == 1
    assert bool(calls) == (layout == "page_head" or (layout == "page_first" and short_token_rows))


def test_staging_grows_for_a_later_larger_component(monkeypatch):
    """Components in increasing page size: one thread's staging buffer must grow between them."""
    from kvtier import Component

    monkeypatch.setattr(cpu, "STAGE_BELOW_BYTES", 256)
    monkeypatch.setattr(cpu, "STAGE_SOURCE_BYTES", 256)
    calls = _counting(monkeypatch)
    spec = KVSpec(2, (Component("a", 1, 4), Component("b", 2, 8), Component("c", 4, 12)), torch.float32)
    _round_trip(spec, "page_head", 16, host_pages=[2, 0], src_pages=[1, 3], dst_pages=[0, 2], threads=1)
    assert len(calls) == 2 * 3


@pytest.mark.parametrize("native", ["0", "1"], ids=["numpy", "compiled"])
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_thread_split_of_long_and_odd_runs(monkeypatch, layout, threads, native):
    """Runs consecutive on both sides are cut into pieces so that every thread gets some;
    7 pages (odd) over 2, 3 and 5 threads, staged and direct, stay exact. numpy's path
    splits over the pool's kept Python threads, the compiled one in its own call."""
    monkeypatch.setenv("KVTIER_NATIVE", native)
    started, compiled = record_copy_threads(monkeypatch)
    monkeypatch.setattr(cpu, "STAGE_BELOW_BYTES", 256)
    monkeypatch.setattr(cpu, "STAGE_SOURCE_BYTES", 256)
    consecutive = list(range(1, 8))
    _round_trip(SPECS["asym"], layout, 16, host_pages=consecutive, src_pages=[p + 2 for p in consecutive],
                dst_pages=consecutive, threads=threads)
    if native == "0" or not compiled:  # no compiled module: numpy's path
        assert len(started) == threads - 1  # the pool's kept workers, started once, serve every call
        assert not compiled
    else:
        assert not started
        assert compiled == [threads] * (1 + SPECS["asym"].layer_num)  # the backup, then each layer's load


def test_copy_workers_are_reused_and_pass_errors_back():
    workers = copy_mod.CopyWorkers(3)
    seen = []
    for _ in range(3):
        copy_mod.split_threads(list(range(10)), 1 << 30, 3, lambda part: seen.append(sorted(part)), workers)
    assert sorted(map(tuple, seen[:3])) == [(0, 3, 6, 9), (1, 4, 7), (2, 5, 8)]
    assert len(seen) == 9
    names = [t.name for t in threading.enumerate()].count("kvtier-copy")
    assert names >= 2

    def fail_on_two(part):
        if 2 in part:
            raise RuntimeError("part with 2")

    with pytest.raises(RuntimeError, match="part with 2"):
        copy_mod.split_threads(list(range(10)), 1 << 30, 3, fail_on_two, workers)
    copy_mod.split_threads(list(range(10)), 1 << 30, 3, lambda part: seen.append(part), workers)  # still serving
    assert len(seen) == 12


def test_plan_cuts_a_single_run_into_pieces():
    dst, src = np.zeros((10, 3), np.int16), np.arange(30, dtype=np.int16).reshape(10, 3)
    runs = cpu.Runs([0], [0], [10])
    tasks = cpu.plan([(dst, src)], runs, parts=3)
    assert [t.runs for t in tasks] == [[(0, 0, 4)], [(4, 4, 4)], [(8, 8, 2)]] and not any(t.staged for t in tasks)
    cpu.run_tasks(tasks)
    assert np.array_equal(dst, src)


def test_plan_deals_each_pairs_runs_over_the_parts():
    a, b = np.zeros((6, 2), np.int16), np.zeros((6, 2), np.int16)
    runs = cpu.Runs([5, 0, 3, 1], [0, 1, 2, 3], [1, 1, 1, 1])
    tasks = cpu.plan([(a, b), (b, a)], runs, parts=2)
    assert [(t.dst is a, t.runs) for t in tasks] == [
        (True, [(5, 0, 1), (3, 2, 1)]), (True, [(0, 1, 1), (1, 3, 1)]),
        (False, [(5, 0, 1), (3, 2, 1)]), (False, [(0, 1, 1), (1, 3, 1)])]
    assert len(cpu.plan([(a, b)], cpu.Runs([0], [0], [1]), parts=4)) == 1  # one page: one part


def test_contiguous_bytes_and_staging_view():
    a = np.zeros((4, 8, 16), np.int16)  # 256 contiguous bytes per (i, j) row
    t = a.transpose(1, 0, 2)
    c = np.zeros(t.shape, np.int16)
    assert cpu.contiguous_bytes(a) == cpu.contiguous_bytes(t) == a.nbytes  # one block, in its own order
    assert cpu.contiguous_bytes(c, t) == 32 and cpu.contiguous_bytes(t, c) == 32  # shared: one 16-element row
    assert cpu.contiguous_bytes(a, a) == a.nbytes
    assert cpu.contiguous_bytes(a[:, :, :4]) == 8
    buf = np.empty(t.nbytes + 7, np.uint8)
    stage = cpu.staging_view(buf, t)
    assert stage.shape == t.shape and stage.dtype == t.dtype
    assert sorted(stage.strides, reverse=True) == list(np.empty((4, 8, 16), np.int16).strides)
    src = np.arange(t.size, dtype=np.int16).reshape(4, 8, 16).transpose(1, 0, 2)
    np.copyto(stage, src)
    assert np.array_equal(stage, src)


def test_staging_buffers_are_reused():
    buffers = cpu._Buffers()
    a = buffers.take(1000)
    buffers.give(a)
    assert buffers.take(500) is a
    assert buffers.take(500) is not a


def test_meta_pools_validate_and_move_nothing():
    """The simulator's pools (``meta``: shapes, no memory): bad indices still raise before
    anything else; good ones return without touching memory."""
    spec = KVSpec.mha(2, 2, 8)
    dev = DeviceKVPool(spec, 32, 4, device="meta")
    host = HostKVPool(spec, 32, 4, device="meta")
    idx = slots([1, 0, 5], 4)
    for backend in ("direct", "kernel", "auto"):
        host.backup_from_device_all_layer(dev, idx, idx, backend)
        host.load_to_device_per_layer(dev, idx, idx, 1, backend)
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        host.backup_from_device_all_layer(dev, idx[1:], idx[1:])
    with pytest.raises(ValueError, match="outside"):
        host.load_to_device_per_layer(dev, slots([8], 4), slots([0], 4), 0)
    with pytest.raises(ValueError, match="layer_id"):
        host.load_to_device_per_layer(dev, idx, idx, 2)


def test_widen_merges_only_what_both_sides_share(monkeypatch):
    monkeypatch.setattr(cpu, "GIL_FREE_MIN_ELEMENTS", 1)
    # canonical (page, slot, layer, head, dim) views of three memory orders
    dev = np.zeros((3, 4, 16, 2, 8), np.int16).transpose(1, 2, 0, 3, 4)  # (layer, size, head, dim)
    page_first = np.zeros((4, 16, 3, 2, 8), np.int16)  # shares (head, dim) token rows with dev
    page_head = np.zeros((4, 2, 16, 3, 8), np.int16).transpose(0, 2, 3, 1, 4)  # shares only dim
    d, s = cpu.widen(page_first, dev)
    assert d.shape == s.shape == (4, 16, 3) and d.dtype.itemsize == 2 * 8 * 2
    d, s = cpu.widen(page_head, dev)
    assert d.shape == s.shape == (4, 16, 3, 2) and d.dtype.itemsize == 16
    flat = np.zeros((4, 16, 2, 8), np.int16)
    d, s = cpu.widen(flat, flat.copy())
    assert d.shape == (4, 16) and d.dtype.itemsize == 2 * 8 * 2  # stops at (page, one more)
    src = np.arange(flat.size, dtype=np.int16).reshape(flat.shape)
    d, s = cpu.widen(flat, src)
    np.copyto(d, s)
    assert np.array_equal(flat, src)


def test_widen_keeps_enough_elements_for_numpy_to_release_the_gil():
    big = np.zeros((2, 64, 8, 128), np.int16)  # one per-layer device page: (slot, head, dim)
    d, _ = cpu.widen(big, big.copy())
    assert d.shape == (2, 64, 8)  # 512 elements of a head row; 64 token rows would hold the GIL
    small = np.zeros((2, 16, 2, 8), np.int16)
    assert cpu.widen(small, small.copy())[0].shape == small.shape


def test_copy_workers_restart_in_a_forked_child(monkeypatch):
    """A child made by fork inherits the queue but not the threads: it must start its own
    (else its first parallel copy would wait forever). Simulated by a new process id."""
    workers = copy_mod.CopyWorkers(2)
    seen = []
    copy_mod.split_threads([1, 2], 1 << 30, 2, seen.append, workers)
    parent_jobs = workers._jobs
    monkeypatch.setattr(copy_mod.os, "getpid", lambda: -1)
    copy_mod.split_threads([3, 4], 1 << 30, 2, seen.append, workers)
    assert workers._jobs is not parent_jobs
    assert sorted(x for part in seen for x in part) == [1, 2, 3, 4]


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=40))
def test_coalesce_matches_a_loop(pairs):
    dst = torch.tensor([d for d, _ in pairs], dtype=torch.int64)
    src = torch.tensor([s for _, s in pairs], dtype=torch.int64)
    want = []
    for d, s in pairs:
        if want and want[-1][0] + want[-1][2] == d and want[-1][1] + want[-1][2] == s:
            want[-1][2] += 1
        else:
            want.append([d, s, 1])
    runs = cpu.Runs(*(list(x) for x in zip(*want))) if want else cpu.Runs([], [], [])
    for small in (0, 10**6):  # numpy's calls, and the loop over Python lists of few pages
        with mock.patch.object(runs_module, "_SMALL_PAGES", small):
            assert coalesce(dst, src) == runs


@pytest.mark.parametrize("page_size, coalesced, gathered", [(64, 0, 0), (2, 1, 1)])
def test_kernel_coalesces_only_where_a_page_could_be_under_the_threshold(monkeypatch, page_size, coalesced,
                                                                          gathered):
    """``kernel`` on the CPU picks gather/scatter only for runs under ``KERNEL_MIN_RUN_BYTES``:
    where one page pair of one layer already reaches it, no coalescing is done to know
    (64-token pages: 128 KiB a layer); where it does not, the runs decide (2-token pages of
    random order: 4 KiB runs go to gather). The bytes are exact either way."""
    import kvtier.transfer as transfer

    calls = {"coalesce": 0, "gather": 0}
    real_coalesce, real_gather = transfer.coalesce, transfer._copy_gather

    def count(name, real):
        def spy(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return spy

    monkeypatch.setattr(transfer, "coalesce", count("coalesce", real_coalesce))
    monkeypatch.setattr(transfer, "_copy_gather", count("gather", real_gather))
    spec = KVSpec.mha(2, 8, 128)
    dev = random_device_pool(spec, 8 * page_size, page_size, seed=3)
    host = HostKVPool(spec, 8 * page_size, page_size, layout="page_first")
    rng = np.random.default_rng(page_size)
    h, d = slots(rng.permutation(8)[:6].tolist(), page_size), slots(rng.permutation(8)[:6].tolist(), page_size)
    host.backup_from_device_all_layer(dev, h, d, "direct")
    back = DeviceKVPool(spec, 8 * page_size, page_size)
    back.raw.zero_()
    host.load_to_device_per_layer(back, h, d, 1, "kernel")
    assert calls == {"coalesce": coalesced, "gather": gathered}
    for name in spec.names:  # layer 1 of every page moved is the device pool's, layer 0 untouched
        assert torch.equal(bits(back.buffer(name, 1)[d]), bits(dev.buffer(name, 1)[d]))
        assert not bits(back.buffer(name, 0)).any() and bits(back.buffer(name, 1)[d]).any()


def test_compiled_copies_split_from_a_smaller_size_than_numpy_ones(monkeypatch):
    """The compiled copy's threads are kept running between calls, so its calls split as
    soon as each thread gets COMPILED_SHARE_MIN_BYTES (a sliding layer's load splits), and
    over no more threads than that; numpy's split from PARALLEL_MIN_BYTES. A per-layer
    load of 256 KiB asks the compiled copy for the pool's two threads, one of 64 KiB for one."""
    share, high = copy_mod.COMPILED_SHARE_MIN_BYTES, copy_mod.PARALLEL_MIN_BYTES
    assert 2 * share < high
    assert [copy_mod.thread_count(n, 8, compiled=True)
            for n in (0, share, 2 * share - 1, 2 * share, 5 * share + 7, 8 * share, high)] == [1, 1, 1, 2, 5, 8, 8]
    assert [copy_mod.thread_count(n, 2) for n in (2 * share, high - 1, high)] == [1, 1, 2]
    assert copy_mod.thread_count(high, 4, copy_mod.CopyWorkers(2), compiled=True) == 2

    from kvtier.transfer import native
    asked = []
    monkeypatch.setattr(native, "run_jobs", lambda jobs, threads: asked.append(threads))
    monkeypatch.setenv("KVTIER_NATIVE", "1")
    spec = KVSpec.mha(2, 8, 128)  # 4 KiB a token a layer: 64 tokens are 256 KiB of one layer
    dev = random_device_pool(spec, 128, 16, seed=1)
    host = HostKVPool(spec, 128, 16, layout="page_first", copy_threads=2)
    if not native.enabled():
        pytest.skip("kvtier.transfer._native is not built")
    host.load_to_device_per_layer(dev, slots([0, 1, 2, 3], 16), slots([4, 5, 6, 7], 16), 1)
    host.load_to_device_per_layer(dev, slots([0], 16), slots([4], 16), 1)  # 64 KiB
    assert asked == [2, 1]
    monkeypatch.setattr(copy_mod, "COMPILED_SHARE_MIN_BYTES", 0)  # no minimum share: every thread
    assert copy_mod.thread_count(1, 3, compiled=True) == 3
