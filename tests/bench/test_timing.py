"""The benchmarks' copy limit: the machine's fastest contiguous copy, never over memory
that was never written (that reads the shared zero page, nearly free)."""

import pytest
import torch

import kvtier.bench.timing as timing
from kvtier.transfer import native


@pytest.mark.parametrize("size", [1_000_003, 3 << 20, (5 << 20) + 17])
def test_the_compiled_limit_copy_moves_every_byte(monkeypatch, size):
    """Rows split over threads, then the rest (none, or less than a row): every byte."""
    monkeypatch.setattr(timing, "_ROW", 1 << 20)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    if not native.enabled():
        pytest.skip("kvtier's compiled copy is not built (or KVTIER_NATIVE=0): the limit is torch's copy_ alone")
    timing._native_copy(3, dst, src)
    assert torch.equal(dst, src)


def test_the_limit_is_the_best_of_every_copy_it_tried(monkeypatch):
    """Every candidate (torch's copy_, the compiled one; the given pair, a fresh one) is
    timed, each fresh buffer written first, and the fastest is the limit."""
    tried, written = [], []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        real_fill = t.fill_
        t.fill_ = lambda v: (written.append(t.data_ptr()), real_fill(v))[1]
        return t

    def gbps(d, s, repeat):
        tried.append((d.data_ptr(), s.data_ptr()))
        return 10.0 * len(tried)

    monkeypatch.setattr(timing.torch, "empty", empty)
    monkeypatch.setattr(timing, "_copy_gbps", gbps)
    dst, src = torch.ones(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    assert timing.memcpy_gbps(dst, src, 4096, 1) == 20.0
    assert tried[0] == (dst.data_ptr(), src.data_ptr())
    assert tried[1][0] in written and tried[1][1] != src.data_ptr()


@pytest.mark.parametrize("nbytes, llc, want", [
    (2 << 30, 300 << 20, 600 << 20),   # a pool's worth past a 300 MiB L3: twice the L3
    (2 << 30, 32 << 20, 256 << 20),    # a small L3: FRESH_LIMIT_BYTES
    (2 << 30, 0, 256 << 20),           # sysfs tells nothing
    (100 << 20, 300 << 20, 100 << 20),  # a copy smaller than either: the copy's own bytes
    (2 << 30, 2 << 30, 2 << 30),       # never more than the copy
])
def test_the_fresh_pair_holds_the_copy_cut_to_twice_the_last_level_cache(nbytes, llc, want):
    assert timing.FRESH_LIMIT_BYTES == 256 << 20
    assert timing.fresh_bytes(nbytes, llc) == want


def test_the_fresh_pair_is_as_large_as_fresh_bytes_says(monkeypatch):
    """The fresh buffers ``memcpy_gbps`` times are ``fresh_bytes`` of the copy each."""
    sizes = []
    monkeypatch.setattr(timing, "fresh_bytes", lambda n: n // 2)
    monkeypatch.setattr(timing, "_copy_gbps", lambda d, s, repeat: sizes.append((d.numel(), s.numel())) or 1.0)
    timing.memcpy_gbps(torch.ones(8192, dtype=torch.uint8), torch.zeros(8192, dtype=torch.uint8), 8192, 1)
    assert sizes == [(8192, 8192), (4096, 4096)]
