"""Hybrid geometries on the command line: the presets and the ``hybrid:`` spelling,
``kvtier inspect``'s per-group table, and ``kvtier simulate``'s byte capacities."""

import argparse
import json
import math

import pytest
import torch

from kvtier import Attention, HybridSpec, KVGroup, KVSpec
from kvtier.cli import build_parser, main
from kvtier.cli.simulate import sim_capacities
from kvtier.cli.spec import add_spec_arguments, bytes_fields, bytes_line, spec_from_args
from kvtier.cli.types import parse_bytes
from kvtier.hybrid import PRESETS, gemma3_27b, gpt_oss, mimo_v2_flash

MIMO = ("hybrid:layers=48,full=0/5/11/17/23/29/35/41/47;full:heads=4,head_dim=192,v_head_dim=128;"
        "swa:window=128,heads=8,head_dim=192,v_head_dim=128")
GPT_OSS_120B = "hybrid:layers=36,pattern=SF;full:heads=8,head_dim=64;swa:window=128,heads=8,head_dim=64"
TINY = "hybrid:layers=4,pattern=SF;full:heads=1,head_dim=8;swa:window=2,heads=2,head_dim=8"
LLAMA3_8B_BPT = 32 * 2 * 8 * 128 * 2  # 131,072 B a token


def spec(*argv):
    parser = argparse.ArgumentParser()
    add_spec_arguments(parser)
    return spec_from_args(parser.parse_args(list(argv)))


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def no_work(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the misuse was refused")

    for target in ("kvtier.cli.inspect.layout_reports", "kvtier.sim.parallel.simulate", "kvtier.sim.parallel.run_tasks",
                   "kvtier.cli.simulate.synthetic", "kvtier.cli.selfcheck.run"):
        monkeypatch.setattr(target, forbidden)


def refused(capsys, *argv) -> str:
    code, out, err = run(capsys, *argv)
    lines = err.splitlines()
    assert code == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("kvtier") and "error: " in lines[0], err
    assert "Traceback" not in err
    return lines[0]


# -- presets and the hybrid: spelling ----------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [("mimo-v2-flash", mimo_v2_flash()), ("gpt-oss-120b", gpt_oss(36)),
                                            ("gpt-oss-20b", gpt_oss(24)), ("gemma3-27b", gemma3_27b())])
def test_hybrid_presets_are_kvtier_hybrid_geometries(name, expected):
    assert spec("--spec", name) == expected
    assert spec("--spec", name, "--dtype", "fp16") == PRESETS[name](torch.float16)
    assert all(g.spec.dtype == torch.float16 for g in spec("--spec", name, "--dtype", "fp16").groups)


def test_mimo_preset_is_no_longer_a_uniform_spec():
    mimo = spec("--spec", "mimo-v2-flash")
    assert isinstance(mimo, HybridSpec) and mimo.bytes_per_token() == {"full": 23_040, "swa": 199_680}
    assert spec("--spec", "llama3-8b") == KVSpec.mha(32, 8, 128)  # uniform presets stay KVSpecs


@pytest.mark.parametrize("text, expected", [
    (MIMO, mimo_v2_flash()),
    (MIMO.replace("full=0/5/11/17/23/29/35/41/47", "swa=1-4/6-10/12-16/18-22/24-28/30-34/36-40/42-46"),
     mimo_v2_flash()),
    (GPT_OSS_120B, gpt_oss(36)),
    (GPT_OSS_120B.replace("layers=36", "layers=24").replace("pattern=SF", "pattern=sf"), gpt_oss(24)),
    ("hybrid:layers=62,pattern=SSSSSF;full:heads=16,head_dim=128;swa:window=1024,heads=16,head_dim=128",
     gemma3_27b()),
    (" hybrid:layers=4 , pattern=SF ; swa: window=2,heads=2,head_dim=8 ; full: heads=1,head_dim=8",
     HybridSpec((KVGroup("full", (1, 3), KVSpec.mha(2, 1, 8)),
                 KVGroup("swa", (0, 2), KVSpec.mha(2, 2, 8), Attention.sliding(2))))),
    ("hybrid:layers=3,pattern=S;swa:window=64,heads=2,head_dim=8",
     HybridSpec((KVGroup("swa", (0, 1, 2), KVSpec.mha(3, 2, 8), Attention.sliding(64)),))),
    ("hybrid:layers=4,full=0-3;full:heads=2,head_dim=64,v_head_dim=32", KVSpec.mha(4, 2, 64, 32)),  # all full
])
def test_hybrid_spelling_gives_the_same_spec(text, expected):
    assert spec("--spec", text.strip()) == expected


def test_hybrid_spelling_takes_the_dtype():
    assert spec("--spec", MIMO, "--dtype", "fp32") == mimo_v2_flash(torch.float32)


@pytest.mark.parametrize("text, message", [
    ("hybrid:full=0;full:heads=1,head_dim=8", "the first part 'full=0' needs layers=N"),
    ("hybrid:layers=four,full=0", "--spec hybrid: layers='four' is not an integer"),
    ("hybrid:layers=0,full=0", "--spec hybrid: layers=0 must be a positive integer"),
    ("hybrid:layers=4,layers=5,full=0", "layers= given twice"),
    ("hybrid:layers=4,heads=2", "bad item 'heads=2'; keys are layers, full, swa, pattern"),
    ("hybrid:layers=4;full:heads=1,head_dim=8", "needs exactly one of full=IDS, swa=IDS, pattern=LETTERS (got 0)"),
    ("hybrid:layers=4,full=0,pattern=SF", "needs exactly one of full=IDS, swa=IDS, pattern=LETTERS (got 2)"),
    ("hybrid:layers=4,full=0/9", "full=0/9: layer 9 is out of range [0, 4)"),
    ("hybrid:layers=4,full=0/x", "full=0/x: 'x' is not a layer id or a range A-B"),
    ("hybrid:layers=4,swa=3-1", "swa=3-1: range '3-1' runs backwards"),
    ("hybrid:layers=4,full=0/0-1", "full=0/0-1: layers 0 named twice"),
    ("hybrid:layers=4,pattern=SFX", "pattern='SFX': use letters F (full) and S (sliding), got 'X'"),
    ("hybrid:layers=4,pattern=SF;full:heads=1,head_dim=8", "layers 0,2 are swa but there is no swa: part"),
    ("hybrid:layers=4,pattern=F;full:heads=1,head_dim=8;swa:window=2,heads=1,head_dim=8",
     "a swa: part, but no layer is swa"),
    (TINY.replace("window=2,", ""), "the swa: part: missing window"),
    (TINY.replace("full:heads=1", "full:window=4,heads=1"),
     "the full: part: bad item 'window=4'; keys are heads, head_dim, v_head_dim"),
    (TINY.replace("heads=2", "heads=x"), "the swa: part: heads='x' is not an integer"),
    (TINY + ";mla:kv_lora_rank=512", "part 'mla:kv_lora_rank=512': expected full:KEY=N,... or swa:KEY=N,..."),
    (TINY + ";full:heads=2,head_dim=8", "two full: parts"),
    (TINY.replace("window=2", "window=0"), "--spec hybrid: swa: Attention.window must be a positive int, got 0"),
    (TINY.replace("full:heads=1", "full:heads=0"), "--spec hybrid: full: Component.head_num must be a positive int"),
    ("hybrid", "use a preset"),
])
def test_bad_hybrid_spellings_are_one_line_errors(capsys, no_work, text, message):
    assert message in refused(capsys, "inspect", "--spec", text)
    assert message in refused(capsys, "simulate", "synthetic", "--spec", text)


def test_help_documents_the_hybrid_spelling(capsys):
    for command in ("inspect", "simulate"):
        assert main([command, "--help"]) == 0
        text = "".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
        assert "hybrid:layers=N,{full=IDS|swa=IDS|pattern=F/Sletters}" in text
        assert "".join(MIMO.split()) in text and "gpt-oss-120b" in text


# -- kvtier inspect ----------------------------------------------------------------------------------
def test_inspect_tabulates_mimo_v2_flash_groups(capsys):
    code, out, _ = run(capsys, "inspect", "--spec", "mimo-v2-flash")
    assert code == 0
    assert "9: 0,5,11,17,23,29,35,41,47" in out and "39: 1-4,6-10,12-16,18-22,24-28,30-34,36-40,42-46" in out
    assert "k 4x192, v 4x128" in out and "k 8x192, v 8x128" in out and "sliding 128" in out
    assert "23,040 B" in out and "199,680 B" in out and "25,559,040 B" in out
    assert "full attention: 23,040 B per token" in out
    assert "sliding windows: 25,559,040 B (24.38 MiB) per resume point" in out
    assert "222,720 B per token: 9.67x the full layers' 23,040 B" in out
    assert "host layouts: group full (L9-bf16-k=4x192-v=4x128)" in out
    assert "host layouts: group swa (L39-bf16-k=8x192-v=8x128)" in out


def test_inspect_json_for_a_hybrid_spec(capsys):
    code, out, _ = run(capsys, "inspect", "--spec", "mimo-v2-flash", "--page-size", "16", "--json")
    data = json.loads(out)
    assert code == 0 and data["spec"] == mimo_v2_flash().fingerprint() and data["page_size"] == 16
    assert (data["full_bytes_per_token"], data["window_bytes"], data["uniform_bytes_per_token"]) == (
        23_040, 25_559_040, 222_720)
    full, swa = data["groups"]
    assert {k: v for k, v in full.items() if k not in ("layouts", "components")} == {
        "name": "full", "attention": "full", "window": None, "layers": "0,5,11,17,23,29,35,41,47",
        "spec": "L9-bf16-k=4x192-v=4x128", "bytes_per_token": 23_040, "window_bytes": 0}
    assert swa["attention"] == "sliding" and swa["window"] == 128 and swa["window_bytes"] == 25_559_040
    assert swa["components"] == [{"name": "k", "heads": 8, "head_dim": 192}, {"name": "v", "heads": 8, "head_dim": 128}]
    assert [r["page_bytes"] for r in swa["layouts"]] == [16 * 199_680] * 4
    assert [r["page_bytes"] for r in full["layouts"]] == [16 * 23_040] * 4


def test_inspect_prints_an_all_full_hybrid_spelling_as_a_plain_spec(capsys):
    code, out, _ = run(capsys, "inspect", "--spec", "hybrid:layers=4,pattern=F;full:heads=2,head_dim=64")
    assert code == 0 and "spec L4-bf16-k=2x64-v=2x64: 4 layers" in out and "layer groups" not in out


def test_selfcheck_refuses_a_hybrid_spec(capsys, no_work):
    line = refused(capsys, "selfcheck", "--spec", "gpt-oss-20b")
    assert "selfcheck takes one geometry; this spec is hybrid: full (full, layers 1,3,5" in line


# -- kvtier simulate: byte capacities and the report ------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("0", 0), ("64GiB", 64 << 30), ("1.5 TiB", 3 << 39), ("500GB", 500 * 10**9), ("2 KB", 2000),
    ("1.1GB", 1_100_000_000), ("3 mib", 3 << 20), ("10B", 10), ("1.0000001KiB", 1024), ("7TB", 7 * 10**12),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text, "--host-bytes") == expected


def _sim_args(*argv):
    return build_parser().parse_args(["simulate", "synthetic", *argv])


def test_bytes_convert_to_whole_tokens_of_a_uniform_spec():
    args = _sim_args("--device-bytes", "1GiB", "--host-bytes", "100GB", "--storage-bytes", "inf")
    caps = sim_capacities(KVSpec.mha(32, 8, 128), args)
    assert caps == (KVSpec.mha(32, 8, 128), 8192, 100 * 10**9 // LLAMA3_8B_BPT, math.inf)
    assert caps.host_tokens == 762_939  # rounded down
    caps = sim_capacities(KVSpec.mha(2, 1, 8, dtype=torch.float32), _sim_args("--device-bytes", "1000",
                                                                              "--storage-tokens", "5e3"))
    assert (caps.device_tokens, caps.host_tokens, caps.storage_tokens) == (7, 4_000_000, 5000)  # 1000 // 128
    default = sim_capacities(None, _sim_args("--host-bytes", "1MiB"))
    assert default.spec == KVSpec.mha(32, 8, 128) and default.host_tokens == 8 and default.device_tokens == 1_000_000


def test_sim_capacities_price_a_hybrid_token_by_its_groups():
    one = HybridSpec.of(KVSpec.mha(4, 2, 64))
    assert sim_capacities(one, _sim_args("--host-bytes", "2KiB")) == (KVSpec.mha(4, 2, 64), 1_000_000, 1, 0)
    mimo = mimo_v2_flash()
    aware = sim_capacities(mimo, _sim_args("--device-bytes", "1GiB"))
    assert aware.spec == mimo and aware.device_tokens == (1 << 30) // (23_040 + 0.25 * 199_680)
    blind = sim_capacities(mimo, _sim_args("--device-bytes", "1GiB", "--window-blind"))
    assert blind.device_tokens == (1 << 30) // 222_720
    assert sim_capacities(mimo, _sim_args("--device-bytes", "1GiB", "--sliding-ratio", "1")).device_tokens \
        == blind.device_tokens  # a window for every token costs what storing every token does


def test_simulate_reports_byte_capacities_as_tokens(capsys):
    argv = ["simulate", "synthetic", "--synthetic-sessions", "2", "--spec", "llama3-8b", "--device-bytes", "1GiB",
            "--host-bytes", "2GiB", "--storage-bytes", "1TB"]
    code, out, _ = run(capsys, *argv, "--json")
    row, = json.loads(out)
    assert code == 0 and (row["device_tokens"], row["host_tokens"], row["storage_tokens"]) == (
        8192, 16384, 10**12 // LLAMA3_8B_BPT)
    assert row["spec"] == "L32-bf16-k=8x128-v=8x128" and row["bytes_per_token"] == LLAMA3_8B_BPT
    assert row["group_bytes_per_token"] == {"kv": LLAMA3_8B_BPT} and row["window_bytes"] == 0
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "spec L32-bf16-k=8x128-v=8x128: 131,072 B per token" in out and "16,384" in out


def test_report_helpers_take_a_hybrid_spec():
    assert bytes_fields(mimo_v2_flash()) == {"spec": mimo_v2_flash().fingerprint(), "bytes_per_token": 222_720,
                                             "group_bytes_per_token": {"full": 23_040, "swa": 199_680},
                                             "window_bytes": 25_559_040}
    line = bytes_line(mimo_v2_flash())
    assert "full 23,040 B per token (full, 9 layers)" in line
    assert "swa 199,680 B per token (sliding 128, 39 layers; 25,559,040 B per resume point)" in line
    assert bytes_line(KVSpec.mha(32, 8, 128)) == "spec L32-bf16-k=8x128-v=8x128: 131,072 B per token"


@pytest.mark.parametrize("argv, message", [
    (["--host-bytes", "12 XB"], "--host-bytes '12 XB': unknown unit; use KiB, MiB, GiB, TiB"),
    (["--device-bytes=-1GiB"], "--device-bytes '-1GiB': expected a size such as 4096, 64GiB or 500GB"),
    (["--device-bytes", "1e9"], "--device-bytes '1e9': expected a size such as"),
    (["--device-bytes", "inf"], "--device-bytes 'inf': must be a finite size (only the storage tier may be inf)"),
    (["--host-bytes", "1GiB", "--host-tokens", "1e6"], "--host-tokens and --host-bytes both size the host tier"),
    (["--storage-tokens", "inf", "--storage-bytes", "1TB"], "--storage-tokens and --storage-bytes both size the"),
    (["--host-bytes", "1GiB", "--sweep", "host-tokens=1e6,2e6"],
     "--sweep host-tokens and --host-bytes both size the host tier; give one"),
    (["--host-bytes", "1MiB"], "--host-bytes 1MiB (8 tokens of 131,072 B) is less than one 512-token block"),
    (["--device-bytes", "4KiB", "--spec", "mha:layers=1,heads=1,head_dim=2", "--block-tokens", "1024"],
     "--device-bytes 4KiB (512 tokens of 8 B) is less than one 1024-token block"),
    (["--storage-bytes", "1MiB"], "--storage-bytes 1MiB (8 tokens of 131,072 B) is less than one 512-token block; "
                                  "give 0 for no storage"),
    (["--spec", "mimo-v2-flash", "--host-bytes", "1MiB"], "--host-bytes 1MiB (14 tokens of 72,960 B) is less than "
                                                          "one 512-token block"),
])
def test_bad_byte_capacities_are_one_line_errors(capsys, no_work, argv, message):
    assert message in refused(capsys, "simulate", "synthetic", *argv)
