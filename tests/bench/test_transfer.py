"""``kvtier bench transfer``'s limits: each layout's limit copies and its rows are timed
in the same rounds, so a row and its limit see the same spells of the machine, and the
limit's copies again in rounds of their own before and after; the limit is the fastest
of them all."""

import pytest

import kvtier.bench.transfer as transfer
import kvtier.bench.transfer_hybrid as transfer_hybrid
import torch

from kvtier import KVSpec
from kvtier.cli.spec import parse_hybrid


def _rounds(monkeypatch, seconds_of):
    """Replace the rounds with a record of what each call would time: ``(fns, warmups)``;
    fn ``i`` of call ``c`` takes ``seconds_of(c, i, fn)``."""
    calls = []

    def alternated(fns, repeat, warmup=1, cuda=False):
        calls.append((list(fns), [warmup] * len(fns) if isinstance(warmup, int) else list(warmup)))
        return [seconds_of(len(calls) - 1, i, fn) for i, fn in enumerate(fns)]

    monkeypatch.setattr(transfer, "alternated", alternated)
    return calls


@pytest.mark.parametrize("fastest", [0, 1, 2], ids=["before", "in-the-rounds", "after"])
def test_each_layouts_rows_and_limit_copies_are_timed_in_the_same_rounds(monkeypatch, fastest):
    spec = KVSpec.mha(2, 2, 16)
    nbytes = 4 * 4 * spec.bytes_per_token
    # per layout three calls: before, the rounds, after; in each, later functions slower
    calls = _rounds(monkeypatch, lambda c, i, fn: (1.0 if c % 3 == fastest else 3.0) + i)
    rows, limit = transfer.bench_spec(spec, page_size=4, pages=4, layouts=["page_head", "page_first"],
                                      backends=["direct", "kernel"], repeat=2, seed=0)
    assert len(calls) == 6 and len(rows) == 12
    for layout in range(2):
        (before, warm_before), (rounds, warm_rounds), (after, warm_after) = calls[3 * layout:3 * layout + 3]
        n = len(before)
        assert n in (4, 8)  # per direction: torch's copy and (compiled) kvtier's, pool pair and fresh pair
        assert rounds[:n] == before == after and len(rounds) == n + 6  # two backends' three rows
        assert warm_before == [1] * n and warm_rounds == [0] * n + [transfer.ROW_WARMUP] * 6 and warm_after == [0] * n
    # backup's candidates come first: its fastest is the first function, load's the first after them
    per_direction = len(calls[0][0]) // 2
    want = {"backup": nbytes / 1.0 / 1e9, "load": nbytes / (1.0 + per_direction) / 1e9}
    want["load runs"] = want["load"]
    assert limit == pytest.approx(want)
    for r in rows:
        assert r.memcpy_gbps == pytest.approx(want[r.direction]) and r.ratio == pytest.approx(r.gbps / r.memcpy_gbps)


def test_a_hybrid_rows_limit_moves_each_groups_bytes_at_that_groups_best_copy(monkeypatch):
    spec = parse_hybrid("layers=4,pattern=SF;full:heads=1,head_dim=8;swa:window=8,heads=2,head_dim=8",
                        torch.bfloat16)
    rate = {}  # GB/s per group's bytes

    def copies(dst, src, nbytes):
        def copy():
            pass
        copy.seconds = nbytes / 1e9 / rate.setdefault(nbytes, 1.0 + len(rate))
        return [(nbytes, copy), (nbytes, lambda: None)]  # the second much slower (below: 1 s)

    monkeypatch.setattr(transfer_hybrid, "limit_copies", copies)
    calls = _rounds(monkeypatch, lambda c, i, fn: getattr(fn, "seconds", 1.0))
    rows, limit, _ = transfer_hybrid.bench_hybrid(spec, tokens=32, page_size=4, layouts=["page_head"],
                                                  backends=["direct"], repeat=1, seed=0)
    assert len(calls) == 3 and len(calls[1][0]) == 2 * 2 * 2 + 3 and len(rows) == 3
    total = sum(rate)
    want = total / sum(n / r for n, r in rate.items())
    assert len(rate) == 2 and limit == pytest.approx(dict.fromkeys(transfer.DIRECTIONS, want))
    assert all(r.memcpy_gbps == pytest.approx(want) for r in rows)
