"""Every user error is one line on stderr and a non-zero exit, before any work starts.

Each command's work (the replay, the benchmark, the model, the report) is replaced by a
function that fails the test when called: a refusal must come before it.
"""

import json
from pathlib import Path

import pytest
import torch

from kvtier.cli import EXIT_BUG, main

WORK = ["kvtier.sim.parallel.simulate", "kvtier.sim.parallel.belady_hits", "kvtier.sim.parallel.run_tasks",
        "kvtier.cli.simulate.synthetic", "kvtier.demo.run",
        "kvtier.tiny_models.build", "kvtier.bench.transfer.run", "kvtier.bench.transfer.run_uniform",
        "kvtier.bench.transfer_hybrid.run_hybrid", "kvtier.bench.storage.run",
        "kvtier.bench.cache.run", "kvtier.bench.overlap.run", "kvtier.bench.replay.run",
        "kvtier.cli.inspect.layout_reports", "kvtier.cli.selfcheck.run"]
LINE = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the misuse was refused")

    for target in WORK:
        monkeypatch.setattr(target, forbidden)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the demo would put its storage


def refused(capsys, *argv) -> str:
    """Run the command; assert the one-line refusal and return it."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code != 0 and out == ""
    assert len(lines) == 1 and lines[0].startswith("kvtier") and "error: " in lines[0], err
    assert "Traceback" not in err
    return lines[0]


def trace(tmp_path, text, mode="w") -> Path:
    path = tmp_path / "t.jsonl"
    path.write_bytes(text) if mode == "wb" else path.write_text(text)
    return path


@pytest.mark.parametrize("argv, message", [
    (["demo", "--sessions", "0"], "--sessions: must be a positive integer, got '0'"),
    (["demo", "--turns", "-1"], "--turns: must be a positive integer"),
    (["demo", "--device-tokens", "100"], "--device-tokens 100 is not a multiple of --page-size 16"),
    (["demo", "--device", "tpu"], "device 'tpu': expected cpu, cuda or cuda:N"),
    (["simulate", "synthetic", "--block-tokens", "0"], "--block-tokens: must be a positive integer, got '0'"),
    (["simulate", "synthetic", "--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s: must be a finite number > 0"),
    (["simulate", "synthetic", "--host-gbps", "0"], "--host-gbps: must be a finite number > 0, got '0'"),
    (["simulate", "synthetic", "--storage-gbps", "nan"], "--storage-gbps: must be a finite number > 0"),
    (["simulate", "synthetic", "--sweep", "host-tokens=-5"], "--sweep host-tokens=-5: must be >= 0 tokens"),
    (["simulate", "synthetic", "--sweep", "device-tokens=1e6,inf"], "--sweep device-tokens=inf: must be a finite"),
    (["simulate", "synthetic", "--sweep", "host=5"], "expected NAME=A,B,... with NAME one of device-tokens"),
    (["simulate", "synthetic", "--device-tokens", "inf"], "must be a finite number of tokens, got 'inf' (only "
                                                          "--storage-tokens may be inf)"),
    (["simulate", "synthetic", "--device-tokens", "nan"], "--device-tokens: must be a number of tokens, got 'nan'"),
    (["simulate", "synthetic", "--storage-tokens", "nan"], "--storage-tokens: must be a number of tokens"),
    (["simulate", "synthetic", "--host-tokens", "100"], "--host-tokens 100 is less than one 512-token block"),
    (["simulate", "synthetic", "--device-tokens", "1e15"], "512-token blocks needs about 28.42 TiB of memory, more "),
    (["simulate", "synthetic", "--synthetic-sessions", "10000000000"], "--synthetic-sessions 10000000000 needs about"),
    (["simulate", "synthetic", "--jobs", "-1"], "--jobs: must be a non-negative integer (0: one per CPU), got '-1'"),
    (["simulate", "synthetic", "--jobs", "two"], "--jobs: must be a non-negative integer (0: one per CPU), got 'two'"),
    (["simulate", "synthetic", "--repeat-trace", "0"], "--repeat-trace: must be a positive integer, got '0'"),
    (["bench", "replay", "--times", "0"], "--times: must be a positive integer, got '0'"),
    (["bench", "replay", "--repeat", "0"], "--repeat: must be a positive integer, got '0'"),
    (["bench", "replay", "--policy", "lru"], "--policy: invalid choice: 'lru'"),
    (["bench", "transfer", "--page-size", "0"], "--page-size: '0': each comma-separated item must be a positive"),
    (["bench", "transfer", "--page-size", "16,x"], "--page-size: '16,x': each comma-separated item must be an "),
    (["bench", "transfer", "--repeat", "0"], "--repeat: must be a positive integer, got '0'"),
    (["bench", "transfer", "--dims", "128/x"], "--dims: '128/x' in '128/x': expected K or K/V head dims"),
    (["bench", "transfer", "--layouts", "page_frist"], "unknown name 'page_frist' in 'page_frist'; choose from"),
    (["bench", "transfer", "--backends", "direct,direct"], "'direct,direct' names an item twice"),
    (["bench", "transfer", "--device", "tpu"], "device 'tpu': expected cpu, cuda or cuda:N"),
    (["bench", "transfer", "--pages", "10000000000"], "10000000000 pages of 64 tokens needs about"),
    (["bench", "transfer", "--spec", "mimo-v2-flash", "--layers", "4"], "--layers is for the default geometries; a "),
    (["bench", "transfer", "--mha", "layers=2,heads=2,head_dim=8", "--heads", "2", "--dims", "8"],
     "--heads, --dims are for the default geometries"),
    (["bench", "transfer", "--dtype", "fp16"], "--dtype fp16 applies to --spec, --mha, --mla, --k-only or "),
    (["bench", "transfer", "--spec", "mimo-v2-flash", "--meta-pages", "8"], "a hybrid spec's run times its transfers "
                                                                           "only: drop --meta-pages"),
    (["bench", "transfer", "--spec", "mimo-v2-flash", "--page-size", "256"],
     "page size 256 does not divide the 128-token window of group 'swa': whole pages would move 256 of its tokens"),
    (["bench", "transfer", "--spec", "gpt-oss-120b", "--page-size", "32,48", "--pages", "1"],
     "page size 32: the prefix of 48 tokens (1 x 48) is not a whole number of 32-token pages"),
    (["bench", "transfer", "--spec", "mimo-v2-flash", "--pages", "10000000000"],
     "a prefix of 640,000,000,000 tokens (10000000000 pages of 64) in every layer group needs about"),
    (["bench", "transfer", "--spec", "llama3-8b", "--pages", "10000000000"],
     "10000000000 pages of 64 tokens of L32-bf16-k=8x128-v=8x128 needs about"),
    (["bench", "cache", "--prompt-tokens", "0"], "--prompt-tokens: must be a positive integer, got '0'"),
    (["bench", "cache", "--prompt-tokens", "100"], "prompt_tokens 100 must be at least 2 and a multiple of every"),
    (["bench", "cache", "--tree-pages", "10000000000000"], "--tree-pages 10000000000000 needs about"),
    (["bench", "storage", "--backends", "ftp"], "--backends: unknown name 'ftp' in 'ftp'; choose from file, redis,"),
    (["bench", "storage", "--pages", "10000000000"], "10000000000 pages of 64 tokens needs about"),
    (["bench", "overlap", "--tokens", "100"], "--tokens 100 is not a multiple of --page-size 64"),
    (["bench", "overlap", "--tokens", "64,0"], "--tokens: '64,0': each comma-separated item must be a positive"),
    (["bench", "overlap", "--head-dim", "x"], "--head-dim: must be an integer, got 'x'"),
    (["bench", "overlap", "--repeat", "0"], "--repeat: must be a positive integer, got '0'"),
    (["bench", "overlap", "--io-backend", "dma"], "--io-backend: invalid choice: 'dma'"),
    (["bench", "storage", "--cold-reads", "cold"], "--cold-reads: invalid choice: 'cold'"),
    (["bench", "overlap", "--layout", "page_frist"], "--layout: invalid choice: 'page_frist'"),
    (["bench", "overlap", "--device", "tpu"], "device 'tpu': expected cpu, cuda or cuda:N"),
    (["bench", "overlap", "--tokens", "10000000"], "a 10000000-token prompt needs about"),
    (["inspect", "--mha", "layers=99999999999999999999,heads=1,head_dim=1"],
     "--mha: layers=99999999999999999999 is more than 65,536; no model has that many"),
    (["inspect", "--components", "99999999999:k=1x8"], "--components: layers=99999999999 is more than 65,536"),
    (["inspect", "--spec", "hybrid:layers=99999999999,pattern=SF;full:heads=1,head_dim=8;swa:window=2,heads=1,"
      "head_dim=8"], "layers=99999999999 is more than 65,536"),
    (["simulate", "synthetic", "--host-bytes", "9" * 5000], "a size of 5000 digits; expected one such as 64GiB"),
    (["selfcheck", "--seed", str(10**30)], "--seed: must be an integer in [0, 2**63), got '1000000000000000"),
    (["bench", "transfer", "--seed", "-1"], "--seed: must be an integer in [0, 2**63), got '-1'"),
    (["demo", "--seed", str(2**63)], "--seed: must be an integer in [0, 2**63)"),
    (["inspect", "--k-only", "layers=1,heads=1,head_dim=1", "--page-size", str(10**15)],
     "--page-size 1000000000000000 needs about 28.42 PiB"),
    (["inspect", "--spec", "llama3-8b", "--page-size", str(10**15)], "1.31e+20 bytes, beyond torch's 2^63-byte limit"),
    (["selfcheck", "--pages", "10000000000"], "10000000000 pages of 16 tokens of L8-bf16-k=4x192-v=4x128 needs"),
    (["selfcheck", "--nonsense"], "unrecognized arguments: --nonsense"),
])
def test_misuse_is_refused_in_one_line(capsys, no_work, tmp_path, argv, message):
    line = refused(capsys, *argv)
    assert message in line
    assert list(tmp_path.iterdir()) == []  # nothing written, no demo storage


@pytest.mark.parametrize("command", [["bench", "transfer"], ["bench", "overlap"], ["demo"]])
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_is_refused_without_cuda(capsys, no_work, tmp_path, command, device):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert f"device '{device}': CUDA is not available here" in refused(capsys, *command, "--device", device)
    assert list(tmp_path.iterdir()) == []  # no demo storage


@pytest.mark.parametrize("command, flag", [(["simulate", "synthetic", "--json"], "--plot"), (["demo"], "--plot"),
                                           (["demo"], "--json")])
def test_outputs_are_checked_first(capsys, no_work, tmp_path, command, flag):
    missing = tmp_path / "missing" / "out"
    assert f"{flag} {missing}: directory" in refused(capsys, *command, flag, missing)
    assert f"{flag} {tmp_path}: is a directory" in refused(capsys, *command, flag, tmp_path)
    assert not missing.parent.exists()
    # a directory that lets root pass os.access but refuses the file itself (before, found after the run)
    assert f"{flag} /proc/kvtier.out: " in refused(capsys, *command, flag, "/proc/kvtier.out")


def test_jobs_count_the_memory_of_configurations_replayed_at_once(capsys, no_work, monkeypatch):
    monkeypatch.setattr("kvtier.cli.preflight.host_memory_bytes", lambda: 10 << 30)  # 8 GiB allowed
    argv = ["simulate", "synthetic", "--device-tokens", "1e11", "--sweep", "host-tokens=1e11,1e11"]
    assert "2 configurations replayed at once (--jobs 2) needs about 11.64 GiB" in refused(capsys, *argv, "--jobs", "2")

    class Replaying(Exception):
        pass

    def replay(*args):
        raise Replaying

    monkeypatch.setattr("kvtier.cli.simulate.synthetic", lambda **kw: [])  # one at a time, each point fits
    monkeypatch.setattr("kvtier.cli.simulate._run_with_progress", replay)
    assert main(argv + ["--jobs", "1"]) == EXIT_BUG  # the replay started; an exception there is a bug
    assert "Replaying" in capsys.readouterr().err


def test_bench_replay_needs_a_trace(capsys, no_work, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where ../shared/traces/ does not exist
    line = refused(capsys, "bench", "replay")
    assert "no trace given and ../shared/traces/synthetic_trace.jsonl does not exist here; pass a" in line
    assert "no such file" in refused(capsys, "bench", "replay", tmp_path / "missing.jsonl")
    assert "is a directory, not a file" in refused(capsys, "bench", "replay", tmp_path)


def test_traces_are_checked_line_by_line(capsys, no_work, tmp_path):
    assert "no such file" in refused(capsys, "simulate", tmp_path / "missing.jsonl")
    assert "is a directory, not a file" in refused(capsys, "simulate", tmp_path)
    path = trace(tmp_path, "")
    assert f"trace {path}: no requests" in refused(capsys, "simulate", path)
    trace(tmp_path, "\n  \n")
    assert "no requests" in refused(capsys, "simulate", path)
    trace(tmp_path, LINE + LINE.replace("[1, 2]", "[1, 2, 3]"))
    assert (f"{path}, line 2: 3 hash_ids for input_length 1024; 512-token blocks need ceil(1024 / 512) = 2"
            in refused(capsys, "simulate", path))
    trace(tmp_path, LINE)
    assert f"{path}, line 1: 2 hash_ids" in refused(capsys, "simulate", path, "--block-tokens", "256")
    bad = b'{"timestamp": 0, \xff}\n'
    trace(tmp_path, (LINE * 2).encode() + bad, mode="wb")
    assert f"{path}, line 3: not UTF-8 (byte 0xff at offset {bad.index(0xff)})" in refused(capsys, "simulate", path)
    trace(tmp_path, LINE.replace("0,", "NaN,", 1))
    assert "line 1: timestamp must be a finite number" in refused(capsys, "simulate", path)
    # rows json reads with errors other than a syntax error's, and ids the cache cannot hold
    trace(tmp_path, "[" * 100_000 + "]" * 100_000 + "\n")
    assert "line 1: not a trace row (RecursionError" in refused(capsys, "simulate", path)
    trace(tmp_path, LINE.replace("[1, 2]", "[1, " + "9" * 5000 + "]"))
    assert "line 1: not a trace row (ValueError" in refused(capsys, "simulate", path)
    trace(tmp_path, LINE.replace("[1, 2]", f"[1, {2**63}]"))
    assert "line 1: hash_ids must be in the int64 range" in refused(capsys, "simulate", path)
    trace(tmp_path, LINE.replace("[1, 2]", f"[1, {2**62}]"))
    assert "shift its hash ids" in refused(capsys, "simulate", path, "--repeat-trace", "3")


@pytest.mark.parametrize("command, flag", [(["simulate"], "--repeat-trace"), (["bench", "replay"], "--times")])
def test_copies_of_a_trace_are_sized_before_they_are_made(capsys, no_work, tmp_path, command, flag):
    path = trace(tmp_path, LINE * 100)
    assert f"{flag} {10**12} (about" in refused(capsys, *command, path, flag, str(10**12))


def test_block_count_follows_block_tokens(tmp_path, capsys):
    path = trace(tmp_path, LINE.replace("1024", "1000"))  # ends inside the second 512-token block
    assert main(["simulate", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["requests"] == 1


@pytest.mark.parametrize("url, message", [
    ("file:///proc/kvtier-no-such-dir", "--storage file:///proc/kvtier-no-such-dir: "),
    ("ftp://example.com/x", "unknown storage scheme 'ftp'"),
    ("redis://127.0.0.1:1", "--storage redis://127.0.0.1:1: "),
    ("redis+cluster://127.0.0.1:1", "--storage redis+cluster://127.0.0.1:1: "),
])
def test_storage_that_cannot_open_is_refused(capsys, no_work, tmp_path, url, message):
    if url.startswith("redis"):
        pytest.importorskip("redis")
    pytest.importorskip("transformers")
    assert message in refused(capsys, "demo", "--storage", url)
    assert list(tmp_path.iterdir()) == []


def test_simulate_json_is_strict_and_documented(capsys):
    code = main(["simulate", "synthetic", "--synthetic-sessions", "3", "--storage-tokens", "inf", "--sweep",
                 "host-tokens=1024,1e4", "--json"])
    out = capsys.readouterr().out

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    rows = json.loads(out, parse_constant=no_constants)
    assert code == 0 and [r["storage_tokens"] for r in rows] == [None, None]
    assert [r["host_tokens"] for r in rows] == [1024, 10000] and all(type(r["device_tokens"]) is int for r in rows)
    assert main(["simulate", "--help"]) == 0
    assert "unlimited capacity (inf) is null" in " ".join(capsys.readouterr().out.split())


def test_inspect_does_not_allocate_the_page(capsys):
    # a 100,000-token page of this geometry is ~500 GB: inspect only computes its numbers
    code = main(["inspect", "--mha", "layers=61,heads=64,head_dim=192,v_head_dim=128", "--page-size", "100000",
                 "--json"])
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert code == 0 and {r["page_bytes"] for r in layouts} == {100000 * 61 * 64 * 320 * 2}


@pytest.mark.parametrize("with_ms, without_ms, words", [(50.0, 100.0, "2.0x less"), (100.0, 20.0, "5.0x more"),
                                                        (10.0, 10.0, "1.0x less")])
def test_demo_says_more_when_kvtier_is_slower(with_ms, without_ms, words):
    from kvtier.cli.demo import _less_or_more

    assert _less_or_more(with_ms, without_ms) == words


def test_demo_removes_its_storage_unless_kept(capsys, monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    small = ["demo", "--sessions", "1", "--turns", "2", "--device-tokens", "128", "--host-tokens", "128"]
    assert main(small) == 0 and list(tmp_path.glob("kvtier-demo-*")) == []
    assert main([*small, "--keep-storage"]) == 0
    kept, = tmp_path.glob("kvtier-demo-*")
    assert kept.name.startswith("kvtier-demo-") and any(p.is_file() for p in kept.rglob("*"))
    assert f"storage file://{kept} (kept)" in capsys.readouterr().out

