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


def test_every_copy_a_limit_tries_moves_its_bytes(monkeypatch):
    """Every candidate (torch's copy_, the compiled one; the given pair, a fresh written
    one) copies its bytes (the fastest is the limit: tests/bench/test_transfer.py)."""
    made = []
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(timing.torch, "empty", lambda *a, **k: made.append(real_empty(*a, **k)) or made[-1])
    monkeypatch.setattr(timing.torch, "empty_like", lambda *a, **k: made.append(real_empty_like(*a, **k)) or made[-1])
    dst, src = torch.zeros(4096, dtype=torch.uint8), torch.randint(1, 256, (4096,), dtype=torch.uint8)
    copies = timing.limit_copies(dst, src, 4096)
    assert [n for n, _ in copies] == [4096] * len(copies) and len(copies) == (4 if native.enabled() else 2)
    fresh_dst, fresh_src = made
    assert bool((fresh_src == 2).all()) and bool((fresh_dst == 1).all())  # written before anything is timed
    for _, copy in copies[:len(copies) // 2]:  # the given pair's
        dst.zero_()
        copy()
        assert torch.equal(dst, src)
    for _, copy in copies[len(copies) // 2:]:  # the fresh pair's
        fresh_dst.zero_()
        copy()
        assert bool((fresh_dst == 2).all())


def test_rounds_run_every_function_once_in_turn_after_their_warmups(monkeypatch):
    """A round runs each function once, in order: figures timed in rounds fall in the same
    spells of the machine; each keeps its fastest run."""
    calls, ticks = [], iter(range(1000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(ticks)))
    fns = [lambda k=k: calls.append(k) for k in "abc"]
    best = timing.alternated(fns, 3, warmup=[2, 0, 1])
    assert calls == ["a", "a", "c"] + ["a", "b", "c"] * 3
    assert best == [1.0, 1.0, 1.0]  # each run reads the clock twice, one tick apart


@pytest.mark.parametrize("repeat, warmup, error", [(0, 1, "repeat must be at least 1"),
                                                   (2, [1], "1 warmup counts for 2 functions")])
def test_rounds_refuse_bad_counts_before_running_anything(repeat, warmup, error):
    calls = []
    with pytest.raises(Exception, match=error):
        timing.alternated([lambda: calls.append(1)] * 2, repeat, warmup)
    assert calls == []


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
    """The fresh buffers the limit times are ``fresh_bytes`` of the copy each."""
    monkeypatch.setattr(timing, "fresh_bytes", lambda n: n // 2)
    copies = timing.limit_copies(torch.ones(8192, dtype=torch.uint8), torch.zeros(8192, dtype=torch.uint8), 8192)
    half = len(copies) // 2
    assert [n for n, _ in copies] == [8192] * half + [4096] * half
