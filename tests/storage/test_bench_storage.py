"""``kvtier bench storage`` for the file backend: its JSON, the io_threads option."""

import json
import math

import pytest

from kvtier.bench import storage as bench
from kvtier.cli import main

SMALL = dict(layers=2, heads=2, head_dim=8, page_size=4, pages=4)


def test_json_reports_both_figures_and_their_ratio(capsys):
    args = ["bench", "storage", "--backends", "file", "--layers", "2", "--heads", "2", "--head-dim", "8",
            "--page-size", "4", "--pages", "4", "--repeat", "1", "--io-threads", "1", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["io_threads"] == 1 and set(out["skipped"]) <= {"vllm fs", "vllm fs o_direct"}
    assert out["config"]["objects_per_page"] == {"file": 1, "redis": 2, "mooncake": 2}
    # one file a page; read from the page cache, then out of it
    assert [(r["backend"], r["op"], r["objects"]) for r in out["rows"]][:3] == \
        [("file", "put", 4), ("file", "get", 4), ("file", "cold get", 4)]
    for r in out["rows"]:
        assert math.isclose(r["ratio"], r["kvtier_gbps"] / r["raw_gbps"], rel_tol=1e-9)
        assert math.isclose(r["median_ratio"], r["kvtier_median_gbps"] / r["raw_median_gbps"], rel_tol=1e-9)


def test_best_and_median_rounds_come_from_the_timed_rounds_alone(monkeypatch):
    """The first round warms up and is not counted; the best and the median of the
    others are each client's own."""
    rounds = {"a": iter([9.0, 1.0, 5.0, 3.0]), "b": iter([9.0, 2.0, 2.0, 8.0])}
    clock = {"now": 0.0}
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock["now"])

    def client(name):
        def fn():
            clock["now"] += next(rounds[name])
        return fn, lambda: None

    times = bench._alternated({"a": client("a"), "b": client("b")}, repeat=3)
    assert times == {"a": [1.0, 5.0, 3.0], "b": [2.0, 2.0, 8.0]}


@pytest.mark.parametrize("io_threads", [0, True, 1.5])
def test_bad_io_threads_raise(io_threads):
    with pytest.raises(ValueError, match="io_threads must be a positive int"):
        bench.run(**SMALL, backends=("file",), io_threads=io_threads)


def test_every_file_put_starts_with_the_last_ones_writeback_done(monkeypatch):
    """Before each put round of kvtier, the raw client and each peer (untimed), the
    files' dirty pages are written back: a ``sync`` right after the round's clear, and
    none inside a put."""
    from kvtier.storage.file import FileStorage

    events = []
    real_set = FileStorage.batch_set
    monkeypatch.setattr(bench.os, "sync", lambda: events.append("sync"))
    monkeypatch.setattr(FileStorage, "batch_set",
                        lambda self, *a: events.append("put") or real_set(self, *a))
    out = bench.run(**SMALL, backends=("file",), repeat=2)  # and a first round that warms up
    clients = 2 + sum(1 for r in out["rows"] if r["op"] == "put" and r["backend"] != "file")  # kvtier, raw, peers
    assert events.count("sync") == 3 * clients
    assert [e for e in events if e == "put"] == ["put"] * 3 and all(
        events[i - 1] == "sync" for i, e in enumerate(events) if e == "put")


def _result(direct_writes: bool, kvtier_put: float, o_direct_put: float | None) -> dict:
    rows = [{"backend": "file", "op": "put", "kvtier_median_gbps": kvtier_put, "raw_median_gbps": 9.0},
            {"backend": "file vs vllm fs buffered", "op": "put", "kvtier_median_gbps": kvtier_put,
             "raw_median_gbps": 0.8},
            {"backend": "file vs vllm fs o_direct", "op": "get", "kvtier_median_gbps": 1.0, "raw_median_gbps": 9.0}]
    if o_direct_put is not None:
        rows.append({"backend": "file vs vllm fs o_direct", "op": "put", "kvtier_median_gbps": kvtier_put,
                     "raw_median_gbps": o_direct_put})
    return {"config": {"direct_writes": direct_writes}, "rows": rows}


def test_the_write_mode_advice_comes_where_o_direct_puts_beat_buffered_ones():
    """Only where vLLM's O_DIRECT puts beat kvtier's buffered ones in the median rounds,
    and never for a run that wrote with O_DIRECT already or had no O_DIRECT peer."""
    advice = bench.write_mode_advice(_result(False, 0.86, 2.10))
    assert "2.10 GB/s" in advice and "0.86" in advice and "direct_writes=true" in advice
    assert bench.write_mode_advice(_result(False, 9.6, 2.4)) is None
    assert bench.write_mode_advice(_result(True, 0.86, 2.10)) is None
    assert bench.write_mode_advice(_result(False, 0.86, None)) is None


@pytest.mark.parametrize("mode", ["in_place", "staged"])
def test_cold_reads_opens_the_file_store_with_that_mode(monkeypatch, capsys, mode):
    """``--cold-reads`` fixes how the file store reads cold files (no trial rounds of the
    other way among the cold get's); the JSON and the header name it."""
    opened, real = [], bench.storage.open

    def spy(url, **kw):
        store = real(url, **kw)
        opened.append(store)
        return store

    monkeypatch.setattr(bench.storage, "open", spy)
    args = ["bench", "storage", "--backends", "file", "--layers", "2", "--heads", "2", "--head-dim", "8",
            "--page-size", "4", "--pages", "4", "--repeat", "1", "--cold-reads", mode]
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["cold_reads"] == mode
    assert [s.cold_reads.fixed for s in opened] == [mode]
    assert main(args) == 0
    assert f"cold_reads {mode};" in capsys.readouterr().out


def test_bad_cold_reads_are_refused():
    with pytest.raises(ValueError, match="cold_reads must be one of auto, staged, in_place, got 'cold'"):
        bench.run(**SMALL, backends=("file",), cold_reads="cold")
