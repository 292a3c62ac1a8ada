"""The console script's subcommands, run in-process through ``kvtier.cli.main``."""

import json

import pytest

from kvtier.cli import main
from kvtier.hybrid import mimo_v2_flash


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_prints_every_layout(capsys):
    code, out, _ = run(capsys, "inspect", "--mha", "layers=61,heads=8,head_dim=192,v_head_dim=128",
                       "--dtype", "bf16", "--page-size", "64")
    assert code == 0
    for layout in ("layer_first", "page_first", "page_first_direct", "page_head"):
        assert layout in out
    assert "L61-bf16-k=8x192-v=8x128" in out and "122 x" in out and "1024 x 256 B" in out


def test_inspect_json_and_other_geometries(capsys):
    code, out, _ = run(capsys, "inspect", "--mla", "layers=4,kv_lora_rank=512,qk_rope_head_dim=64",
                       "--page-size", "16", "--json")
    data = json.loads(out)
    assert code == 0 and data["spec"] == "L4-bf16-kv=1x576"
    assert {r["layout"]: r["spans_per_page"] for r in data["layouts"]}["layer_first"] == 4
    code, out, _ = run(capsys, "inspect", "--components", "2:k=2x8,v=2x4,idx=1x6", "--dtype", "fp32", "--json")
    assert code == 0 and json.loads(out)["spec"] == "L2-fp32-k=2x8-v=2x4-idx=1x6"
    code, out, _ = run(capsys, "inspect", "--k-only", "layers=2,heads=1,head_dim=128", "--json")
    assert code == 0 and json.loads(out)["spec"] == "L2-bf16-k=1x128"


@pytest.mark.parametrize("argv, message", [
    (["--mha", "layers=2,heads=8"], "missing head_dim"),
    (["--mha", "layers=2,heads=8,head_dim=x"], "head_dim='x' is not an integer"),
    (["--mha", "layers=2,heads=8,head_dim=64,rope=2"], "bad item 'rope=2'"),
    (["--mha", "layers=0,heads=8,head_dim=64"], "layer_num must be a positive int, got 0"),
    (["--mha", "layers=2,heads=8,head_dim=64", "--dtype", "bf17"], "unknown dtype 'bf17'"),
    ([], "exactly one of"),
    (["--mha", "layers=2,heads=8,head_dim=64", "--page-size", "0"], "--page-size: must be a positive integer, got '0'"),
])
def test_inspect_bad_spec_is_a_clear_error(capsys, argv, message):
    code, _, err = run(capsys, "inspect", *argv)
    assert code == 2 and message in err


def test_selfcheck_round_trips_every_layout(capsys):
    code, out, _ = run(capsys, "selfcheck", "--pages", "3", "--page-size", "4")
    assert code == 0
    from kvtier.transfer import IO_BACKENDS

    n = 4 * len(IO_BACKENDS)  # layouts x backends
    assert f"{n} of {n} round trips identical" in out and "MISMATCH" not in out


def test_bench_transfer_json_reports_ratios(capsys):
    code, out, _ = run(capsys, "bench", "transfer", "--layers", "2", "--heads", "2", "--dims", "16,24/16",
                       "--page-size", "4", "--pages", "8", "--repeat", "1", "--meta-pages", "16", "--json")
    data = json.loads(out)
    assert code == 0
    assert set(data["memcpy_gbps"]) == {"L2-bf16-k=2x16-v=2x16/p4", "L2-bf16-k=2x24-v=2x16/p4"}
    assert len(data["transfer"]) == 2 * 4 * 2 * 3  # specs x layouts x backends x directions
    assert {r["direction"] for r in data["transfer"]} == {"backup", "load", "load runs"}
    for row in data["transfer"]:  # each row against a memcpy between its own two pools; the best one is reported
        best = data["memcpy_gbps"][f"{row['spec']}/p{row['page_size']}"][row["direction"]]
        assert 0 < row["memcpy_gbps"] <= best
        assert row["gbps"] > 0 and row["ratio"] == pytest.approx(row["gbps"] / row["memcpy_gbps"])
    for spec in data["memcpy_gbps"]:
        for direction in ("backup", "load", "load runs"):
            assert data["memcpy_gbps"][spec][direction] == max(
                r["memcpy_gbps"] for r in data["transfer"]
                if f"{r['spec']}/p{r['page_size']}" == spec and r["direction"] == direction)
    assert data["transfer"][0]["gbytes"] == pytest.approx(8 * 4 * 2 * 2 * 2 * 32 / 1e9)
    spans = {(r["layout"], r["kind"]): r["spans"] for r in data["meta"]}
    assert spans[("layer_first", "page")] == 16 * 2 * 2 and spans[("page_head", "split_heads/2")] == 16 * 2 * 2


def test_bench_cache_json(capsys):
    code, out, _ = run(capsys, "bench", "cache", "--page-sizes", "4,16", "--prompt-tokens", "256",
                       "--tree-pages", "600", "--json")
    rows = json.loads(out)["rows"]
    assert code == 0 and [r["page_size"] for r in rows] == [4, 16]
    for r in rows:
        for kind in ("list", "array"):
            for tree in ("", "steady_"):  # a growing tree, and a full one (each insert's alloc evicts)
                assert 0 < r[f"{tree}insert_p50_us_{kind}"] <= r[f"{tree}insert_p99_us_{kind}"] \
                    <= r[f"{tree}insert_max_us_{kind}"]
                assert len(r[f"{tree}gc_runs_{kind}"]) == 3 and r[f"{tree}faults_per_insert_{kind}"] >= 0
                assert 0 < r[f"{tree}noise_p50_us_{kind}"] <= r[f"{tree}noise_p99_us_{kind}"]
            assert 0 < r[f"steady_alloc_p50_us_{kind}"] <= r[f"steady_alloc_p99_us_{kind}"]
        assert r["tree_pages"] >= 500
        assert r["match_hit_array_x_floor"] == pytest.approx(r["match_hit_array_us"] / r["list_copy_us"])
        assert all(r[f"match_hit_{kind}_us"] > 0 for kind in ("list", "array", "numpy", "tensor"))
        assert r["fragmented_nodes"] == 256 // r["page_size"]
        # the tree holds at least each cached page's token ids (8 bytes each) and its page number
        assert r["tree_bytes_per_page"] >= 8 * r["page_size"] + 8


def test_bench_overlap_json_reports_each_phase(capsys):
    code, out, _ = run(capsys, "bench", "overlap", "--layers", "3", "--heads", "2", "--head-dim", "16",
                       "--query-heads", "4", "--tokens", "32,64", "--page-size", "16", "--repeat", "2", "--json")
    data = json.loads(out)
    assert code == 0
    cfg = data["config"]
    assert cfg["spec"] == "L3-bf16-k=2x16-v=2x16" and cfg["device"] == "cpu" and cfg["query_heads"] == 4
    assert cfg["load_bytes"] == {"32": 32 * 3 * 2 * 2 * 16 * 2, "64": 64 * 3 * 2 * 2 * 16 * 2}
    assert cfg["compute_flops_per_layer"]["64"] == 4 * 4 * 64 * 64 * 16
    assert [(r["tokens"], r["stat"]) for r in data["rows"]] == [(32, "median"), (32, "best"), (64, "median"),
                                                               (64, "best")]
    for r in data["rows"]:
        # NOTE: no bounds on the times themselves: on a shared CPU, phases may slow each other down
        assert r["load_ms"] > 0 and r["compute_ms"] > 0 and r["both_ms"] > 0
        shorter = min(r["load_ms"], r["compute_ms"])
        assert r["hidden"] == pytest.approx((r["load_ms"] + r["compute_ms"] - r["both_ms"]) / shorter)
        assert r["load_gbps"] == pytest.approx(cfg["load_bytes"][str(r["tokens"])] / r["load_ms"] / 1e6)
        assert r["load_shorter"] == (r["load_ms"] < r["compute_ms"])


def test_bench_overlap_table(capsys):
    code, out, _ = run(capsys, "bench", "overlap", "--layers", "2", "--heads", "1", "--head-dim", "8",
                       "--tokens", "16", "--page-size", "8", "--repeat", "1", "--layout", "layer_first")
    assert code == 0 and "L2-bf16-k=1x8-v=1x8" in out and "host layout layer_first" in out
    assert "median" in out and "best" in out and "hidden" in out


def test_demo_small_runs_identical_and_plots(capsys, tmp_path):
    pytest.importorskip("transformers")
    plot = tmp_path / "demo.png"
    code, out, _ = run(capsys, "demo", "--sessions", "2", "--turns", "3", "--device-tokens", "256",
                       "--host-tokens", "128", "--plot", str(plot), "--json", str(tmp_path / "d.json"))
    assert code == 0 and "identical in 6 of 6 requests" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "d.json").read_text())["summary"]
    assert summary["reused"]["device"] > 0 and summary["prefilled_tokens"] < summary["prompt_tokens"]
    held = summary["held_bytes"]  # MiMo's sliding layers keep windows: less than storing them for every token
    assert 0 < held["device"]["bytes"] < held["device"]["window_blind_bytes"]


@pytest.mark.parametrize("model", ["gemma3", "gpt-oss"])
def test_demo_serves_the_other_hybrid_models(capsys, model):
    pytest.importorskip("transformers")
    code, out, _ = run(capsys, "demo", "--model", model, "--sessions", "2", "--turns", "2", "--device-tokens", "256",
                       "--host-tokens", "256")
    assert code == 0 and "identical in 4 of 4 requests" in out and "window-blind" in out


@pytest.mark.parametrize("spec, fingerprint", [
    ("deepseek-v3", "L61-bf16-kv=1x576"),
    ("mimo-v2-flash", mimo_v2_flash().fingerprint()),
    ("mha:layers=61,heads=8,head_dim=192,v_head_dim=128", "L61-bf16-k=8x192-v=8x128"),
    ("k-only:layers=2,heads=1,head_dim=64", "L2-bf16-k=1x64"),
    ("components:2:k=2x8,v=2x4", "L2-bf16-k=2x8-v=2x4"),
])
def test_spec_option_takes_presets_and_kinds(capsys, spec, fingerprint):
    code, out, _ = run(capsys, "inspect", "--spec", spec, "--json")
    assert code == 0 and json.loads(out)["spec"] == fingerprint


def test_spec_option_rejects_unknown(capsys):
    code, _, err = run(capsys, "inspect", "--spec", "gpt-9")
    assert code == 2 and "use a preset" in err
