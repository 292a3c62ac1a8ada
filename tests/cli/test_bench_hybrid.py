"""``kvtier bench transfer`` over hybrid specs: one pool per layer group, one resume point,
full groups moving every page and sliding groups one window; the bytes it reports come
from ``HybridSpec`` arithmetic and the bytes it copied are counted in the pools."""

import json
from dataclasses import fields

import pytest

import kvtier.bench.timing as transfer_timing
from kvtier.bench.transfer import MetaRow, TransferRow
from kvtier.bench.transfer_hybrid import ResumeBytes, check_hybrid, hybrid_memory_bytes, resume_pages
from kvtier.cli import main
from kvtier.hybrid import gpt_oss, mimo_v2_flash
from kvtier.pools.hybrid import HybridHostPool

# full: layers 1,3, 1 head of K 8 / V 8 (64 B a token); swa: layers 0,2, window 8, 2 heads of K 8 / V 4 (96 B a token)
TINY = "hybrid:layers=4,pattern=SF;full:heads=1,head_dim=8;swa:window=8,heads=2,head_dim=8,v_head_dim=4"
SMALL = ["--page-size", "2,4", "--pages", "8", "--repeat", "1"]  # a prefix of 8 x 4 = 32 tokens
TINY_BYTES = {"tokens": 32, "full_bytes_per_token": 64, "window_bytes": 8 * 96, "hybrid_bytes": 32 * 64 + 8 * 96,
              "hybrid_bytes_per_token": (32 * 64 + 8 * 96) / 32, "window_blind_bytes": 32 * 160,
              "window_blind_bytes_per_token": 160, "window_blind_ratio": 32 * 160 / (32 * 64 + 8 * 96)}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def bench_json(capsys, *argv):
    code, out, _ = run(capsys, "bench", "transfer", *argv, "--json")
    return code, json.loads(out)


def test_hybrid_bench_json_has_ratios_and_the_spec_bytes(capsys):
    code, data = bench_json(capsys, "--spec", TINY, *SMALL)
    assert code == 0
    cfg = data["config"]
    assert cfg["prefix_tokens"] == 32 and cfg["resume_points"] == 1 and cfg["page_sizes"] == [2, 4]
    assert [(g["name"], g["attention"], g["window"], g["layers"], g["bytes_per_token"]) for g in cfg["groups"]] == [
        ("full", "full", None, "1,3", 64), ("swa", "sliding", 8, "0,2", 96)]
    # full groups: every page of the prefix; sliding: the pages of the 8 tokens before the resume point
    assert data["pages_moved"] == {"p2": {"full": 16, "swa": 4}, "p4": {"full": 8, "swa": 2}}
    assert len(data["transfer"]) == 2 * 4 * 2 * 3  # page sizes x layouts x backends x directions
    for row in data["transfer"]:
        best = data["memcpy_gbps"][f"p{row['page_size']}"][row["direction"]]
        assert row["gbytes"] == pytest.approx(TINY_BYTES["hybrid_bytes"] / 1e9)
        assert row["gbps"] > 0 and 0 < row["memcpy_gbps"] <= best
        assert row["ratio"] > 0 and row["ratio"] == pytest.approx(row["gbps"] / row["memcpy_gbps"])
    for key, limit in data["memcpy_gbps"].items():
        for direction in ("backup", "load", "load runs"):
            assert limit[direction] == max(r["memcpy_gbps"] for r in data["transfer"]
                                           if f"p{r['page_size']}" == key and r["direction"] == direction)
    b = data["bytes"]
    assert {k: b[k] for k in TINY_BYTES} == TINY_BYTES
    assert b["copied"] == {key: {"backup": 2816, "load": 2816, "load runs": 2816} for key in ("p2", "p4")}
    assert b["copied_equal"]


@pytest.mark.parametrize("name, spec, hybrid_bytes", [
    ("mimo-v2-flash", mimo_v2_flash(), 256 * 23_040 + 128 * 199_680),
    ("gpt-oss-120b", gpt_oss(36), 256 * 36_864 + 128 * 36_864),
])
def test_presets_copy_what_bytes_for_counts(capsys, name, spec, hybrid_bytes):
    code, data = bench_json(capsys, "--spec", name, "--page-size", "64", "--pages", "4", "--layouts", "page_head",
                            "--backends", "direct", "--repeat", "1")
    b = data["bytes"]
    assert code == 0 and data["pages_moved"] == {"p64": {"full": 4, "swa": 2}}
    assert b["hybrid_bytes"] == hybrid_bytes == spec.bytes_for(256, 1)
    assert b["window_blind_bytes"] == 256 * spec.uniform_bytes_per_token
    assert b["window_blind_ratio"] == pytest.approx(256 * spec.uniform_bytes_per_token / hybrid_bytes)
    assert b["copied"] == {"p64": dict.fromkeys(("backup", "load", "load runs"), hybrid_bytes)} and b["copied_equal"]
    directions = ("backup", "load", "load runs")
    assert {(r["direction"], r["ratio"] > 0) for r in data["transfer"]} == {(d, True) for d in directions}


def test_hybrid_bench_text_reports_bytes_per_token_and_per_resume_point(capsys):
    code, out, _ = run(capsys, "bench", "transfer", "--spec", TINY, *SMALL, "--layouts", "page_first",
                       "--backends", "direct")
    assert code == 0
    assert "one resume point after 32 tokens" in out and "p2: pages moved full 16, swa 4; best memcpy" in out
    assert ("bytes: 64 B per cached token (full groups) + 768 B per resume point (sliding windows); at 32 tokens a "
            "hybrid-aware transfer moves 2,816 B (88 B per token), a window-blind one 5,120 B (160 B per token), "
            "1.82x as many") in out
    assert ("bytes copied (counted in the pools): p2 backup 2,816 B, load 2,816 B, load runs 2,816 B; p4 backup "
            "2,816 B, load 2,816 B, load runs 2,816 B; equal to HybridSpec.bytes_for(32, 1) = 2,816 B") in out


def test_copied_bytes_are_counted_in_the_pools(capsys, monkeypatch):
    """A load that skips a layer is caught: the count comes from the pools, not from the plan."""
    load = HybridHostPool.load_to_device_per_layer

    def skip_layer_0(self, device_pool, host_indices, device_indices, layer_id, io_backend="direct"):
        if layer_id != 0:
            load(self, device_pool, host_indices, device_indices, layer_id, io_backend)

    monkeypatch.setattr(HybridHostPool, "load_to_device_per_layer", skip_layer_0)
    argv = ["--spec", TINY, "--page-size", "4", "--pages", "8", "--repeat", "1", "--layouts", "page_head",
            "--backends", "direct"]
    code, data = bench_json(capsys, *argv)
    assert code == 1 and not data["bytes"]["copied_equal"]
    # swa layer 0: 8 tokens x 48 B
    assert data["bytes"]["copied"] == {"p4": {"backup": 2816, "load": 2816 - 8 * 48, "load runs": 2816}}
    code, out, _ = run(capsys, "bench", "transfer", *argv)
    assert code == 1 and "load 2,432 B, load runs 2,816 B; MISMATCH: not equal to HybridSpec.bytes_for(32, 1)" in out


def test_runs_that_skip_a_layer_are_caught_too(capsys, monkeypatch):
    """The load in runs is counted in the pools as well: a run one layer short fails the check."""
    load = HybridHostPool.load_to_device_layers

    def short(self, device_pool, host_indices, device_indices, layers, io_backend="direct"):
        load(self, device_pool, host_indices, device_indices, layers if len(layers) == 1 else layers[:-1], io_backend)

    monkeypatch.setattr(HybridHostPool, "load_to_device_layers", short)
    code, data = bench_json(capsys, "--spec", TINY, "--page-size", "4", "--pages", "8", "--repeat", "1",
                            "--layouts", "page_head", "--backends", "direct")
    copied = data["bytes"]["copied"]["p4"]
    assert code == 1 and not data["bytes"]["copied_equal"]
    assert copied["backup"] == copied["load"] == 2816 and copied["load runs"] < 2816


def test_window_blind_copies_fail_the_check(capsys, monkeypatch):
    every_page = lambda spec, tokens, page_size: {g.name: range(tokens // page_size) for g in spec.groups}  # noqa: E731
    monkeypatch.setattr("kvtier.bench.transfer_hybrid.resume_pages", every_page)
    code, data = bench_json(capsys, "--spec", TINY, "--page-size", "4", "--pages", "8", "--repeat", "1",
                            "--layouts", "layer_first", "--backends", "kernel")
    assert code == 1 and data["bytes"]["copied"] == {"p4": dict.fromkeys(("backup", "load", "load runs"), 5120)}


def test_each_row_is_judged_by_each_groups_memcpy(capsys, monkeypatch):
    """A row's limit: one memcpy of each group's bytes between that group's pools, one after the other
    (its copies timed in the same rounds as the layout's rows)."""
    seen = []

    def limit_copies(dst, src, nbytes):
        def copy():
            pass
        seen.append(nbytes)
        copy.seconds = nbytes / 1e9 / {32 * 64: 1.0, 8 * 96: 4.0}[nbytes]  # GB/s: full group's bytes, sliding group's
        return [(nbytes, copy)]

    def alternated(fns, repeat, warmup=1, cuda=False):
        return [getattr(fn, "seconds", None) or real(fn) for fn in fns]

    def real(fn):
        return transfer_timing.alternated([fn], 1)[0]

    monkeypatch.setattr("kvtier.bench.transfer_hybrid.limit_copies", limit_copies)
    monkeypatch.setattr("kvtier.bench.transfer.alternated", alternated)
    code, data = bench_json(capsys, "--spec", TINY, "--page-size", "4", "--pages", "8", "--repeat", "1",
                            "--layouts", "page_first_direct", "--backends", "direct")
    assert code == 0 and sorted(seen) == [768] * 2 + [2048] * 2
    limit = 2816 / (2048 / 1.0 + 768 / 4.0)
    assert data["memcpy_gbps"] == {"p4": dict.fromkeys(("backup", "load", "load runs"), pytest.approx(limit))}
    assert all(r["memcpy_gbps"] == pytest.approx(limit) for r in data["transfer"])


def test_resume_arithmetic_of_mimo():
    mimo = mimo_v2_flash()
    assert check_hybrid(mimo, page_sizes=(16, 64), pages=256) == 16_384
    assert resume_pages(mimo, 16_384, 64) == {"full": range(0, 256), "swa": range(254, 256)}
    assert resume_pages(mimo, 100, 64) == {"full": range(0, 2), "swa": range(0, 2)}  # shorter than the window
    assert ResumeBytes.of(mimo, 16_384) == ResumeBytes(
        16_384, 23_040, 128 * 199_680, 16_384 * 23_040 + 128 * 199_680, (16_384 * 23_040 + 128 * 199_680) / 16_384,
        16_384 * 222_720, 222_720, 16_384 * 222_720 / (16_384 * 23_040 + 128 * 199_680))
    assert hybrid_memory_bytes(mimo, page_sizes=(64,), pages=256) == (16_384 * 222_720,) * 2
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        check_hybrid(mimo, page_sizes=(0, 64), pages=1)
    with pytest.raises(ValueError, match="page size 256 does not divide the 128-token window of group 'swa'"):
        check_hybrid(mimo, page_sizes=(64, 256), pages=1)


UNIFORM_CONFIG = ["page_sizes", "pages", "repeat", "torch_threads", "dtype", "device", "device_name", "copy_path",
                  "store_bytes"]


def test_uniform_json_keys_are_unchanged(capsys):
    code, data = bench_json(capsys, "--layers", "2", "--heads", "2", "--dims", "16", "--page-size", "4", "--pages",
                            "4", "--layouts", "page_head", "--backends", "direct", "--repeat", "1", "--meta-pages", "4")
    assert code == 0 and list(data) == ["config", "memcpy_gbps", "transfer", "meta", "seconds"]
    assert list(data["config"]) == ["layers", "heads", "dims"] + UNIFORM_CONFIG
    assert data["config"]["dtype"] == "bf16" and list(data["memcpy_gbps"]) == ["L2-bf16-k=2x16-v=2x16/p4"]
    assert [list(r) for r in data["transfer"]] == [[f.name for f in fields(TransferRow)]] * 3  # backup, load, runs
    assert {tuple(r) for r in data["meta"]} == {tuple(f.name for f in fields(MetaRow))}
    code, out, _ = run(capsys, "bench", "transfer", "--layers", "2", "--heads", "2", "--dims", "16", "--page-size",
                       "4", "--pages", "4", "--layouts", "page_head", "--backends", "direct", "--repeat", "1",
                       "--meta-pages", "4")
    assert code == 0 and out.startswith("2 layers, 2 KV heads, bf16, page sizes [4], 4 pages (of the largest size)")


def test_a_uniform_spec_runs_the_uniform_bench(capsys):
    code, data = bench_json(capsys, "--mha", "layers=2,heads=2,head_dim=16,v_head_dim=8", "--dtype", "fp16",
                            "--page-size", "4", "--pages", "4", "--layouts", "layer_first", "--backends", "direct",
                            "--repeat", "1", "--meta-pages", "4")
    assert code == 0 and list(data) == ["config", "memcpy_gbps", "transfer", "meta", "seconds"]
    assert list(data["config"]) == ["spec"] + UNIFORM_CONFIG and data["config"]["dtype"] == "fp16"
    assert {r["spec"] for r in data["transfer"]} == {"L2-fp16-k=2x16-v=2x8"}
    assert data["transfer"][0]["gbytes"] == pytest.approx(16 * 2 * 2 * (16 + 8) * 2 / 1e9)


def test_a_one_head_spec_has_no_split_heads_rows(capsys):
    code, data = bench_json(capsys, "--spec", "deepseek-v3", "--page-size", "16", "--pages", "2", "--layouts",
                            "page_head", "--backends", "direct", "--repeat", "1", "--meta-pages", "4")
    assert code == 0 and data["config"]["spec"] == "L61-bf16-kv=1x576"
    assert {r["kind"] for r in data["meta"]} == {"page"}
