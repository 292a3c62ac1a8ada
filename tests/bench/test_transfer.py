"""``kvtier bench transfer``'s limits: each layout's copy limit is timed before and after
its rows and the faster kept, so a limit timed while the machine stalled never makes a
row look faster than a plain copy."""

import pytest

import kvtier.bench.transfer as transfer
import kvtier.bench.transfer_hybrid as transfer_hybrid
import torch

from kvtier import KVSpec
from kvtier.cli.spec import parse_hybrid


@pytest.mark.parametrize("slow_first", [True, False], ids=["stalled-before", "stalled-after"])
def test_each_layouts_limit_is_the_faster_of_before_and_after_its_rows(monkeypatch, slow_first):
    calls = []

    def gbps(dst, src, nbytes, repeat):
        calls.append(nbytes)
        stalled = (len(calls) % 4 in (1, 2)) == slow_first  # per layout: two before the rows, two after
        return 1.0 if stalled else 5.0

    monkeypatch.setattr(transfer, "memcpy_gbps", gbps)
    rows, limit = transfer.bench_spec(KVSpec.mha(2, 2, 16), page_size=4, pages=4, layouts=["page_head", "page_first"],
                                      backends=["direct"], repeat=1, seed=0)
    assert len(calls) == 8 and len(rows) == 6
    assert {r.memcpy_gbps for r in rows} == {5.0} and limit == dict.fromkeys(transfer.DIRECTIONS, 5.0)
    assert all(r.ratio == pytest.approx(r.gbps / 5.0) for r in rows)


def test_a_hybrid_layouts_limit_is_the_faster_of_before_and_after_its_rows(monkeypatch):
    spec = parse_hybrid("layers=4,pattern=SF;full:heads=1,head_dim=8;swa:window=8,heads=2,head_dim=8",
                        torch.bfloat16)
    calls = []

    def gbps(dst, src, nbytes, repeat):
        calls.append(nbytes)
        return 2.0 if len(calls) <= 4 else 7.0  # two groups, two directions: four before the rows

    monkeypatch.setattr(transfer_hybrid, "memcpy_gbps", gbps)
    rows, limit, _ = transfer_hybrid.bench_hybrid(spec, tokens=32, page_size=4, layouts=["page_head"],
                                                  backends=["direct"], repeat=1, seed=0)
    assert len(calls) == 8 and all(r.memcpy_gbps == pytest.approx(7.0) for r in rows) and len(rows) == 3
