"""The compiled copy path (``kvtier.transfer._native``) against the pure numpy path.

Every layout x geometry x direction is copied both ways and compared byte for byte,
with the expected pages too, and with each kind of streaming store (a line per store
where the CPU has AVX-512, 16 bytes per store). The C function's own checks (every
block inside both buffers, before any byte moves; argument types) are tested directly.
Where the module is not built, its tests are skipped, or fail under
KVTIER_REQUIRE_SERVICES=1 (CI).
"""

import numpy as np
import pytest
import torch

from kvtier import HostKVPool, KVSpec, compiled as compiled_modules
from kvtier.errors import IntegrityError
from kvtier.transfer import cpu, native
from tests.support.hostile import Emptying
from tests.support.pools import LAYOUT_ORDERS, SPECS, bits, fill_random, random_device_pool, slots

# dim rows of 64 bytes (bf16 x 32): whole cache lines, so the streaming-store branch runs too
GEOMETRIES = {**SPECS, "lines": KVSpec.mha(2, 2, 32)}


@pytest.fixture(params=["1", "32", "0"], ids=["widest-stores", "32-byte-stores", "16-byte-stores"])
def stores(request, monkeypatch):
    """Every kind of streaming store the CPU runs: the widest (the default; a line per
    store with AVX-512), at most 32 bytes (AVX2; ``KVTIER_WIDE_STORES=32``) and 16 bytes
    per store (``KVTIER_WIDE_STORES=0``), read per call."""
    monkeypatch.setenv("KVTIER_WIDE_STORES", request.param)
    return request.param


def test_native_module_is_built(compiled):
    """CI builds the extension: a missing one fails there instead of silently testing numpy only."""
    assert callable(compiled.copy_jobs)


def _copies(spec, layout, threads, monkeypatch, calls):
    """Backup then per-layer loads with the current switch; the host and destination bytes."""
    page_size = 16
    host_pages, src_pages, dst_pages = [3, 0, 1, 5, 6, 7], [6, 2, 3, 0, 1, 4], [1, 7, 4, 0, 2, 3]
    src = random_device_pool(spec, 10 * page_size, page_size, seed=1)
    dst = random_device_pool(spec, 10 * page_size, page_size, seed=2)
    host = HostKVPool(spec, 9 * page_size, page_size, layout=layout, copy_threads=threads)
    gen = torch.Generator().manual_seed(3)
    for buf in host.buffers.values():
        fill_random(buf, gen)
    for name in ("run_jobs", "copy_runs"):  # the compiled path's two entries in kvtier.transfer.native
        monkeypatch.setattr(native, name, _counted(getattr(native, name), calls))
    # NOTE: force the thread split (these pools are far below the default threshold)
    monkeypatch.setattr(cpu._copy, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(cpu._copy, "COMPILED_SHARE_MIN_BYTES", 0)
    host.backup_from_device_all_layer(src, slots(host_pages, page_size), slots(src_pages, page_size), "direct")
    for layer in range(spec.layer_num):
        host.load_to_device_per_layer(dst, slots(host_pages, page_size), slots(dst_pages, page_size), layer,
                                      "direct")
    want = {n: [bits(dst.buffer(n, layer)).clone() for layer in range(spec.layer_num)] for n in spec.names}
    for n in spec.names:  # what the loads must have produced, from the source pool itself
        for layer in range(spec.layer_num):
            got = bits(dst.buffer(n, layer))
            expect = bits(src.buffer(n, layer))[slots(src_pages, page_size)]
            assert torch.equal(got[slots(dst_pages, page_size)], expect), (n, layer)
    return {n: bits(b).clone() for n, b in host.buffers.items()}, want


def _counted(fn, calls):
    def spy(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return spy


@pytest.fixture(params=[0, 1, 2], ids=["rule-order", "source-order", "far-inside-order"])
def plan_order(request, monkeypatch):
    """Every copy plan in one of its candidate loop orders (the last it has where it has
    fewer), as a plan that kept that order after its trials copies."""
    real = native.Blocks.loops
    monkeypatch.setattr(native.Blocks, "loops",
                        lambda self, order=None: real(self, min(request.param, len(self.orders) - 1)
                                                      if order is None else order))
    native._blocks.cache_clear()
    native._PAIRS.clear()
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
@pytest.mark.parametrize("spec_name", list(GEOMETRIES))
def test_native_matches_pure_path(monkeypatch, compiled, stores, plan_order, spec_name, layout, threads):
    """Backups and per-layer loads give the same bytes with and without the compiled path
    (and the loads give back the source's pages), in each of a copy plan's candidate loop
    orders; the switch really changes the path."""
    spec = GEOMETRIES[spec_name]
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVTIER_NATIVE", flag)
        calls = []
        results[flag] = _copies(spec, layout, threads, monkeypatch, calls)
        assert bool(calls) == (flag == "1"), "KVTIER_NATIVE must pick the path"
    (host_n, dst_n), (host_p, dst_p) = results["1"], results["0"]
    for n in spec.names:
        assert torch.equal(host_n[n], host_p[n]), n
        for layer in range(spec.layer_num):
            assert torch.equal(dst_n[n][layer], dst_p[n][layer]), (n, layer)


@pytest.mark.parametrize("small_runs", [0, 10**6], ids=["numpy-offsets", "listed-offsets"])
def test_copy_runs_moves_each_runs_pages(monkeypatch, compiled, small_runs):
    """``copy_runs`` lists a few runs' pages in Python and many with numpy: the same
    pages land either way, and nothing else in the destination changes."""
    monkeypatch.setattr(native, "_SMALL_RUNS", small_runs)
    gen = np.random.default_rng(5)
    src = gen.integers(0, 1 << 15, (40, 6, 3, 8), dtype=np.int16)[:, :, 1]  # strided pages
    for runs in ([(3, 7, 1)], [(0, 30, 4), (9, 2, 3), (20, 11, 1)], [(i, 39 - i, 1) for i in range(20)]):
        dst = np.full((40, 6, 8), -1, dtype=np.int16)
        want = dst.copy()
        for a, b, n in runs:
            want[a:a + n] = src[b:b + n]
        native.copy_runs(dst, src, runs)
        assert np.array_equal(dst, want), runs


def test_copy_runs_refuses_pages_of_other_shapes(compiled):
    dst = np.zeros((4, 6, 8), dtype=np.int16)
    with pytest.raises(IntegrityError, match=r"page shapes differ: \(6, 8\) and \(8, 6\)"):
        native.copy_runs(dst, np.ones((4, 8, 6), dtype=np.int16), [(0, 0, 2)])
    assert not dst.any()


def test_a_view_pair_is_worked_out_once_and_keeps_nothing_alive(compiled, monkeypatch):
    """A pair's spans and blocks are kept for the next copy between the same views, by
    weak reference: the views die with their owner, and new views that get the dead
    ones' ids (views of other memory) are worked out again: their own bytes are copied."""
    import gc
    import weakref

    monkeypatch.setattr(native, "_PAIRS", {})
    rng = np.random.default_rng(1)
    bases = [(np.zeros((8, 4, 6), dtype=np.int16), rng.integers(0, 1 << 15, (8, 4, 6), dtype=np.int16))
             for _ in range(2)]  # both kept alive: a stale pair would write into the first
    pages = np.array([3, 0, 5], dtype=np.int64)
    dst, src = bases[0][0][:], bases[0][1][:]
    native.copy_pages([(dst, src)], pages, pages[::-1].copy(), 1)
    stale = native._pair(dst, src)
    assert native._pair(dst, src) is stale  # kept
    assert np.array_equal(dst[pages], src[pages[::-1]])
    alive = weakref.ref(src)
    del dst, src
    gc.collect()
    assert alive() is None  # the kept pair held no reference to the views
    before = bases[0][0].copy()
    dst, src = bases[1][0][:], bases[1][1][:]
    native._PAIRS[(id(dst), id(src))] = stale  # as if the new views had the dead ones' ids
    native.copy_pages([(dst, src)], pages, pages, 1)
    assert np.array_equal(bases[1][0][pages], bases[1][1][pages]) and not bases[1][0][[1, 2, 4, 6, 7]].any()
    assert np.array_equal(bases[0][0], before)  # nothing went to the dead views' memory


def test_pure_path_without_module(monkeypatch):
    """With the module missing (as on a machine without a compiler: its import found
    nothing) the numpy path copies."""
    monkeypatch.setitem(compiled_modules._imported, native.COMPILED, None)
    assert not native.enabled() and native.path_name() == "numpy"
    calls = []
    _copies(GEOMETRIES["asym"], "page_head", 2, monkeypatch, calls)
    assert not calls


def test_overlapping_views_stay_on_numpy(compiled):
    """memcpy must not copy overlapping blocks: views sharing memory are left to numpy."""
    a = np.arange(64, dtype=np.int16).reshape(8, 8)
    before = a.copy()
    tasks = cpu.plan([(a[1:], a[:-1])], cpu.Runs([0], [0], [7]))
    assert tasks and not any(t.native for t in tasks)
    cpu.run_tasks(tasks)
    assert np.array_equal(a[1:], before[:-1]) and np.array_equal(a[0], before[0])


def _copy_pages(compiled, *job):
    """One job through ``copy_jobs`` (one thread)."""
    compiled.copy_jobs([job])


def _bufs():
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    return dst, src


@pytest.mark.parametrize("stream", [True, False])
def test_copy_job_blocks(compiled, stores, stream):
    """Each page's blocks land where the strides say, in any page order; both store kinds."""
    src = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    # pages of 2 x 2 blocks of 64 bytes: source rows 128 apart, blocks 64 apart; dest transposed
    d_pages, s_pages = np.array([2048, 0], dtype=np.int64), np.array([0, 1024], dtype=np.int64)
    _copy_pages(compiled, dst, src, d_pages, s_pages, (2, 2), (64, 128), (128, 64), 64, stream)
    want = np.zeros_like(dst)
    for d, s in zip(d_pages, s_pages):
        for i in range(2):
            for j in range(2):
                want[d + 64 * i + 128 * j:][:64] = src[s + 128 * i + 64 * j:][:64]
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("side", ["dst", "src"])
@pytest.mark.parametrize("offset", [-1, 200, 1 << 62, -(1 << 62)])
def test_copy_job_checks_every_block_first(compiled, side, offset):
    """An offset putting any block outside either buffer raises before a byte is written
    (the first, valid pages are not copied either)."""
    dst, src = _bufs()
    d_pages = np.array([0, 16, 32], dtype=np.int64)
    s_pages = np.array([0, 16, 32], dtype=np.int64)
    (d_pages if side == "dst" else s_pages)[2] = offset
    with pytest.raises(ValueError, match=side):
        _copy_pages(compiled, dst, src, d_pages, s_pages, (2,), (64,), (64,), 16)
    assert not dst.any()


def test_copy_job_checks_strided_extent(compiled):
    """The last block of a page (its largest stride times its count) is checked too."""
    dst, src = _bufs()
    pages = np.array([0], dtype=np.int64)
    with pytest.raises(ValueError, match="src"):
        _copy_pages(compiled, dst, src, pages, pages, (4,), (16,), (81,), 16)  # block 3 ends at 259 > 256
    assert not dst.any()
    _copy_pages(compiled, dst, src, pages, pages, (4,), (16,), (80,), 16)  # block 3 ends at 256: fits
    assert np.array_equal(dst[:64].reshape(4, 16), np.stack([src[80 * i:80 * i + 16] for i in range(4)]))
    assert not dst[64:].any()


def test_copy_job_checks_negative_strides(compiled):
    """A negative stride reaching before the buffer is caught like a positive one."""
    dst, src = _bufs()
    with pytest.raises(ValueError, match="src"):
        _copy_pages(compiled, dst, src, np.array([0], np.int64), np.array([16], np.int64), (2,), (16,), (-32,), 16)
    assert not dst.any()


@pytest.mark.parametrize("bad", [
    dict(d_pages=np.array([0, 16], dtype=np.int32)),  # not int64
    dict(d_pages=np.array([0.0], dtype=np.float64)),  # not integers
    dict(s_pages=np.array([0, 16, 32], dtype=np.int64)),  # lengths differ
    dict(d_pages=np.zeros((1, 1), dtype=np.int64)),  # not 1-d
    dict(block=0),
    dict(block=-16),
    dict(block=2 ** 63 - 1),  # its extent wrapped past the buffer's bound (2^63 bytes copied)
    dict(shape=(), d_strides=(), s_strides=(), block=2 ** 63 - 1, d_pages=np.array([1], np.int64)),  # the same, no axis
    dict(shape=(1,) * 7, d_strides=(0,) * 7, s_strides=(0,) * 7),  # too many axes
    dict(shape=(2,), d_strides=(16, 16)),  # strides do not match the shape
    dict(shape=(-1,)),
])
def test_copy_job_rejects_bad_arguments(compiled, bad):
    dst, src = _bufs()
    args = dict(d_pages=np.array([0], np.int64), s_pages=np.array([0], np.int64), shape=(2,), d_strides=(16,),
                s_strides=(16,), block=16)
    args.update(bad)
    with pytest.raises(ValueError):
        _copy_pages(compiled, dst, src, args["d_pages"], args["s_pages"], args["shape"], args["d_strides"],
                            args["s_strides"], args["block"])
    assert not dst.any()


def test_copy_job_rejects_read_only_or_non_buffers(compiled):
    dst, src = _bufs()
    pages = np.array([0], np.int64)
    with pytest.raises((TypeError, BufferError)):
        _copy_pages(compiled, bytes(256), src, pages, pages, (1,), (0,), (0,), 16)  # read-only destination
    with pytest.raises(TypeError):
        _copy_pages(compiled, dst, [0] * 256, pages, pages, (1,), (0,), (0,), 16)  # not a buffer
    with pytest.raises(TypeError):
        _copy_pages(compiled, dst, src, [0], pages, (1,), (0,), (0,), 16)  # offsets not a buffer
    assert not dst.any()


def _jobs(rng, count, pages, block=64):
    """``count`` jobs of ``pages`` random page pairs each (pages of 3 blocks, transposed
    from source to destination), with their sources, destinations and expected bytes."""
    jobs, dsts, wants = [], [], []
    for _ in range(count):
        src = rng.integers(0, 256, pages * 3 * block + 4096, dtype=np.uint8)
        dst = np.zeros(pages * 3 * block, dtype=np.uint8)
        d_pages = rng.permutation(pages).astype(np.int64) * 3 * block
        s_pages = rng.choice(len(src) - 3 * block, pages, replace=False).astype(np.int64)
        want = dst.copy()
        for d, s_at in zip(d_pages, s_pages):
            for i in range(3):  # source block i lands at destination block 2 - i
                want[d + (2 - i) * block:][:block] = src[s_at + i * block:][:block]
        # destination offsets at each page's last block, stepping back (a negative stride)
        jobs.append((dst, src, d_pages + 2 * block, s_pages, (3,), (-block,), (block,), block))
        dsts.append(dst)
        wants.append(want)
    return jobs, dsts, wants


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("pages", [1, 5, 64])
def test_copy_jobs_splits_every_job_over_threads(compiled, stores, threads, pages):
    """Several jobs in one call, each job's pages shared out over 1 to 8 threads (more
    threads than pages included): every page of every job lands, nothing else changes."""
    jobs, dsts, wants = _jobs(np.random.default_rng(pages * 10 + threads), 3, pages)
    compiled.copy_jobs(jobs, threads)
    for dst, want in zip(dsts, wants):
        assert np.array_equal(dst, want)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("block", [4096, 8192, 8192 + 64, 3 * 4096 + 48, 5 * 4096 + 8])
def test_copy_jobs_copies_long_blocks_whole(compiled, stores, block, stream):
    """Blocks longer than the lines prefetched ahead of one (8 KiB) are copied a line at a
    time with prefetches further on, then their tail: whole lines and ragged ends,
    streaming and plain stores, every byte lands and nothing past a block changes."""
    rng = np.random.default_rng(block)
    src = rng.integers(0, 256, 6 * block, dtype=np.uint8)
    dst = np.zeros(6 * block + 64, dtype=np.uint8)
    d_pages, s_pages = np.array([3 * block, 0], np.int64), np.array([block, 4 * block + 8], np.int64)
    compiled.copy_jobs([(dst, src, d_pages, s_pages, (1,), (0,), (0,), block, stream)], 2)
    want = np.zeros_like(dst)
    for d, s_at in zip(d_pages, s_pages):
        want[d:d + block] = src[s_at:s_at + block]
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("bad_job", [0, 2])
def test_copy_jobs_checks_every_job_before_any_copy(compiled, bad_job):
    """A job with a block outside its buffers, first or last: ValueError, and no job's
    destination is written, the valid ones' included."""
    jobs, dsts, _ = _jobs(np.random.default_rng(7), 3, 8)
    dst, src, d_pages, s_pages, *rest = jobs[bad_job]
    s_pages = s_pages.copy()
    s_pages[-1] = len(src)  # the last page starts past the source's end
    jobs[bad_job] = (dst, src, d_pages, s_pages, *rest)
    with pytest.raises(ValueError, match="src page 7"):
        compiled.copy_jobs(jobs, 2)
    assert not any(d.any() for d in dsts)


@pytest.mark.parametrize("threads", [0, -1, 65])
def test_copy_jobs_refuses_thread_counts_out_of_range(compiled, threads):
    jobs, dsts, _ = _jobs(np.random.default_rng(1), 1, 2)
    with pytest.raises(ValueError, match=rf"threads must be in \[1, 64\], got {threads}"):
        compiled.copy_jobs(jobs, threads)
    assert not dsts[0].any()



@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_a_pool_of_more_copy_threads_than_the_compiled_copy_keeps_copies_on_as_many_as_it_keeps(compiled, layout):
    """A host's copy threads default to its cores, which may be more than the compiled
    copy's ``MAX_THREADS`` (64): a backup and a load large enough to split that wide
    run on 64 threads, byte for byte (before, every such copy raised ``ValueError``)."""
    assert compiled.MAX_THREADS == 64
    spec, ps = KVSpec.mha(2, 8, 128, dtype=torch.bfloat16), 16
    pages = 96  # 12 MiB: 192 shares of the compiled copy's 64 KiB, more than 64 threads
    dev = random_device_pool(spec, pages * ps, ps, seed=3)
    host = HostKVPool(spec, pages * ps, ps, layout=layout, copy_threads=96)
    src = slots(list(range(pages)), ps)
    dst = slots(list(range(pages))[::-1], ps)
    host.backup_from_device_all_layer(dev, src, dst)
    back = random_device_pool(spec, pages * ps, ps, seed=4)
    host.load_to_device_layers(back, dst, src, range(spec.layer_num))
    for name in spec.names:
        for layer in range(spec.layer_num):
            assert torch.equal(bits(back.buffer(name, layer)), bits(dev.buffer(name, layer)))


@pytest.mark.parametrize("bad", [0, -2, 2.5, "4", True])
def test_a_pool_refuses_copy_threads_that_are_no_positive_int(bad):
    with pytest.raises(ValueError, match="copy_threads must be a positive int"):
        HostKVPool(KVSpec.mha(1, 1, 4), 16, 4, copy_threads=bad)

def test_copy_jobs_refuses_jobs_that_are_not_tuples(compiled):
    dst, src = _bufs()
    pages = np.array([0], np.int64)
    with pytest.raises(TypeError, match="a copy job must be a tuple, got list"):
        compiled.copy_jobs([(dst, src, pages, pages, (1,), (0,), (0,), 16), [dst, src]])
    with pytest.raises(TypeError, match="jobs must be a sequence"):
        compiled.copy_jobs(5)
    assert not dst.any()
    compiled.copy_jobs([])  # no jobs: nothing to do


@pytest.mark.parametrize("emptied", ["strides", "jobs"])
def test_copy_jobs_read_their_own_copy_of_a_list_python_code_empties(compiled, emptied):
    """Reading a job's numbers may run Python (``__index__``): code there that empties the
    caller's list of strides or of jobs changes nothing, where the parser read on from
    the emptied list (its freed items; the job's freed destination)."""
    base, src = _bufs()
    src_pages = dst_pages = np.array([0], np.int64)
    listed = []
    if emptied == "strides":
        listed[:] = [Emptying(listed, 32), 16]
        jobs = [(base[:], src, dst_pages, src_pages, (2, 2), listed, (32, 16), 16)]
    else:
        listed.append((base[:], src, dst_pages, src_pages, (Emptying(listed, 2), 2), (32, 16), (32, 16), 16))
        jobs = listed  # the list holds the only reference to the job and to its view of ``base``
    compiled.copy_jobs(jobs, 1)
    assert bytes(base[:64]) == bytes(src[:64]) and not base[64:].any()


@pytest.mark.parametrize("flag", ["0", "1"])
def test_bench_transfer_reports_copy_path(monkeypatch, capsys, flag):
    """``kvtier bench transfer`` says which copy path ran, in its JSON config and header."""
    import json

    from kvtier.cli import main

    monkeypatch.setenv("KVTIER_NATIVE", flag)
    want = "native" if flag == "1" and compiled_modules.built(native.COMPILED) is not None else "numpy"
    args = ["bench", "transfer", "--layers", "2", "--heads", "2", "--dims", "16", "--page-size", "4", "--pages", "4",
            "--layouts", "page_head", "--backends", "direct", "--repeat", "1", "--meta-pages", "4"]
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["copy_path"] == want
    assert main(args) == 0
    assert f"CPU copy path {want}" in capsys.readouterr().out


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()}


def test_store_bytes_follow_the_cpu_and_the_switch(monkeypatch, capsys, compiled):
    """A line per streaming store exactly where the CPU has AVX-512 (x86-64 Linux here),
    half a line where it has AVX2 only, at most 32 bytes with ``KVTIER_WIDE_STORES=32``
    and 16 with ``0``, none reported on numpy's path; the bench names them."""
    import json

    from kvtier.cli import main

    flags = _cpu_flags()
    if "sse2" not in flags:
        pytest.skip("not an x86-64 Linux CPU with its flags in /proc/cpuinfo")
    monkeypatch.delenv("KVTIER_WIDE_STORES", raising=False)
    half = 32 if "avx2" in flags else 16
    assert native.store_bytes() == (64 if "avx512f" in flags else half)
    monkeypatch.setenv("KVTIER_WIDE_STORES", "32")
    assert native.store_bytes() == half
    monkeypatch.setenv("KVTIER_WIDE_STORES", "0")
    assert native.store_bytes() == 16
    args = ["bench", "transfer", "--layers", "2", "--heads", "2", "--dims", "16", "--page-size", "4", "--pages", "4",
            "--layouts", "page_head", "--backends", "direct", "--repeat", "1", "--meta-pages", "4"]
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["store_bytes"] == 16
    assert main(args) == 0
    assert "CPU copy path native (16-byte streaming stores)" in capsys.readouterr().out
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    assert native.store_bytes() == 0


@pytest.mark.parametrize("step", [256, 0, -256])
def test_copy_jobs_take_page_numbers_with_where_pages_start(compiled, step):
    """With ``pages_at`` the pages are page numbers, page p of a side at byte ``first +
    p * step`` (a zero or negative stride too: a one-page or a reversed view): the same
    bytes land as with the byte offsets worked out beforehand."""
    rng = np.random.default_rng(step + 1000)
    src = rng.integers(0, 256, 8 * 256, dtype=np.uint8)
    s_first = 7 * 256 if step < 0 else 0
    d_pages, s_pages = np.array([2, 0, 5], np.int64), np.array([1, 3, 0], np.int64) if step else np.zeros(3, np.int64)
    got, want = np.zeros(8 * 256, np.uint8), np.zeros(8 * 256, np.uint8)
    compiled.copy_jobs([(got, src, d_pages, s_pages, (4,), (64,), (64,), 64, True, (0, 256, s_first, step))], 2)
    compiled.copy_jobs([(want, src, d_pages * 256, s_first + s_pages * step, (4,), (64,), (64,), 64)], 1)
    assert np.array_equal(got, want) and got.any()


@pytest.mark.parametrize("bad", [{"page": -1}, {"page": 1 << 60}, {"at": (0, 1 << 62, 0, 256)}, {"at": (0, 256)},
                                 {"at": "four"}, {"page": 8}])
def test_copy_jobs_check_page_numbers_before_any_copy(compiled, bad):
    """A negative page number, one whose offset would overflow or lands past the buffer,
    or a bad ``pages_at``: an error before any job's bytes move."""
    src, dst, other = np.ones(8 * 256, np.uint8), np.zeros(8 * 256, np.uint8), np.zeros(8 * 256, np.uint8)
    pages = np.array([0, bad.get("page", 1)], np.int64)
    good = (other, src, np.array([0], np.int64), np.array([0], np.int64), (1,), (0,), (0,), 256, True, (0, 256, 0, 256))
    job = (dst, src, pages, np.array([0, 1], np.int64), (1,), (0,), (0,), 256, True, bad.get("at", (0, 256, 0, 256)))
    with pytest.raises((ValueError, TypeError)):
        compiled.copy_jobs([good, job], 2)
    assert not dst.any() and not other.any()


def test_blocks_loop_over_the_axis_far_apart_on_both_sides_outermost():
    """A page_head backup's page, (layer, slot, head) blocks of 256 bytes: the slots (2 KiB
    apart in the source, 8 KiB in the destination) outermost, then the heads, then the
    layers (32 MiB apart in the source, a run in the destination); the contiguous
    trailing axes merge into one block whatever the order."""
    b = native.Blocks((32, 64, 8, 128), (256, 8192, 524288, 2), (33554432, 2048, 256, 2), 2)
    assert (b.block, b.shape, b.src_strides, b.dst_strides) == (256, (64, 8, 32), (2048, 256, 33554432),
                                                                (8192, 524288, 256))
    tie = native.Blocks((32, 64, 1024), (2048, 65536, 2), (33554432, 2048, 2), 2)  # page_first's backup
    assert (tie.block, tie.shape, tie.src_strides) == (2048, (64, 32), (2048, 33554432))


def test_blocks_write_each_destination_run_whole_inside_the_outer_loop():
    """A page_head load run's page (16 layers of a slot's heads, 256-byte blocks): the slots
    outermost as before, then the layers (32 MiB apart in the destination), the heads
    innermost (256 bytes apart there: each layer's 2 KiB row of the slot written in one
    run), though heads and layers tie on their shorter stride; the slots cut in tiles of
    4, so each layer's run is 8 KiB (``TILE_BYTES``)."""
    dst = (33554432, 2048, 256, 2)  # device, layer_first: (layer, slot, head, dim)
    src = (256, 8192, 524288, 2)  # host, page_head: layer 256 B, slot 8 KiB, head 512 KiB
    b = native.Blocks((16, 64, 8, 128), dst, src, 2)
    assert (b.block, b.shape, b.dst_strides, b.src_strides) == (
        256, (16, 16, 4, 8), (4 * 2048, 33554432, 2048, 256), (4 * 8192, 256, 8192, 524288))


def test_a_two_axis_gather_loops_in_the_source_order():
    """page_head's per-layer load (a page's heads x slots, 256-byte blocks, no run of them
    in the source): each head's slots in turn, in the source's order, untiled. Two axes
    of which the source reads a run keep the outer rule: page_first's backup (each
    layer's slots one run of the source) walks the slots outermost, and so does a
    per-layer backup into page_head (each slot's heads one run of the source)."""
    dst = (33554432, 2048, 256, 2)  # device, layer_first: (layer, slot, head, dim)
    src = (256, 8192, 524288, 2)  # host, page_head: layer 256 B, slot 8 KiB, head 512 KiB
    one = native.Blocks((1, 64, 8, 128), dst, src, 2)
    assert (one.block, one.shape, one.dst_strides, one.src_strides) == (256, (8, 64), (256, 2048), (524288, 8192))
    first = native.Blocks((32, 64, 1024), (2048, 65536, 2), (33554432, 2048, 2), 2)
    assert (first.block, first.shape, first.src_strides) == (2048, (64, 32), (2048, 33554432))
    back = native.Blocks((1, 64, 8, 128), src, dst, 2)
    assert (back.shape, back.dst_strides, back.src_strides) == ((64, 8), (8192, 524288), (2048, 256))


@pytest.mark.parametrize("slots, tile", [(64, 4), (6, 2), (7, 1), (1, 1)])
def test_a_page_first_load_run_writes_each_layer_a_tile_of_slots_at_a_time(slots, tile):
    """A page_first load run (slots x 16 layers of 2 KiB rows): the slots outermost, each
    layer's run of them written ``tile`` slots at a time, as many as fit 8 KiB and divide
    the page's slots (none when they do not split)."""
    b = native.Blocks((16, slots, 1024), (33554432, 2048, 2), (2048, 65536, 2), 2)
    if tile == 1:
        assert (b.shape, b.dst_strides) == (((slots, 16), (2048, 33554432)) if slots > 1 else ((16,), (33554432,)))
    else:
        assert (b.block, b.shape, b.dst_strides, b.src_strides) == (
            2048, (slots // tile, 16, tile), (2048 * tile, 33554432, 2048), (65536 * tile, 2048, 65536))


def test_no_tile_where_the_run_is_long_or_the_loops_are_full():
    """A backup into page_head (each head's 8 KiB run of a slot's layers written whole
    already), a page_first backup (one loop writes the run) and a copy with the compiled
    copy's six loops already keep their loops."""
    head = native.Blocks((32, 64, 8, 128), (256, 8192, 524288, 2), (33554432, 2048, 256, 2), 2)
    assert head.shape == (64, 8, 32)
    first = native.Blocks((32, 64, 1024), (2048, 65536, 2), (33554432, 2048, 2), 2)
    assert first.shape == (64, 32)
    shape, dst, src = [64, 2, 2, 2, 2, 2], [2048, 1 << 30, 1 << 28, 1 << 26, 1 << 24, 1 << 22], [1] * 6
    assert native._tiled(shape, dst, src, 2048) == (tuple(shape), tuple(dst), tuple(src))
    assert native._tiled(shape[:5], dst[:5], src[:5], 2048)[0] == (16, 2, 2, 2, 2, 4)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_load_runs_tiled_by_slots_move_what_numpy_moves(compiled, stores, plan_order, monkeypatch, layout, threads):
    """Load runs whose slots are cut in tiles (rows of 2 KiB: 4 of a page's 16 slots a
    tile, so each page has several) write every layer's pages as numpy's copy does, in
    each of a copy plan's candidate loop orders."""
    spec, ps = KVSpec.mha(5, 8, 128, dtype=torch.bfloat16), 16
    host = HostKVPool(spec, 6 * ps, ps, layout=layout)
    host.copy_threads = threads
    fill_random(host.raw, torch.Generator().manual_seed(3))
    seen, made = [], native.Blocks

    class Seen(made):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            seen.append(self.shape)

    monkeypatch.setattr(native, "Blocks", Seen)
    native._blocks.cache_clear()
    host_idx, dev_idx = slots([4, 1, 5, 0], ps), slots([5, 0, 6, 2], ps)
    pools = {}
    for native_on in ("1", "0"):
        monkeypatch.setenv("KVTIER_NATIVE", native_on)
        pools[native_on] = random_device_pool(spec, 8 * ps, ps, seed=4)
        for layers in (range(0, 1), range(1, 5)):
            host.load_to_device_layers(pools[native_on], host_idx, dev_idx, layers)
    assert torch.equal(bits(pools["1"].raw), bits(pools["0"].raw))
    assert (4, 4, 4) in seen or (4, 4, 4, 8) in seen  # the rule: 4 tiles of 4 slots, 4 layers (x 8 heads)


def test_a_plan_has_the_source_order_and_its_far_axis_inside_as_candidates():
    """A page_head backup's plan (slots, heads, layers by the rule) may also loop in the
    source's order (layers, slots, heads), and in the source's order with the rule's
    outermost axis, the slots, innermost (layers, heads, slots); a gather is in the
    source's order already, and ``KVTIER_COPY_TRIALS=0`` keeps every plan to its rule's."""
    b = native.Blocks((32, 64, 8, 128), (256, 8192, 524288, 2), (33554432, 2048, 256, 2), 2)
    assert b.orders == [((64, 8, 32), (8192, 524288, 256), (2048, 256, 33554432)),
                        ((32, 64, 8), (256, 8192, 524288), (33554432, 2048, 256)),
                        ((32, 8, 64), (256, 524288, 8192), (33554432, 256, 2048))]
    assert b.kept is None and b.loops() == b.orders[0] and b.page_bytes == 32 * 64 * 8 * 256
    assert len(b.orders) <= native.MAX_ORDERS
    gather = native.Blocks((1, 64, 8, 128), (33554432, 2048, 256, 2), (256, 8192, 524288, 2), 2)
    assert len(gather.orders) == 1 and gather.kept == 0
    first = native.Blocks((32, 64, 1024), (2048, 65536, 2), (33554432, 2048, 2), 2)  # page_first's backup
    assert first.orders == [((64, 32), (65536, 2048), (2048, 33554432)), ((32, 64), (2048, 65536), (33554432, 2048))]


def test_copy_trials_switched_off_keep_the_rules_order(monkeypatch):
    monkeypatch.setenv("KVTIER_COPY_TRIALS", "0")
    b = native.Blocks((32, 64, 8, 128), (256, 8192, 524288, 2), (33554432, 2048, 256, 2), 2)
    assert b.orders == [((64, 8, 32), (8192, 524288, 256), (2048, 256, 33554432))] and b.kept == 0


def _timed_copies(monkeypatch, faster: int | None) -> list[int]:
    """Each compiled call's loop order from now on (its index in its plan's candidates),
    timed on a fake clock: a call in order ``faster`` takes 1 s, any other 2 s (None: 1 s
    each)."""
    real_built, now, seen = native.built, [0.0], []

    class Timed:
        def __init__(self, module) -> None:
            self.module = module

        def __getattr__(self, name):  # the rest of the module as it is (MAX_THREADS)
            return getattr(self.module, name)

        def copy_jobs(self, jobs, threads):
            loops = tuple(tuple(x) for x in jobs[0][4:7])
            plans = [p.blocks for p in native._PAIRS.values() if loops in p.blocks.orders]
            order = plans[0].orders.index(loops)
            seen.append(order)
            now[0] += 1.0 if faster in (None, order) else 2.0
            return self.module.copy_jobs(jobs, threads)

    monkeypatch.setattr(native, "built", lambda name: Timed(real_built(name)))
    monkeypatch.setattr(native, "_clock", lambda: now[0])
    native._blocks.cache_clear()
    native._PAIRS.clear()
    return seen


@pytest.mark.parametrize("faster", [0, 1, 2, None], ids=["rule-faster", "source-faster", "far-inside-faster", "tie"])
def test_a_plan_tries_each_order_on_large_copies_then_keeps_the_faster(compiled, monkeypatch, faster):
    """A page_head backup's first large copies take the plan's three orders in turn, each
    ``TRIALS`` times, timed; every later one takes the fastest (a tie: the rule's). Every
    copy writes the bytes numpy's path writes."""
    spec, ps = KVSpec.mha(4, 4, 64), 16  # 128-byte blocks
    monkeypatch.setattr(native, "TRIAL_BYTES", 0)
    host_idx, dev_idx = slots([3, 0, 5, 6], ps), slots([6, 2, 0, 4], ps)
    src = random_device_pool(spec, 8 * ps, ps, seed=1)
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    want = HostKVPool(spec, 8 * ps, ps, layout="page_head")
    want.raw.zero_()
    want.backup_from_device_all_layer(src, host_idx, dev_idx, "direct")
    monkeypatch.setenv("KVTIER_NATIVE", "1")
    host = HostKVPool(spec, 8 * ps, ps, layout="page_head")
    seen = _timed_copies(monkeypatch, faster)
    for _ in range(3 * native.TRIALS + 2):
        host.raw.zero_()
        host.backup_from_device_all_layer(src, host_idx, dev_idx, "direct")
        assert torch.equal(bits(host.raw), bits(want.raw))
    assert seen == [0, 1, 2] * native.TRIALS + [faster or 0] * 2


def test_small_copies_take_the_rules_order_untimed(compiled, monkeypatch):
    """Copies under ``TRIAL_BYTES`` leave a plan on trial alone: the rule's order, no timing."""
    spec, ps = KVSpec.mha(4, 4, 64), 16
    src = random_device_pool(spec, 8 * ps, ps, seed=1)
    host = HostKVPool(spec, 8 * ps, ps, layout="page_head")
    seen = _timed_copies(monkeypatch, 1)
    for _ in range(3 * native.TRIALS + 1):
        host.backup_from_device_all_layer(src, slots([1, 2], ps), slots([3, 4], ps), "direct")
    assert seen == [0] * (3 * native.TRIALS + 1)


def test_a_trial_call_that_fails_counts_for_nothing(compiled, monkeypatch):
    """A trial call whose compiled copy raises leaves its plan's trial as it was (no try
    counted, nothing kept); the calls after it try the orders as before."""
    spec, ps = KVSpec.mha(4, 4, 64), 16
    monkeypatch.setattr(native, "TRIAL_BYTES", 0)
    src = random_device_pool(spec, 8 * ps, ps, seed=1)
    host = HostKVPool(spec, 8 * ps, ps, layout="page_head")
    seen = _timed_copies(monkeypatch, None)
    timed_built, failing = native.built, [True]

    class FailOnce:
        def __getattr__(self, name):  # the rest of the module as it is (MAX_THREADS)
            return getattr(timed_built(native.COMPILED), name)

        def copy_jobs(self, jobs, threads):
            if failing:
                failing.clear()
                raise ValueError("a copy that fails")
            return timed_built(native.COMPILED).copy_jobs(jobs, threads)

    monkeypatch.setattr(native, "built", lambda name: FailOnce())
    with pytest.raises(ValueError, match="a copy that fails"):
        host.backup_from_device_all_layer(src, slots([3, 0], ps), slots([6, 2], ps), "direct")
    plans = [p.blocks for p in native._PAIRS.values()]
    assert plans and all(b.kept is None and not any(b._tries) for b in plans)
    for _ in range(3 * native.TRIALS):
        host.backup_from_device_all_layer(src, slots([3, 0], ps), slots([6, 2], ps), "direct")
    assert seen == [0, 1, 2] * native.TRIALS and all(b.kept == 0 for b in plans)
