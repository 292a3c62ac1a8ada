"""``simulate --jobs``, ``--repeat-trace`` and ``kvtier bench replay``: same answers however they run."""

import json

import pytest

from kvtier.cli import main
from kvtier.sim import Request, SimConfig, simulate, synthetic
from kvtier.sim.parallel import Oracle, Replay, run_tasks
from kvtier.sim.traces import repeat


def write_trace(path, requests, block_tokens):
    path.write_text("".join(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": list(r.blocks)}) + "\n"
                            for r in requests))
    return path


def test_repeat_shifts_ids_and_times_so_copies_share_nothing():
    reqs = [Request(5.0, 3, 1, (-2, 7, 1)), Request(9.0, 2, 1, (-2, 4))]
    got = repeat(reqs, 3)
    assert got[:2] == reqs
    assert [r.blocks for r in got[2:]] == [(8, 17, 11), (8, 14), (18, 27, 21), (18, 24)]  # ids span 10
    assert [r.timestamp for r in got] == [5.0, 9.0, 10.0, 14.0, 15.0, 19.0]  # times span 4 + 1 ms
    assert [(r.input_length, r.output_length) for r in got] == [(3, 1), (2, 1)] * 3
    assert repeat([], 2) == [] and repeat(reqs, 1) == reqs
    with pytest.raises(ValueError, match="times must be a positive int"):
        repeat(reqs, 0)


def test_a_repeated_trace_hits_like_its_copies_one_after_another():
    reqs = synthetic(sessions=20, turns=3, system_prompts=2, block_tokens=1, seed=3)
    config = SimConfig(device_tokens=1000, host_tokens=1000, block_tokens=1)  # nothing is ever evicted
    one, three = simulate(reqs, config), simulate(repeat(reqs, 3), config)
    assert three.device_hit == 3 * one.device_hit and three.bound == 3 * one.bound


def test_tasks_give_the_same_results_in_any_number_of_workers():
    reqs = synthetic(sessions=30, turns=4, system_prompts=3, block_tokens=1, seed=1)
    tasks = [Replay(SimConfig(device_tokens=d, host_tokens=8, storage_tokens=16, block_tokens=1)) for d in (4, 8)]
    tasks += [Oracle(12, 1), Oracle(float("inf"), 1)]
    serial = run_tasks(reqs, tasks, 1)
    parallel = run_tasks(reqs, tasks, 3)
    assert [r.as_dict() for r in serial[:2]] == [r.as_dict() for r in parallel[:2]]
    assert serial[2:] == parallel[2:] and serial[2] < serial[3]
    assert serial[0].as_dict() != serial[1].as_dict()


def test_cli_jobs_output_equals_jobs_1(tmp_path, capsys):
    reqs = synthetic(sessions=40, turns=4, system_prompts=3, block_tokens=64, seed=2)
    path = write_trace(tmp_path / "t.jsonl", reqs, 64)
    argv = ["simulate", str(path), "--block-tokens", "64", "--device-tokens", "640", "--storage-tokens", "inf",
            "--sweep", "host-tokens=640,1280,2560", "--oracle", "--repeat-trace", "2", "--json"]
    outs = []
    for jobs in ("1", "2", "0"):
        assert main(argv + ["--jobs", jobs]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2]
    rows = json.loads(outs[0])
    assert [r["host_tokens"] for r in rows] == [640, 1280, 2560]
    assert rows[0]["requests"] == 2 * len(reqs)
    assert all(r["oracle"]["device+host"] <= r["oracle"]["all tiers"] == r["bound"] for r in rows)
    assert rows[0]["host_hit"] < rows[2]["host_hit"]


def test_cli_table_with_jobs(tmp_path, capsys):
    reqs = synthetic(sessions=10, turns=3, system_prompts=2, block_tokens=64, seed=2)
    path = write_trace(tmp_path / "t.jsonl", reqs, 64)
    assert main(["simulate", str(path), "--block-tokens", "64", "--device-tokens", "640", "--sweep",
                 "host-tokens=640,1280", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{len(reqs)} requests" in out and "1,280" in out


def test_bench_replay_json_is_deterministic(tmp_path, capsys):
    reqs = synthetic(sessions=30, turns=4, system_prompts=3, block_tokens=512, seed=4)
    path = write_trace(tmp_path / "t.jsonl", reqs, 512)
    assert main(["bench", "replay", str(path), "--times", "2", "--repeat", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["requests"] == 2 * len(reqs) and result["identical"] is True
    assert len(result["digest"]) == 16 and len(result["replay_s_all"]) == 2
    assert result["config"]["storage_tokens"] is None  # unlimited, strict JSON
    want = simulate(repeat(reqs, 2), SimConfig(device_tokens=1_000_000, host_tokens=4_000_000,
                                               storage_tokens=float("inf")))
    assert result["hits"]["device_hit"] == want.device_hit and result["hits"]["bound"] == want.bound
    assert result["x_floor"] == pytest.approx(result["replay_s"] / result["floor_s"])
    assert main(["bench", "replay", str(path), "--times", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert result["digest"] in out and "floor = one Python pass" in out


def test_bench_replay_with_a_hybrid_spec_replays_both_caches(tmp_path, capsys):
    """``--spec mimo-v2-flash``: the hybrid cache's replay beside the uniform one's, each
    with the hits ``simulate`` gives for its spec, and the ratio of their best times."""
    from kvtier.hybrid import mimo_v2_flash

    reqs = synthetic(sessions=30, turns=4, system_prompts=3, block_tokens=512, seed=4)
    path = write_trace(tmp_path / "t.jsonl", reqs, 512)
    assert main(["bench", "replay", str(path), "--times", "2", "--repeat", "2", "--json",
                 "--spec", "mimo-v2-flash"]) == 0
    result = json.loads(capsys.readouterr().out)
    other = result["spec"]
    assert other["hybrid"] is True and other["spec"] == mimo_v2_flash().fingerprint()
    assert result["config"]["uniform_spec"] == SimConfig(1, 1).spec.fingerprint()
    config = SimConfig(device_tokens=1_000_000, host_tokens=4_000_000, storage_tokens=float("inf"))
    uniform = simulate(repeat(reqs, 2), config)
    hybrid = simulate(repeat(reqs, 2), SimConfig(device_tokens=1_000_000, host_tokens=4_000_000,
                                                 storage_tokens=float("inf"), spec=mimo_v2_flash()))
    assert result["hits"]["host_hit"] == uniform.host_hit
    assert (other["hits"]["device_hit"], other["hits"]["host_hit"], other["hits"]["storage_hit"]) == \
        (hybrid.device_hit, hybrid.host_hit, hybrid.storage_hit)
    assert len(other["replay_s_all"]) == 2 and other["replay_s"] == min(other["replay_s_all"])
    assert other["x_uniform"] == pytest.approx(other["replay_s"] / result["replay_s"])
    assert result["identical"] is True and len(other["digest"]) == 16
    assert main(["bench", "replay", str(path), "--times", "1", "--repeat", "1", "--spec", "mimo-v2-flash"]) == 0
    out = capsys.readouterr().out
    assert "x uniform" in out and "mimo-v2-flash" in out and "uniform (L32-bf16" in out


def test_bench_replay_refuses_a_bad_spec_in_one_line(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", synthetic(sessions=2, turns=1, block_tokens=512, seed=1), 512)
    assert main(["bench", "replay", str(path), "--spec", "no-such-model"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-model" in err[0]
