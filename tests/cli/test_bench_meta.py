"""``kvtier bench meta``: refusals are one line before any timing; the JSON names every
row with its floor; ``--load`` processes are gone when the command returns."""

import json

import pytest
import torch

from kvtier.bench import meta
from kvtier.cli import main


def run(capsys, *argv):
    code = main(["bench", "meta", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["--load", "-1"], "--load: must be >= 0, got '-1'"),
    (["--load", "x"], "--load: must be an integer, got 'x'"),
    (["--load", "100000"], "--load 100000: more than 4 busy processes per CPU"),
    (["--threads", "0"], "--threads: must be a positive integer, got '0'"),
    (["--pages", "0"], "--pages: must be a positive integer, got '0'"),
    (["--repeat", "0"], "--repeat: must be a positive integer, got '0'"),
    (["--page-size", "-4"], "--page-size: must be a positive integer, got '-4'"),
    (["--dims", "128/x"], "--dims: '128/x' in '128/x': expected K or K/V head dims"),
    (["--layouts", "page_frist"], "unknown name 'page_frist' in 'page_frist'; choose from"),
    (["--pages", "10000000000000"], "10000000000000 pages of 64 tokens needs about"),
])
def test_misuse_is_refused_in_one_line_before_any_timing(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(meta, "run", lambda **kw: pytest.fail("timing started before the misuse was refused"))
    code, out, err = run(capsys, *argv)
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("kvtier bench meta: error: ") and message in lines[0], lines[0]


def test_json_rows_cover_every_kind_and_form(capsys):
    threads = torch.get_num_threads()
    code, out, _ = run(capsys, "--layers", "2", "--heads", "4", "--dims", "16,24/16", "--page-size", "4",
                       "--pages", "8", "--repeat", "3", "--threads", "1", "--json")
    assert code == 0 and torch.get_num_threads() == threads  # --threads is undone after the run
    result = json.loads(out)
    assert result["config"]["torch_threads"] == 1 and set(result["config"]["floors"]) == {"list", "array"}
    rows = {(r["spec"], r["layout"], r["kind"], r["form"]): r for r in result["rows"]}
    kinds = {("page_head", k) for k in ("page", "split_heads/2", "split_heads/4")}
    kinds |= {(lay, "page") for lay in ("layer_first", "page_first", "page_first_direct")}
    assert set(rows) == {(s, lay, k, f) for s in ("L2-bf16-k=4x16-v=4x16", "L2-bf16-k=4x24-v=4x16")
                         for lay, k in kinds for f in ("list", "array")}
    for (spec, layout, kind, form), r in rows.items():
        per_page = 2 * (2 if layout == "layer_first" else int(kind.split("/")[1]) if "/" in kind else 1)
        assert r["spans"] == 8 * per_page and r["pages"] == 8
        assert r["p90_ms"] >= r["p50_ms"] > 0 and r["floor_p90_ms"] >= r["floor_p50_ms"] > 0
        assert r["ratio"] == pytest.approx(r["p50_ms"] / r["floor_p50_ms"])


def test_load_processes_run_during_the_timing_and_end_after(capsys, monkeypatch):
    seen = []
    real = meta.bench_spec

    def spy(*args, **kwargs):
        seen.append([p.poll() for p in spy.procs])
        return real(*args, **kwargs)

    spy.procs = []
    real_popen = meta.subprocess.Popen

    def popen(*args, **kwargs):
        p = real_popen(*args, **kwargs)
        spy.procs.append(p)
        return p

    monkeypatch.setattr(meta, "bench_spec", spy)
    monkeypatch.setattr(meta.subprocess, "Popen", popen)
    code, out, _ = run(capsys, "--layers", "1", "--heads", "2", "--dims", "8", "--page-size", "2", "--pages", "4",
                       "--repeat", "2", "--layouts", "page_head", "--load", "2")
    assert code == 0 and "2 competing CPU-bound processes" in out and "split_heads/2" in out
    assert seen == [[None, None]]  # both running while timed
    assert len(spy.procs) == 2 and all(p.returncode is not None for p in spy.procs)
